"""Environments the agent tests play against, each loaded by path (``env.env_class``)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tether.families.agent.env import ActionError, Step

BARRIER: threading.Barrier | None = None


class Echo:
    """Three steps; each observation names the step and the action's length, so every observation
    differs and is encoded once where it arrives."""

    def reset(self, task, seed):
        self.n = 0
        return f"go {task.get('answer', '')}\n"

    def step(self, action):
        self.n += 1
        return Step(f"o{self.n}:{len(action)}\n", reward=0.25, done=self.n == 3)


class Hangs:
    """The second step never returns within any test's timeout."""

    def reset(self, task, seed):
        self.n = 0
        return "go\n"

    def step(self, action):
        self.n += 1
        if self.n == 2:
            time.sleep(3600)
        return Step("again\n")


CLOSED: list[str] = []
"""Names of the environments closed so far."""


class ResetRaises:
    def reset(self, task, seed):
        raise RuntimeError("no sandbox today")

    def step(self, action):
        return Step("")

    def close(self):
        CLOSED.append("ResetRaises")


class SlowSetUp:
    def __init__(self):
        time.sleep(3600)

    def reset(self, task, seed):
        return "go\n"

    def step(self, action):
        return Step("")


class Malformed:
    """Refuses every action as unparseable: the model sees ``bad`` and tries again."""

    def reset(self, task, seed):
        return "go\n"

    def step(self, action):
        raise ActionError("bad\n")


class WrongTypes:
    def reset(self, task, seed):
        return "go\n"

    def step(self, action):
        return 42


class Rendezvous:
    """A step returns only once ``BARRIER.parties`` steps are running at the same time."""

    def reset(self, task, seed):
        return "go\n"

    def step(self, action):
        BARRIER.wait(timeout=30)
        return Step("", reward=1.0, done=True)


class Summarises:
    """Three steps; the second replaces the history with a summary of it (``new_context``), so
    each episode is two samples. The return depends on what the model wrote, so groups differ."""

    def reset(self, task, seed):
        self.n, self.written = 0, 0
        return f"go {task.get('answer', '')}\n"

    def step(self, action):
        self.n += 1
        self.written += len(action)
        if self.n == 2:
            return Step(f"summary: {self.written} chars so far\n", new_context=True)
        return Step(f"o{self.n}\n", reward=float(self.written % 3), done=self.n == 3)


class SummarisesByTuple(Summarises):
    """The same, saying it through a gymnasium-style tuple's info."""

    def step(self, action):
        step = super().step(action)
        return step.observation, step.reward, step.done, False, {"new_context": step.new_context}


class OddEcho(Echo):
    """Echo rewarding actions of odd length (so a group's returns differ and updates commit)."""

    def step(self, action):
        step = super().step(action)
        return Step(step.observation, reward=float(len(action) % 2), done=step.done)


class FailsLateOnOddTasks:
    """Two steps; on a task whose answer is odd the second raises (an environment error after a
    turn or more), on an even one the episode returns the parity of its actions' lengths."""

    def reset(self, task, seed):
        self.n, self.odd = 0, int(task["answer"]) % 2 == 1
        return "go\n"

    def step(self, action):
        self.n += 1
        if self.odd and self.n == 2:
            raise RuntimeError("the tool broke")
        return Step(f"o{self.n}\n", reward=float(len(action) % 2), done=self.n == 2)


class SlowEcho(Echo):
    """Echo whose every step takes ``step_s`` seconds (a tool that takes its time; ``STEP_S``
    unless ``env.kwargs`` says), rewarding actions of odd length (so a group's returns differ and
    updates commit). ``stepped``: a file it creates when a step starts, for a test to wait on."""

    STEP_S = 0.3

    def __init__(self, stepped: str = "", step_s: float = STEP_S) -> None:
        self.stepped, self.step_s = stepped, step_s

    def step(self, action):
        if self.stepped:
            Path(self.stepped).touch()
        time.sleep(self.step_s)
        step = super().step(action)
        return Step(step.observation, reward=float(len(action) % 2), done=step.done)


class HugeReward:
    """A reward no float holds (an int of 401 digits)."""

    def reset(self, task, seed):
        return "go\n"

    def step(self, action):
        return Step("ok\n", reward=10**400, done=True)


class NoInfo:
    def reset(self, task, seed):
        return "go\n"

    def step(self, action):
        return Step("ok\n", done=True, info=None)


class DoneAsText:
    """``done="false"``, which is true read as a truth value."""

    def reset(self, task, seed):
        return "go\n"

    def step(self, action):
        return Step("ok\n", done="false")


class RewardsPile:
    """Each step's reward is within bounds; their sum is not (by the second step)."""

    def reset(self, task, seed):
        return "go\n"

    def step(self, action):
        return Step("ok\n", reward=6e5)


class Exits:
    """``step`` raises ``RAISES`` (a ``BaseException`` that is not an ``Exception``)."""

    RAISES: type[BaseException] = SystemExit

    def reset(self, task, seed):
        return "go\n"

    def step(self, action):
        raise self.RAISES("the tool quit")


class Interrupts(Exits):
    RAISES = KeyboardInterrupt


class CtrlC:
    """The first step of all sends the process a real SIGINT (as a user's Ctrl-C); every step then
    returns normally. ``SENT`` is cleared to arm it again."""

    SENT = threading.Event()

    def reset(self, task, seed):
        return "go\n"

    def step(self, action):
        import os
        import signal

        with _LOCK:
            first = not CtrlC.SENT.is_set()
            CtrlC.SENT.set()
        if first:
            os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)
        return Step("ok\n", done=True)


_LOCK = threading.Lock()


class HugeObservation:
    """The first step answers with ``SIZE`` characters; with ``DONE`` the episode ends there."""

    SIZE = 10_000_000
    DONE = False

    def reset(self, task, seed):
        return "go\n"

    def step(self, action):
        return Step("x" * self.SIZE, done=self.DONE)


class HugeLastObservation(HugeObservation):
    DONE = True


class NeedsArgs:
    def __init__(self, table, *, difficulty):
        self.table = table

    def reset(self, task, seed):
        return "go\n"

    def step(self, action):
        return Step("", done=True)
