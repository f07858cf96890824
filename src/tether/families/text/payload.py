"""The text family's payload: a rollout batch of B prompts × G completions, columnar, pure Python.

The sampler builds it in a rollout worker (``tether.families.text.sampler``); the learner's policy
turns it into tensors (``tether.families.text.batch``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tether.vocabulary import version_shares


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
    prompts: list[str] = field(default_factory=list)
    """Each prompt's text (B), and ``answers`` its reference answer, for the samples record."""
    answers: list[str] = field(default_factory=list)
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
        lengths.update({k: len(getattr(self, k)) for k in ("prompts", "answers") if getattr(self, k)})
        expected = {k: (self.num_groups if k in ("positions", "prompts", "answers") else n) for k in lengths}
        wrong = {k: v for k, v in lengths.items() if v != expected[k]}
        if wrong:
            raise ValueError(f"scored batch is not whole: {wrong} (expected {self.num_groups} groups "
                             f"of {self.group_size})")
        for i, (toks, lps, vs) in enumerate(zip(self.completion_ids, self.logprobs, self.versions,
                                                strict=True)):
            if not len(toks) == len(lps) == len(vs):
                raise ValueError(f"sample {i}: {len(toks)} tokens, {len(lps)} log-probs, {len(vs)} versions")

    def sample_lines(self) -> list[dict]:
        """What ``samples.jsonl`` holds of each sample, in group order (``metrics.record_every``)."""
        g = self.group_size
        return [
            {"position": self.positions[i // g], "group": i // g, "sample": i % g,
             "prompt": self.prompts[i // g] if self.prompts else None,
             "answer": self.answers[i // g] if self.answers else None, "completion": self.completions[i],
             "reward": self.rewards[i], "finish_reason": self.finish_reasons[i],
             "tokens": len(self.completion_ids[i]),
             "versions": [min(self.versions[i]), max(self.versions[i])] if self.versions[i] else []}
            for i in range(len(self.rewards))
        ]

    def version_shares(self) -> dict[int, float]:
        """version → the share of the batch's tokens sampled under it, oldest first (empty when
        no sample has a token)."""
        return version_shares(self.versions)
