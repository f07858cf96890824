"""The agent family's payload: a rollout batch of B tasks × G episodes, columnar, pure Python.

Per episode it carries the whole token sequence with a per-token ``model`` flag (1: sampled by
the engine; 0: an observation), the engine's log-probs and versions on model tokens (0.0 and −1
elsewhere), the return, how the episode ended and its transcript.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tether.vocabulary import version_shares


@dataclass
class EpisodeBatch:
    """B task groups × G episodes. Episode e of group b is at ``b * G + e``."""

    positions: list[int]
    """Each task's position in the task stream (B)."""
    ids: list[list[int]]
    model: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]
    rewards: list[float]
    """Each episode's return (``env.failure_reward`` for a failed one)."""
    statuses: list[str]
    turns: list[int]
    transcripts: list[list[str]]
    group_size: int
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def num_groups(self) -> int:
        return len(self.positions)

    def check(self) -> None:
        """Refuse a batch whose groups are not intact or whose per-token lists disagree."""
        n = self.num_groups * self.group_size
        lengths = {name: len(getattr(self, name)) for name in
                   ("ids", "model", "logprobs", "versions", "rewards", "statuses", "turns", "transcripts")}
        wrong = {k: v for k, v in lengths.items() if v != n}
        if wrong:
            raise ValueError(
                f"episode batch is not whole: {wrong} (expected {self.num_groups} groups of "
                f"{self.group_size})"
            )
        for i, (ids, model, lps, vs) in enumerate(
            zip(self.ids, self.model, self.logprobs, self.versions, strict=True)
        ):
            if not len(ids) == len(model) == len(lps) == len(vs):
                raise ValueError(
                    f"episode {i}: {len(ids)} tokens, {len(model)} flags, {len(lps)} log-probs, "
                    f"{len(vs)} versions"
                )
            if any(v < 0 for v, m in zip(vs, model, strict=True) if m):
                raise ValueError(f"episode {i}: a model token carries no policy version")

    def model_versions(self) -> list[list[int]]:
        """Each episode's per-token versions, model tokens only."""
        return [
            [v for v, m in zip(vs, model, strict=True) if m]
            for vs, model in zip(self.versions, self.model, strict=True)
        ]

    def version_shares(self) -> dict[int, float]:
        """version → the share of the batch's model tokens sampled under it: an episode is as old
        as its oldest model token."""
        return version_shares(self.model_versions())
