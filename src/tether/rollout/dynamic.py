"""DAPO's dynamic sampling (Yu et al. 2025, §3.3): a rollout batch is complete only when it holds
``rollout.batch_size`` prompt groups whose rewards are not all equal.

A group whose samples all score the same has advantage 0 under grpo and rloo: it teaches
nothing, and it dilutes a token-mean loss. Instead of training on fewer informative groups, the
worker generating a batch draws further prompts until it has B groups with reward variance, then
keeps the first B of them in draw order (the batch stays whole and atomic: the pool receives it
complete, or an error).

Where the extra prompts come from, so the run stays deterministic and resumable: batch k first
generates its own B prompts of the prompt stream (as without dynamic sampling), then draws from
*its own* slice of a second stream over the same examples in another order — positions
``k·X … k·X + X − 1`` of that stream, X = (``max_draws`` − 1)·B. So batch k's prompts depend on
k alone, never on which other batches finished first; the main stream neither replays nor skips
a prompt after a resume, and the extra prompts a batch did not need are left unused.

Each round draws as many prompts as the groups still missing, scaled up by the share of groups
found informative so far (at least 1 in 10), capped by what is left of the batch's slice. When the
slice runs out first, ``on_short`` decides: ``error`` fails the run naming the batch, or
``partial`` completes the batch with the zero-variance groups it drew (they carry no gradient
under grpo and rloo, and ``train.drop_zero_std`` leaves them out of the normaliser), counted in
``rollout/short_groups``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tether.errors import RolloutError
from tether.vocabulary import DynamicSampling, Example


class ShortBatchError(RolloutError):
    """Dynamic sampling ran out of prompts before the batch had enough informative groups."""


def informative(rewards: Sequence[float], eps: float = 1e-6) -> bool:
    """Whether a group's rewards are not all equal (population std above ``eps``)."""
    mean = sum(rewards) / len(rewards)
    return math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) > eps


@dataclass
class Group:
    """One prompt's samples, generated and scored."""

    position: int
    """The prompt's position in its stream (negative, −1 − position, for the extra stream)."""
    example: Example
    prompt_ids: list[int]
    samples: list[Any]
    rewards: list[float]
    texts: list[str]


def fill(batch_size: int, first: list[tuple[int, Example]], extra: list[tuple[int, Example]],
         run: Callable[[list[tuple[int, Example]], int], list[Group]], settings: DynamicSampling,
         batch_index: int) -> tuple[list[Group], dict[str, float]]:
    """The batch's groups: ``first`` generated as they are, then ``extra`` drawn in order until
    ``batch_size`` informative groups are found. ``run(prompts, round)`` generates and scores."""
    kept: list[Group] = []
    filtered: list[Group] = []
    todo, remaining, rounds, drawn = list(first), list(extra), 0, 0
    while todo:
        for group in run(todo, rounds):
            (kept if informative(group.rewards) and len(kept) < batch_size else filtered).append(group)
        drawn += len(todo)
        rounds += 1
        missing = batch_size - len(kept)
        if missing <= 0 or not remaining:
            break
        rate = max(0.1, len(kept) / drawn)
        take = min(len(remaining), math.ceil(missing / rate))
        todo, remaining = remaining[:take], remaining[take:]
    short = batch_size - len(kept)
    if short > 0:
        if settings.on_short == "error":
            raise ShortBatchError(
                f"dynamic sampling found only {len(kept)} of {batch_size} prompt groups with reward "
                f"variance in batch {batch_index} after drawing {drawn} prompts "
                f"(rollout.dynamic_sampling_max_draws={settings.max_draws}); raise it, lower "
                "rollout.batch_size, or set rollout.dynamic_sampling_on_short=partial to train on the "
                "groups found")
        zero = [g for g in filtered if not informative(g.rewards)][:short]
        kept += zero
        filtered = [g for g in filtered if g not in zero]
    zero_variance = sum(not informative(g.rewards) for g in filtered)
    metrics = {"rollout/prompts_drawn": float(drawn), "rollout/filtered_groups": float(zero_variance),
               "rollout/surplus_groups": float(len(filtered) - zero_variance),
               "rollout/draw_rounds": float(rounds), "rollout/short_groups": float(max(short, 0))}
    return kept, metrics
