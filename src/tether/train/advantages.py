"""Group-relative advantages (GRPO family).

For B prompt groups of G samples with rewards r (B, G):

    A = r − mean_group(r)                          (the baseline is always the group mean)
    A = A / (std + eps)        when std_norm       (std per group, or over the batch: scope)

Before that, DAPO's soft overlong punishment (Yu et al. 2025, §3.4) may shape the rewards: with
L_max = rollout.max_new_tokens and a buffer of L_c tokens, a completion of |y| tokens gets

    R_len(y) = −f · min(max(|y| − (L_max − L_c), 0) / L_c, 1)      (0 up to L_max − L_c, −f at L_max)

added to its reward (f = reward.overlong_penalty).

Dr. GRPO turns ``std_norm`` off. A group whose rewards are all equal has A = 0 everywhere; it is
counted (``reward/frac_zero_std``) and can be dropped from the loss so it does not dilute the
token normaliser. Standard deviations are population (biased) ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class Advantages:
    values: torch.Tensor
    """(N,) one advantage per sample, N = B·G, group-major."""
    keep: torch.Tensor
    """(N,) False for samples of dropped zero-std groups."""
    frac_zero_std: float


def overlong_penalty(lengths: torch.Tensor, *, max_len: int, buffer: int, factor: float) -> torch.Tensor:
    """R_len for completion ``lengths`` (N,): 0 before the last ``buffer`` tokens, falling to −factor."""
    if not 0 < buffer <= max_len:
        raise ValueError(f"the overlong buffer must be 1..{max_len} tokens, got {buffer}")
    exceed = (lengths.float() - (max_len - buffer)).clamp(min=0.0)  # (N,)
    return -factor * (exceed / buffer).clamp(max=1.0)


def group_advantages(rewards: torch.Tensor, group_size: int, *, std_norm: bool = True,
                     scope: Literal["group", "batch"] = "group", drop_zero_std: bool = False,
                     eps: float = 1e-6) -> Advantages:
    """Advantages for group-major ``rewards`` (N,)."""
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)  # (B, G)
    centered = r - r.mean(dim=1, keepdim=True)  # (B, G)
    group_std = r.std(dim=1, unbiased=False, keepdim=True)  # (B, 1)
    zero = (group_std.squeeze(1) <= eps)  # (B,)
    if std_norm:
        std = group_std if scope == "group" else r.std(unbiased=False).expand_as(group_std)
        centered = centered / (std + eps)
    keep = (~zero if drop_zero_std else torch.ones_like(zero)).repeat_interleave(group_size)  # (N,)
    return Advantages(values=centered.reshape(-1), keep=keep, frac_zero_std=float(zero.float().mean()))
