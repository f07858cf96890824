"""One episode as it is played (``Episode``), the training sequences it becomes (``Sample``), how it
can end (``ENDINGS``) and the budgets it is played within (``Limits``); ``episodes.Player`` plays
them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ENDINGS = ("done", "truncated", "max_turns", "token_budget", "error", "timeout")
"""How an episode ends: the environment said done, or truncated it; it used ``env.max_turns`` or
``env.max_episode_tokens``; an environment call raised or broke the protocol; a call ran past its
timeout. The last two are failures: the episode gets ``env.failure_reward`` and stays in its group."""
BUDGET_ENDINGS = ("max_turns", "token_budget")
"""Endings that count as truncated (``train.mask_truncated``, ``response/truncated_frac``)."""
FAILURES = ("error", "timeout")
COUNTED = ("tool_calls", "tool_errors", "malformed_calls")
"""Counts a step's ``info`` may carry (``tools.ToolEnv``'s): summed per episode, and per batch as
``agent/<name>``."""
RECORD_CHARS = 4096
"""What an episode's transcript keeps of an observation its sequence does not hold (the last one,
or one that did not fit): its first characters, then a marker with how many were left out."""


def clipped(text: str) -> str:
    """``text`` as a transcript keeps an observation the model never saw (``RECORD_CHARS``)."""
    if len(text) <= RECORD_CHARS:
        return text
    return f"{text[:RECORD_CHARS]}[... {len(text) - RECORD_CHARS:,} more characters left out]"


@dataclass(frozen=True)
class Sample:
    """One training sequence of an episode: the engine's and the environment's ids in order."""

    ids: list[int]
    model: list[int]
    logprobs: list[float]
    versions: list[int]


@dataclass
class Episode:
    """One episode as it is played: its sequence (the current sample's) and what happened."""

    index: int
    task: Mapping[str, Any]
    seed: int
    ids: list[int] = field(default_factory=list)
    model: list[int] = field(default_factory=list)
    """1 where the engine sampled the token, 0 on environment tokens."""
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    step_rewards: list[float] = field(default_factory=list)
    turn_tokens: list[int] = field(default_factory=list)
    """Tokens the engine sampled in each turn, in order (which model tokens are which turn's)."""
    transcript: list[str] = field(default_factory=list)
    """Observation, action, observation, ... as text (the final observation included)."""
    turns: int = 0
    status: str = "running"
    error: str = ""
    action_errors: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    """The ``COUNTED`` step counts (tool calls, tool errors, malformed calls) summed over its steps."""
    turn_truncations: int = 0
    """Turns cut off at the per-turn token budget."""
    env_s: float = 0.0
    env: Any = None
    lane: Any = None
    """Its ``envthreads.Lane``: the thread and event loop all its environment calls run on."""
    chat: Any = None
    """Its ``ChatTurns`` with data.chat_template, else None."""
    closed: list[Sample] = field(default_factory=list)
    """The samples before the last rewrite of the history, in order."""
    template_rewrites: int = 0
    """Rewrites by the chat template rather than the environment (``ChatTurns.restart``)."""

    @property
    def failed(self) -> bool:
        return self.status in FAILURES

    def reward(self, failure_reward: float) -> float:
        """The episode return (the sum of its step rewards), or ``failure_reward`` if it failed."""
        return failure_reward if self.failed else float(sum(self.step_rewards))

    @property
    def succeeded(self) -> bool:
        """Not failed, and a return of 1 or more (what a text sample's pass is)."""
        return not self.failed and self.reward(0.0) >= 1.0

    @property
    def model_tokens(self) -> int:
        return sum(sum(s.model) for s in self.samples())

    @property
    def rewrites(self) -> int:
        """How many times the history was rewritten, by the environment (``Step.new_context``) or
        by the chat template (``template_rewrites``)."""
        return len(self.closed)

    def samples(self) -> list[Sample]:
        """The episode's training sequences: one, or one more per rewrite of the history. The
        current sequence counts once the model has a turn in it (or when it is the only one: an
        episode whose reset failed is an empty sample, so its group stays whole)."""
        current = Sample(self.ids, self.model, self.logprobs, self.versions)
        return [*self.closed, current] if any(self.model) or not self.closed else list(self.closed)

    def rewrite(self) -> None:
        """Close the sequence so far as a sample; the next one starts empty."""
        self.closed.append(Sample(self.ids, self.model, self.logprobs, self.versions))
        self.ids, self.model, self.logprobs, self.versions = [], [], [], []


@dataclass(frozen=True)
class Limits:
    """The ``env`` section's budgets, resolved."""

    max_turns: int
    max_turn_tokens: int
    max_episode_tokens: int
    step_timeout_s: float
    episode_timeout_s: float
    """Environment time per episode, set-up included."""
