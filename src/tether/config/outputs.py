"""Sections for what a run writes besides its per-batch metrics: held-out evaluations (``eval``),
checkpoints (``checkpoint``), and the samples and extra figures it records (``metrics``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tether.config.fields import Dropped, Resume, knob, recipe_value


@dataclass(frozen=True)
class EvalSection:
    """Held-out evaluation at hard boundaries."""

    RESUME: ClassVar[Resume] = Resume.ACCEPTED

    interval: int = knob(
        0,
        "Evaluate every this many trained batches, and at the end (0 = off). Each evaluation is a "
        "hard boundary: in-flight work is drained and the current weights published first.",
        min=0,
    )
    num_samples: int = knob(
        1,
        "Completions sampled per held-out prompt (at the rollout settings) besides the greedy one: "
        "eval/sampled_reward_mean is their mean (mean@k), eval/sampled_pass_at_1 the share fully "
        "right and, above 1, eval/pass_at_k the share of prompts with at least one fully right.",
        min=1,
    )
    seed: int | None = knob(
        None,
        "Seed of what the held-out evaluation measures: a built-in task's held-out examples (its "
        "train examples stay drawn by run.seed; the two splits never share a prompt), the flow "
        "family's evaluation noises and the sampled completions (eval.num_samples). Set it to "
        "compare runs of different run.seed on one held-out set; null = run.seed. A data.dataset's "
        "held-out rows are drawn by run.seed, or named by data.eval_dataset.",
        min=0, resume=Resume.HELD_OUT,
    )


@dataclass(frozen=True)
class CheckpointSection:
    """Checkpoints at hard boundaries."""

    RESUME: ClassVar[Resume] = Resume.ACCEPTED

    interval: int = knob(
        0,
        "Save every this many trained batches, and at the end (0 = off). Each save is a hard "
        "boundary: in-flight work is drained and the current weights published first.",
        min=0,
    )
    keep: int = knob(3, "Keep the newest this many checkpoints (0 = keep all).", min=0)
    sharded: bool = knob(
        False,
        "With train.world_size > 1: each rank writes its own shards of the model and optimizer "
        "(torch.distributed.checkpoint), so no process ever holds the whole state; a resume at any "
        "world size reshards them, and `tether eval` and model.path read them. false = gathered "
        "whole on rank 0 into the single-process format.",
        dropped=Dropped("with train.world_size=1 (from ranks to one process)", lambda recipe: (
            "it has no effect with train.world_size=1"
            if recipe_value(recipe, "train.world_size", 1) == 1 else None)),
    )


@dataclass(frozen=True)
class MetricsSection:
    """What a run records beyond its per-batch metrics."""

    RESUME: ClassVar[Resume] = Resume.ACCEPTED

    record_every: int = knob(
        1,
        "Write every N-th trained batch's samples to the run directory as it trains: samples.jsonl for "
        "text (prompt, answer, completion, reward, finish reason, versions) and flow (prompt, reward), "
        "episodes.jsonl for agents (transcript, per-step rewards, return, how it ended, versions); "
        "0 = none. A resume trims them to its checkpoint.",
        min=0,
    )
    attribution: bool = knob(
        False,
        "Split every token's importance log-ratio log π_old/μ into its staleness part log π_old/π_v "
        "and its numeric part log π_v/μ (v: the version that sampled the token), logged per batch as "
        "attribution/* (means, maxima, the staleness share). The learner keeps a copy of its weights "
        "for each version a batch can still hold (at most S·U + 1; attribution/memory_mb) and runs one "
        "more forward per older version in a batch. With learner ranks each keeps copies of its own shards.",
        feature="attribution",
    )
