"""The agent family's built-in tasks: an environment per episode, and scripted transcripts for the
warm start. Text is short and plain so a character-level tiny model can play.

``kv_lookup``: a hidden table of ``difficulty + 2`` keys (letters) to digits. The first
observation names a key (``key b``); the tool call ``get b`` answers ``b=7``; ``ans 7`` ends the
episode with reward 1 when right. Answering without the tool is right 1 time in 10.

``guess_number``: a hidden number below 10**difficulty. ``g 42`` is answered ``higher``, ``lower``
or, when right, ends the episode with reward 1.

Both answer an action they cannot parse with ``?`` (an ``ActionError``: the model sees it and may
try again, and it is counted).
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tether.data.tasks.base import Task
from tether.families.agent.env import ActionError, Step
from tether.vocabulary import Example

Segment = tuple[str, bool]
"""A piece of a transcript and whether the model wrote it."""


@dataclass(frozen=True)
class AgentTask(Task):
    """A task whose samples are episodes: ``environment`` plays one (``Environment``), ``script``
    writes a demonstration transcript of an example for the warm start (``rng`` decides its
    choices, ``quality`` in [0, 1] how good a player it shows)."""

    environment: type | None = None
    script: Callable[[Example, random.Random, float], list[Segment]] | None = None
    family: str = "agent"


def _no_verifier(completion: str, ex: Example) -> float:
    raise NotImplementedError("an agent task's reward comes from its environment")


# -- key-value lookup ----------------------------------------------------------------------------


class KeyValueLookup:
    """One episode of ``kv_lookup``."""

    def reset(self, task: Mapping[str, Any], seed: int) -> str:
        self.table = dict(pair.split("=") for pair in task["table"].split())
        self.key = task["key"]
        return f"key {self.key}\n"

    def step(self, action: str) -> Step:
        verb, _, arg = action.strip().partition(" ")
        if verb == "get" and len(arg) == 1:
            return Step(f"{arg}={self.table.get(arg, 'none')}\n", info={"tool_call": True})
        if verb == "ans" and arg.isdigit():
            return Step("", reward=float(arg == self.table[self.key]), done=True)
        raise ActionError("?\n")


def _draw_kv(rng: random.Random, d: int) -> Example:
    keys = rng.sample(string.ascii_lowercase[:12], d + 2)
    table = " ".join(f"{k}={rng.randrange(10)}" for k in keys)
    key = rng.choice(keys)
    return Example(
        prompt=f"kv {table} ?{key}",
        answer=dict(p.split("=") for p in table.split())[key],
        fields={"table": table, "key": key},
    )


def _script_kv(ex: Example, rng: random.Random, quality: float) -> list[Segment]:
    """With probability ``quality`` the tool is called first; otherwise a guess."""
    key = ex.fields["key"]
    opening = (f"key {key}\n", False)
    if rng.random() < quality:
        return [
            opening,
            (f"get {key}\n", True),
            (f"{key}={ex.answer}\n", False),
            (f"ans {ex.answer}\n", True),
        ]
    return [opening, (f"ans {rng.randrange(10)}\n", True)]


KV_LOOKUP = AgentTask(
    name="kv_lookup",
    description="call a lookup tool, then answer (chance without it: 1 in 10)",
    difficulties=(1, 2, 3, 4),
    default_difficulty=2,
    draw=_draw_kv,
    verify=_no_verifier,
    environment=KeyValueLookup,
    script=_script_kv,
)


# -- guess the number ----------------------------------------------------------------------------


class GuessNumber:
    """One episode of ``guess_number``."""

    def reset(self, task: Mapping[str, Any], seed: int) -> str:
        self.secret = int(task["answer"])
        self.top = int(task["top"])
        return f"guess 0-{self.top - 1}\n"

    def step(self, action: str) -> Step:
        verb, _, arg = action.strip().partition(" ")
        if verb != "g" or not arg.isdigit():
            raise ActionError("?\n")
        guess = int(arg)
        if guess == self.secret:
            return Step("", reward=1.0, done=True)
        return Step("higher\n" if guess < self.secret else "lower\n")


def _draw_guess(rng: random.Random, d: int) -> Example:
    top = 10**d
    secret = rng.randrange(top)
    return Example(prompt=f"guess {secret} #{rng.randrange(10**9)}", answer=str(secret), fields={"top": top})


def _script_guess(ex: Example, rng: random.Random, quality: float) -> list[Segment]:
    """Bisection with probability ``quality`` at each guess, else a random guess in range."""
    lo, hi, secret = 0, int(ex.fields["top"]) - 1, int(ex.answer)
    out: list[Segment] = [(f"guess 0-{hi}\n", False)]
    for _ in range(12):
        guess = (lo + hi) // 2 if rng.random() < quality else rng.randint(lo, hi)
        out.append((f"g {guess}\n", True))
        if guess == secret:
            return out
        if guess < secret:
            lo = guess + 1
            out.append(("higher\n", False))
        else:
            hi = guess - 1
            out.append(("lower\n", False))
    return out


GUESS_NUMBER = AgentTask(
    name="guess_number",
    description="find a hidden number from higher/lower replies",
    difficulties=(1, 2),
    default_difficulty=1,
    draw=_draw_guess,
    verify=_no_verifier,
    environment=GuessNumber,
    script=_script_guess,
)
