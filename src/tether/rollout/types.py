"""What a rollout worker is asked to do; it answers with a ``tether.loop.scored.ScoredBatch``."""

from __future__ import annotations

from dataclasses import dataclass

from tether.data.types import Example
from tether.decoding.sampling import SamplingParams


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
