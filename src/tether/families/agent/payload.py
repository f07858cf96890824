"""The agent family's payload: a rollout batch of B tasks × G episodes, columnar, pure Python.

Per sample it carries the token sequence with a per-token ``model`` flag (1: sampled by the
engine; 0: an observation), the engine's log-probs and versions on model tokens (0.0 and −1
elsewhere), and the episode it belongs to; per episode, the return, how it ended and its
transcript. An episode is one sample, or one more for each time its environment rewrote the
history (``Step.new_context``) or its chat template did not reproduce it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from tether.families.agent.episode import COUNTED
from tether.vocabulary import version_shares


@dataclass
class EpisodeBatch:
    """B task groups × G episodes. Episode e of group b is at ``b * G + e``; its samples are the
    rows ``r`` with ``episode_of[r] == b * G + e``, in order."""

    positions: list[int]
    """Each task's position in the task stream (B)."""
    ids: list[list[int]]
    """Per sample (row), as are ``model``, ``logprobs``, ``versions`` and ``episode_of``."""
    model: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]
    episode_of: list[int]
    """The episode each sample belongs to (non-decreasing; every episode has at least one)."""
    rewards: list[float]
    """Each episode's return (``env.failure_reward`` for a failed one)."""
    statuses: list[str]
    turns: list[int]
    transcripts: list[list[str]]
    group_size: int
    step_rewards: list[list[float]]
    """Each episode's reward at every step."""
    errors: list[str]
    """Each episode's failure message ('' when it did not fail)."""
    metrics: dict[str, float] = field(default_factory=dict)
    turn_tokens: list[list[int]] = field(default_factory=list)
    """Each episode's tokens sampled per turn, in order over its samples (empty: not recorded)."""
    counts: list[dict[str, int]] = field(default_factory=list)
    """Each episode's step counts (tool calls, tool errors, malformed calls; empty: none recorded)."""
    template_rewrites: list[int] = field(default_factory=list)
    """Each episode's new samples that its chat template, not its environment, started (empty: not
    recorded)."""

    @property
    def num_groups(self) -> int:
        return len(self.positions)

    def check(self) -> None:
        """Refuse a batch whose groups are not intact or whose per-token lists disagree."""
        n = self.num_groups * self.group_size
        lengths = {name: len(getattr(self, name)) for name in
                   ("rewards", "statuses", "turns", "transcripts", "step_rewards", "errors")}
        rows = {name: len(getattr(self, name)) for name in ("ids", "model", "logprobs", "versions")}
        wrong = {k: v for k, v in lengths.items() if v != n}
        if self.turn_tokens and len(self.turn_tokens) != n:
            wrong["turn_tokens"] = len(self.turn_tokens)
        if self.template_rewrites and len(self.template_rewrites) != n:
            wrong["template_rewrites"] = len(self.template_rewrites)
        wrong.update({k: v for k, v in rows.items() if v != len(self.episode_of)})
        if wrong:
            raise ValueError(
                f"episode batch is not whole: {wrong} (expected {self.num_groups} groups of "
                f"{self.group_size} episodes, {len(self.episode_of)} samples)"
            )
        if sorted(set(self.episode_of)) != list(range(n)) or self.episode_of != sorted(self.episode_of):
            raise ValueError(f"episode batch samples do not cover its {n} episodes in order: "
                             f"{self.episode_of}")
        for i, (ids, model, lps, vs) in enumerate(
            zip(self.ids, self.model, self.logprobs, self.versions, strict=True)
        ):
            if not len(ids) == len(model) == len(lps) == len(vs):
                raise ValueError(
                    f"sample {i}: {len(ids)} tokens, {len(model)} flags, {len(lps)} log-probs, "
                    f"{len(vs)} versions"
                )
            if any(v < 0 for v, m in zip(vs, model, strict=True) if m):
                raise ValueError(f"sample {i}: a model token carries no policy version")

    def model_versions(self) -> list[list[int]]:
        """Each sample's per-token versions, model tokens only."""
        return [
            [v for v, m in zip(vs, model, strict=True) if m]
            for vs, model in zip(self.versions, self.model, strict=True)
        ]

    def sample_lines(self) -> list[dict]:
        """What ``episodes.jsonl`` holds of each episode, in group order (``metrics.record_every``):
        its task position, group and place, how it ended (and why, when it failed), its return and
        the reward of every step, turns, rewrites of its history (new samples, by the environment
        or the chat template) and those by the template, model tokens, the oldest and newest
        version of those tokens, its tool calls, tool errors and malformed calls (when its
        environment counts them), and its transcript (observation, action, …, the final
        observation included)."""
        samples = Counter(self.episode_of)
        versions = self.episode_versions()  # one per model token
        g = self.group_size
        return [
            {"position": self.positions[e // g], "group": e // g, "episode": e % g,
             "status": self.statuses[e], "error": self.errors[e], "return": self.rewards[e],
             "step_rewards": self.step_rewards[e], "turns": self.turns[e], "rewrites": samples[e] - 1,
             "template_rewrites": self.template_rewrites[e] if self.template_rewrites else 0,
             "model_tokens": len(versions[e]),
             "versions": [min(versions[e]), max(versions[e])] if versions[e] else [],
             **({key: self.counts[e].get(key, 0) for key in COUNTED} if self.counts else {}),
             "transcript": self.transcripts[e]}
            for e in range(len(self.rewards))
        ]

    def episode_versions(self) -> list[list[int]]:
        """Each episode's per-token versions, model tokens only, over its samples in order."""
        out: list[list[int]] = [[] for _ in self.rewards]
        for e, versions in zip(self.episode_of, self.model_versions(), strict=True):
            out[e] += versions
        return out

    def version_shares(self) -> dict[int, float]:
        """version → the share of the batch's model tokens sampled under it: an episode is as old
        as its oldest model token."""
        return version_shares(self.model_versions())
