"""Advantage estimators for groups of samples (``train.advantage``).

For B prompt groups of G samples with rewards r (B, G), one advantage per sample:

    grpo          A = r − mean_group(r);  A = A / (std + eps) when std_norm (std per group, or
                  over the batch: scope)                           (Shao et al. 2024, DeepSeekMath)
    rloo          A_i = r_i − (1/(G−1)) Σ_{j≠i} r_j = G/(G−1) · (r_i − mean_group(r)): each
                  sample's baseline is the mean of the *other* samples of its prompt, so it does
                  not depend on the sample itself; not normalised      (Ahmadian et al. 2024)
    reinforce_pp  A = (r − mean_batch(r)) / (std_batch(r) + eps): one baseline and one scale for
                  the whole batch, no per-prompt baseline            (Hu 2025, REINFORCE++ §3)

REINFORCE++-baseline (Hu 2025: the group mean subtracted, then normalised over the batch) is
``grpo`` with ``scope="batch"``: group-centred advantages already have batch mean 0.

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

from tether import registry
from tether.errors import ConfigError


@dataclass(frozen=True)
class Advantages:
    values: torch.Tensor
    """(N,) one advantage per sample, N = B·G, group-major."""
    keep: torch.Tensor
    """(N,) False for samples of dropped zero-std groups."""
    frac_zero_std: float
    clipped_frac: float = 0.0
    """The share of advantages clamped by ``clip``."""


def units_of(batch) -> torch.Tensor:
    """(N,) what each row of a training batch is a sample of: itself, or with the batch's
    ``episode`` (an agent episode spanning several rows) that episode. Advantages are computed per
    unit and shared by its rows."""
    episode = batch.episode
    return torch.arange(batch.size, device=batch.rewards.device) if episode is None else episode


def per_episode(batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(rewards, loss tokens, ``batch.episode``): one of each per row, or, when an episode spans
    rows (``episode`` (N,), non-decreasing), one per episode: its return and its tokens summed."""
    rewards, lengths = batch.rewards, batch.mask.sum(dim=1)  # (N,)
    episode = batch.episode
    if episode is None:
        return rewards, lengths, None
    first = torch.cat([torch.ones(1, dtype=torch.bool, device=episode.device), episode[1:] != episode[:-1]])
    return rewards[first], lengths.new_zeros(int(episode[-1]) + 1).index_add(0, episode, lengths), episode


def overlong_penalty(lengths: torch.Tensor, *, max_len: int, buffer: int, factor: float) -> torch.Tensor:
    """R_len for completion ``lengths`` (N,): 0 before the last ``buffer`` tokens, falling to −factor."""
    if not 0 < buffer <= max_len:
        raise ConfigError(f"reward.overlong_buffer must be 1..{max_len} tokens, got {buffer}")
    exceed = (lengths.float() - (max_len - buffer)).clamp(min=0.0)  # (N,)
    return -factor * (exceed / buffer).clamp(max=1.0)


# The estimators, registered by name (``tether.registry.advantages``, ``train.advantage``; a
# plug-in adds one with ``tether.register_advantage``). Each maps group-major rewards r (B, G) to
# one advantage per sample (B, G); ``std_norm`` and ``scope`` mean something to grpo only.


def grpo(r: torch.Tensor, *, std_norm: bool, scope: str, eps: float) -> torch.Tensor:
    centered = r - r.mean(dim=1, keepdim=True)  # (B, G)
    if not std_norm:
        return centered
    group_std = r.std(dim=1, unbiased=False, keepdim=True)  # (B, 1)
    std = group_std if scope == "group" else r.std(unbiased=False).expand_as(group_std)
    return centered / (std + eps)


def rloo(r: torch.Tensor, *, std_norm: bool, scope: str, eps: float) -> torch.Tensor:
    g = r.shape[1]
    if g < 2:
        raise ConfigError("RLOO needs groups of at least 2 samples (rollout.group_size)")
    return (r - r.mean(dim=1, keepdim=True)) * (g / (g - 1))  # (B, G)


def reinforce_pp(r: torch.Tensor, *, std_norm: bool, scope: str, eps: float) -> torch.Tensor:
    return (r - r.mean()) / (r.std(unbiased=False) + eps)  # (B, G)


def group_advantages(rewards: torch.Tensor, group_size: int, *, estimator: str = "grpo",
                     std_norm: bool = True, scope: Literal["group", "batch"] = "group",
                     drop_zero_std: bool = False, eps: float = 1e-6, clip: float = 0.0) -> Advantages:
    """Advantages for group-major ``rewards`` (N,); ``std_norm`` and ``scope`` apply to grpo;
    ``clip`` > 0 clamps each to [−clip, clip] (Flow-GRPO's reference clamps at 5)."""
    assert rewards.ndim == 1 and rewards.numel() % group_size == 0, (
        f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)  # (B, G)
    # a group whose rewards are all equal (B,); a group of one (REINFORCE++'s batch baseline) is not
    zero = r.std(dim=1, unbiased=False) <= eps if group_size > 1 else torch.zeros(len(r), dtype=torch.bool)
    centered = registry.advantages.get(estimator)(r, std_norm=std_norm, scope=scope, eps=eps)
    keep = (~zero if drop_zero_std else torch.ones_like(zero)).repeat_interleave(group_size)  # (N,)
    values = centered.reshape(-1)
    clipped = 0.0
    if clip > 0:
        clipped = float((values.abs() > clip).float().mean())
        values = values.clamp(-clip, clip)
    return Advantages(values=values, keep=keep, frac_zero_std=float(zero.float().mean()),
                      clipped_frac=clipped)
