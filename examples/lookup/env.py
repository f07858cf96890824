"""Your own environment for the agent family, end to end (docs/agents.md): a lookup tool over a
table that comes with each dataset row.

The row (examples/lookup/*.jsonl) holds the hidden ``table`` ("a=3 b=7 ...") and the ``key`` asked
about; ``reset`` gets it as ``task``. The model calls ``get KEY`` and then answers ``ans DIGIT``. Both
methods are ``async``, as a client of a remote tool would be: Tether runs each on an environment
thread with its own event loop, under ``env.step_timeout_s``.
"""

from __future__ import annotations

import asyncio

from tether.families.agent.env import ActionError, Step


class Lookup:
    async def reset(self, task, seed):
        self.table = dict(pair.split("=") for pair in task["table"].split())
        self.key = task["key"]
        self.calls = 0
        return f"key {self.key}\n"

    async def step(self, action):
        await asyncio.sleep(0)  # where a real tool would await its answer
        verb, _, arg = action.strip().partition(" ")
        if verb == "get" and len(arg) == 1:
            self.calls += 1
            return Step(f"{arg}={self.table.get(arg, 'none')}\n", info={"tool_calls": self.calls})
        if verb == "ans" and arg.isdigit():
            return Step("", reward=float(arg == self.table[self.key]), done=True)
        raise ActionError("?\n")  # shown to the model, which may try again
