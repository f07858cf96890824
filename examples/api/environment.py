"""An environment as a Python class, for the agent family, handed straight to ``tether.train``
(docs/api.md, docs/agents.md).

    python examples/api/environment.py model.path=runs/models/agent-small

Each episode gets one instance: ``reset(task, seed)`` returns the first observation (``task`` is
the row: here a ``kv_lookup`` row, with its ``answer``), ``step(action)`` returns a ``Step``.
"""

import sys

import tether
from tether.families.agent.env import Step


class Echo:
    """Asks for the row's answer. A turn that says it ends the episode with reward 1; otherwise the
    episode goes on, told how many characters were right, and its last turn is paid that share (a
    short answer a little more)."""

    turns = 2

    def reset(self, task, seed):
        self.answer, self.turn = str(task["answer"]), 0
        return f"say {self.answer}\n"

    def step(self, action):
        self.turn += 1
        said = action.strip()
        right = sum(a == b for a, b in zip(said, self.answer, strict=False)) / max(len(self.answer), 1)
        if said == self.answer:
            return Step("", reward=1.0, done=True)
        if self.turn == self.turns:
            return Step("", reward=right - 0.05 * len(said), done=True)
        return Step(f"{right:.1f} right\n")


recipe = {
    "model": {"family": "agent"},
    "data": {"task": "kv_lookup"},  # its rows; the environment is ours
    "env": {"max_turns": 2, "max_turn_tokens": 4},
    "rollout": {"batch_size": 4, "group_size": 4},
    "train": {"num_batches": 40, "lr": 1e-3},
}
summary = tether.train(recipe, sys.argv[1:], env=Echo, run_dir="runs/api-environment")
print(f"trained {summary['trained_batches']} batches in {summary['wall_s']:.0f}s into {summary['run_dir']}")
