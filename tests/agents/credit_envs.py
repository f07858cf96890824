"""Environments for the credit tests (``test_agent_credit.py``), each loaded by path (``env.env_class``)."""

from __future__ import annotations

from tether.families.agent.env import Step


class OddTasksVary:
    """One step. On a task whose answer is odd the reward is the parity of the action's character
    codes' sum (it varies with what the model samples; a length would not, most random turns using
    the whole token budget); on an even one it is always 0 (a group with no variance)."""

    def reset(self, task, seed):
        self.odd = int(task["answer"]) % 2 == 1
        return "go\n"

    def step(self, action):
        return Step("ok\n", reward=float(sum(map(ord, action)) % 2) if self.odd else 0.0, done=True)


class FailsOnOddActions:
    """Two steps of reward 0.5; a step whose action's character codes sum to an odd number raises
    (an environment error, not an ``ActionError``): some episodes fail, the others return 1."""

    def reset(self, task, seed):
        self.n = 0
        return "go\n"

    def step(self, action):
        if sum(map(ord, action)) % 2:
            raise RuntimeError("the tool broke")
        self.n += 1
        return Step(f"o{self.n}\n", reward=0.5, done=self.n == 2)
