"""The payload of a real rollout batch: B prompts × G samples, columnar, pure Python.

It lives beside the loop's protocols because both sides use it: rollout workers build it and the
learner trains on it, and neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScoredBatch:
    """B prompts × G samples. Per-sample lists are in group order: sample s of prompt b is at
    ``b * G + s``."""

    positions: list[int]
    """Each prompt's position in the prompt stream (B)."""
    prompt_ids: list[list[int]]
    """Token ids of each prompt (B)."""
    completion_ids: list[list[int]]
    """Token ids of each sample (B·G), stop token included when it stopped."""
    logprobs: list[list[float]]
    """log μ of each sampled token, as the engine sampled it (B·G)."""
    versions: list[list[int]]
    """Policy version of each sampled token (B·G)."""
    rewards: list[float]
    """Each sample's reward (B·G)."""
    finish_reasons: list[str]
    completions: list[str]
    """Decoded text of each sample (B·G)."""
    group_size: int
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def num_groups(self) -> int:
        return len(self.prompt_ids)

    def check(self) -> None:
        """Refuse a batch whose groups are not intact (raises ``ValueError``)."""
        n = self.num_groups * self.group_size
        lengths = {
            "positions": len(self.positions), "completion_ids": len(self.completion_ids),
            "logprobs": len(self.logprobs), "versions": len(self.versions),
            "rewards": len(self.rewards), "finish_reasons": len(self.finish_reasons),
            "completions": len(self.completions),
        }
        expected = {k: (self.num_groups if k == "positions" else n) for k in lengths}
        wrong = {k: v for k, v in lengths.items() if v != expected[k]}
        if wrong:
            raise ValueError(f"scored batch is not whole: {wrong} (expected {self.num_groups} groups "
                             f"of {self.group_size})")
        for i, (toks, lps, vs) in enumerate(zip(self.completion_ids, self.logprobs, self.versions,
                                                strict=True)):
            if not len(toks) == len(lps) == len(vs):
                raise ValueError(f"sample {i}: {len(toks)} tokens, {len(lps)} log-probs, {len(vs)} versions")

    def version_shares(self) -> dict[int, float]:
        """version → the share of the batch's tokens sampled under it, oldest first (empty when
        no sample has a token)."""
        counts: dict[int, int] = {}
        for versions in self.versions:
            for v in versions:
                counts[v] = counts.get(v, 0) + 1
        total = sum(counts.values())
        return {v: counts[v] / total for v in sorted(counts)}
