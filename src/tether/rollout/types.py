"""What a rollout worker is asked to do; it answers with a ``tether.loop.scored.ScoredBatch``."""

from __future__ import annotations

from dataclasses import dataclass, field

from tether.data.types import Example
from tether.decoding.sampling import SamplingParams
from tether.rollout.dynamic import DynamicSampling


@dataclass(frozen=True)
class WorkItem:
    """One rollout batch for a worker to generate and score."""

    batch_index: int
    version: int
    examples: list[tuple[int, Example]]
    """(position in the prompt stream, example) for each prompt of the batch."""
    group_size: int
    params: SamplingParams
    seed: int
    dynamic: DynamicSampling | None = None
    """Dynamic sampling's settings, or None (the batch is its ``examples``, whatever they score)."""
    extra_examples: list[tuple[int, Example]] = field(default_factory=list)
    """With dynamic sampling: the batch's own slice of the extra stream, drawn from in order
    (positions −1 − p, p the position in that stream)."""
