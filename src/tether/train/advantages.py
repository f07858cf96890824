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

Per-turn credit (``env.credit=turn``, the agent family): an episode's turns t = 0 … K−1 have rewards
r_t (the reward after step t; a failed episode has ``env.failure_reward`` at its last turn and 0
before) and discounted returns

    R_t = Σ_{k≥t} γ^{k−t} r_k                                     (γ = env.gamma; R_0 = return at γ = 1)

and the estimator runs once per (prompt group, turn index): R_t of the group's episodes that have
a turn t form a group of their own, so a turn is compared with the other episodes' turns at the
same point of the task (GiGPO's step-level groups, Feng et al. 2025, with the turn index for the
anchor state; MT-GRPO's turn-level advantages, Zeng et al. 2025). Every token of turn t gets its
advantage. A slice of one episode has no baseline: its advantage is 0. Episodes left out
(``env.on_failure=mask``) are in no slice, so they move no baseline.

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
    """(N,) one advantage per sample, N = B·G, group-major; or (N, T) one per loss column (per-turn
    credit, ``turn_advantages``)."""
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


def turn_returns(rewards: torch.Tensor, present: torch.Tensor, gamma: float) -> torch.Tensor:
    """R_t = Σ_{k≥t} γ^{k−t} r_k for turn rewards ``rewards`` (E, K), zero where not ``present``
    (E, K) bool (an episode's turns are its first ones)."""
    r = rewards.float() * present  # (E, K)
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)  # (E,)
    for t in range(r.shape[1] - 1, -1, -1):
        running = r[:, t] + gamma * running
        out[:, t] = running
    return out * present


def sliced_advantages(returns: torch.Tensor, present: torch.Tensor, group_size: int, *,
                      estimator: str = "grpo", std_norm: bool = True, eps: float = 1e-6
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages (E, K) of ``returns`` (E, K), group-major episodes, with the estimator run on
    each (group, column) slice of the ``present`` entries; 0 where not present or a slice holds one
    entry. Also (B,) True for groups where every slice had equal returns."""
    e, k = returns.shape
    g = group_size
    r = returns.float().view(e // g, g, k)  # (B, G, K)
    have = present.view(e // g, g, k)
    out = torch.zeros_like(r)
    zero = torch.ones(e // g, dtype=torch.bool, device=r.device)  # (B,)
    fn = registry.advantages.get(estimator)
    for t in range(k):
        full = have[:, :, t].all(dim=1)  # (B,) groups whose every episode reached turn t: at once
        if g > 1 and bool(full.any()):
            vals = r[full, :, t]  # (b, G)
            out[full, :, t] = fn(vals, std_norm=std_norm, scope="group", eps=eps)
            zero[full] = zero[full] & (vals.std(dim=1, unbiased=False) <= eps)
        for b in (~full & have[:, :, t].any(dim=1)).nonzero().flatten().tolist():
            idx = have[b, :, t].nonzero().flatten()
            if len(idx) < 2:
                continue
            vals = r[b, idx, t][None]  # (1, n)
            out[b, idx, t] = fn(vals, std_norm=std_norm, scope="group", eps=eps)[0]
            zero[b] &= bool(vals.std(unbiased=False) <= eps)
    return out.view(e, k), zero


def turn_advantages(batch, *, estimator: str = "grpo", std_norm: bool = True, drop_zero_std: bool = False,
                    eps: float = 1e-6, clip: float = 0.0) -> Advantages:
    """Advantages of a batch whose columns carry their turn (``batch.turn``, ``turn_return``):
    ``sliced_advantages`` over its episodes' turns, one per column (N, L − 1); when every episode
    has one turn (``env.credit=episode`` with ``env.on_failure=mask``), one per row (N,)."""
    units = units_of(batch)  # (N,)
    g = batch.group_size
    e = (int(units[-1]) // g + 1) * g
    cols = batch.turn >= 0  # (N, T)
    k = int(batch.turn.max()) + 1 if bool(cols.any()) else 1
    ep = units[:, None].expand_as(batch.turn)[cols]  # (M,) the episode of each column in a turn
    t = batch.turn[cols]
    returns = torch.zeros(e, k, device=units.device)  # (E, K)
    present = torch.zeros(e, k, dtype=torch.bool, device=units.device)
    returns[ep, t] = batch.turn_return[cols].float()
    present[ep, t] = True
    adv, zero = sliced_advantages(returns, present, g, estimator=estimator, std_norm=std_norm, eps=eps)
    values = torch.zeros(batch.turn.shape, device=units.device)  # (N, T)
    values[cols] = adv[ep, t]
    if k == 1:
        values = adv[units, 0]  # (N,) one turn: one advantage per row
    group = torch.div(units, g, rounding_mode="floor")
    keep = ~zero[group] if drop_zero_std else torch.ones_like(group, dtype=torch.bool)  # (N,)
    clipped = 0.0
    if clip > 0:
        clipped = float((values[cols] if values.ndim == 2 else values).abs().gt(clip).float().mean())
        values = values.clamp(-clip, clip)
    return Advantages(values=values, keep=keep, frac_zero_std=float(zero.float().mean()),
                      clipped_frac=clipped)


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
