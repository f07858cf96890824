"""The learning-rate schedule: linear warm-up, then constant, linear or cosine decay.

A pure function of the optimizer-update count, so a resumed run continues the curve exactly (the
scheduler's state is only that count). The shapes are the ones verl (``warmup_style``,
``min_lr_ratio``) and TRL / transformers (``lr_scheduler_type`` constant, linear, cosine) offer:

    warm-up    f(k) = (k + 1) / W                                 for k < W
    constant   f(k) = 1
    linear     f(k) = m + (1 − m) · (1 − p)
    cosine     f(k) = m + (1 − m) · ½ (1 + cos π p)
               with p = (k − W) / (K − W) clamped to [0, 1]

k counts committed updates from 0, W = train.warmup_steps, K = the run's planned updates
(train.num_batches × train.updates_per_batch) and m = train.min_lr_ratio. The rate is lr · f(k).
"""

from __future__ import annotations

import math

from tether.errors import ConfigError

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, *, kind: str, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """f(k): the multiple of the base rate for update ``step`` (0-based)."""
    if kind not in SCHEDULES:
        raise ConfigError(f"unknown learning-rate schedule {kind!r}; valid: {', '.join(SCHEDULES)}")
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    span = max(total_steps - warmup_steps, 1)
    progress = min(max((step - warmup_steps) / span, 0.0), 1.0)
    decayed = 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decayed
