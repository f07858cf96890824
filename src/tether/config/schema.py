"""Every recipe key: sections, defaults, allowed values, and one sentence on what each does.

``docs/reference.md`` is generated from this file (``tether config reference``); a test keeps
the two in step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tether.config.fields import knob


@dataclass(frozen=True)
class RunSection:
    """The run as a whole."""

    seed: int = knob(0, "Seed for every random choice Tether makes (data order, sampling, init).", min=0)


@dataclass(frozen=True)
class AsyncSection:
    """Asynchrony: how far generation may run ahead of training."""

    max_staleness: int = knob(
        1,
        "S, in whole rollout batches: how many batches old the policy that generated a batch may "
        "be when that batch trains. 0 is synchronous (exactly on-policy); the budget in updates is "
        "S × train.updates_per_batch and S + 1 batches may be outstanding per published snapshot.",
        min=0,
    )
    max_inflight: int = knob(
        2,
        "Generations (rollout batches) that may run concurrently. More than max_staleness + 1 is "
        "never used.",
        min=1,
    )
    on_stale: Literal["error", "drop"] = knob(
        "error",
        "What to do with a batch above the staleness budget when it reaches the trainer: 'error' "
        "fails closed; 'drop' drops it, counts it (async/dropped_batches) and logs it.",
    )
    max_consecutive_drops: int = knob(
        16,
        "With on_stale=drop: fail the run after this many stale batches in a row instead of "
        "dropping forever (admission makes stale batches impossible unless something is broken).",
        min=1,
    )
    wait_timeout_s: float = knob(
        600.0,
        "Seconds the trainer waits for a rollout batch before failing the run with an error that "
        "names the worker and the batch.",
        min=0.001,
    )


@dataclass(frozen=True)
class TrainSection:
    """The learner's schedule."""

    num_batches: int = knob(20, "Rollout batches to train on in the whole run.", min=1)
    updates_per_batch: int = knob(
        1,
        "U: optimizer updates made from one rollout batch (it is split into U mini-batches).",
        min=1,
    )


@dataclass(frozen=True)
class RolloutSection:
    """What one rollout batch is and who generates it."""

    batch_size: int = knob(8, "Prompts per rollout batch.", min=1)
    group_size: int = knob(4, "Samples per prompt; advantages are relative within a group.", min=1)
    num_workers: int = knob(1, "Rollout worker processes (engines) generating concurrently.", min=1)


@dataclass(frozen=True)
class EvalSection:
    """Held-out evaluation at hard boundaries."""

    interval: int = knob(
        0,
        "Evaluate every this many trained batches, and at the end (0 = off). Each evaluation is a "
        "hard boundary: in-flight work is drained and the current weights published first.",
        min=0,
    )


@dataclass(frozen=True)
class CheckpointSection:
    """Checkpoints at hard boundaries."""

    interval: int = knob(
        0,
        "Save every this many trained batches, and at the end (0 = off). Each save is a hard "
        "boundary: in-flight work is drained and the current weights published first.",
        min=0,
    )


@dataclass(frozen=True)
class PlanSection:
    """Timings for `tether plan`'s virtual-time simulation (not used by training)."""

    gen_time: float = knob(1.0, "Seconds to generate and score one rollout batch on one engine.", min=0)
    gen_jitter: float = knob(
        0.0, "Coefficient of variation of generation time (lognormal); 0 = constant.", min=0
    )
    train_time: float = knob(1.0, "Seconds per optimizer update.", min=0)
    sync_time: float = knob(0.0, "Seconds to publish weights to the engines.", min=0)
    eval_time: float = knob(0.0, "Seconds per evaluation.", min=0)
    save_time: float = knob(0.0, "Seconds per checkpoint.", min=0)
    commits: list[int] = knob(
        [],
        "Committed updates per consumed batch, cycled (e.g. [2, 1, 2]); empty = always U. Models "
        "steps whose non-finite gradients were skipped.",
        min=0,
    )
    seed: int = knob(0, "Seed for the generation-time jitter.", min=0)


SECTIONS: dict[str, type] = {
    "run": RunSection,
    "async": AsyncSection,
    "train": TrainSection,
    "rollout": RolloutSection,
    "eval": EvalSection,
    "checkpoint": CheckpointSection,
    "plan": PlanSection,
}
"""Section name → section class, in the order the reference documents them."""
