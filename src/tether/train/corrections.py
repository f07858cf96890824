"""Off-policy corrections on π_old/μ, and the numbers that say how off-policy a batch was.

μ is what the rollout engine sampled from (its logged log-probs); π_old the trainer's
recomputation with the weights it held when the batch arrived (the proximal policy). Their ratio
ρ = π_old/μ is the train–inference mismatch plus the batch's staleness:

- truncated importance sampling: w_t = min(ρ_t, cap) per token, or w = min(Π_t ρ_t, cap) per
  sequence;
- masking: drop tokens with ρ_t outside [low, high] (token), or whole sequences whose product
  (sequence) or geometric mean (geometric) of ρ is outside it; and drop any sequence holding an
  outlier token with ρ_t > T or ρ_t < 1/T.

Reported: ``ratio/is_weight_mean|std|min|max``, ``ratio/masked_frac``, ``ratio/ess`` (effective sample
size of the final weights over valid tokens, (Σw)²/(n·Σw²), 1 when all equal),
``mismatch/logprob_abs_diff_mean|max`` and ``mismatch/k3`` (an estimate of KL(μ ‖ π_old) from the
sampled tokens: ρ − 1 − log ρ). Those mix the two causes; ``mismatch/numeric_*`` separates the
first: the same difference over only the tokens the engine sampled with the very weights π_old is
computed with (``same_weights``), where staleness is zero and what remains is numerics — the
engine's kernels, precision and sampling path against the trainer's forward
(``mismatch/numeric_token_frac`` says how many tokens that is; the mean and max are NaN when none).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tether.config.schema import CorrectionSection


@dataclass(frozen=True)
class Correction:
    weights: torch.Tensor
    """(N, T) importance weights (1 where no truncated IS is applied)."""
    keep: torch.Tensor
    """(N, T) 1.0 for tokens that stay in the loss."""
    metrics: dict[str, float]


def mismatch_metrics(old_logp: torch.Tensor, behavior_logp: torch.Tensor,
                     mask: torch.Tensor, same_weights: torch.Tensor | None = None) -> dict[str, float]:
    """|log π_old − log μ| over ``mask``; with ``same_weights`` ((N, T) bool: the token was
    sampled with the weights π_old comes from), also over those tokens alone."""
    m = mask.bool()
    if not m.any():
        return {}
    delta = old_logp - behavior_logp  # (N, T)
    diff = delta[m]
    out = {
        "mismatch/logprob_abs_diff_mean": float(diff.abs().mean()),
        "mismatch/logprob_abs_diff_max": float(diff.abs().max()),
        "mismatch/k3": float((torch.exp(diff) - 1 - diff).mean()),
    }
    if same_weights is not None:
        fresh = delta[m & same_weights].abs()
        out["mismatch/numeric_token_frac"] = fresh.numel() / diff.numel()
        if fresh.numel():
            out["mismatch/numeric_logprob_abs_diff_mean"] = float(fresh.mean())
            out["mismatch/numeric_logprob_abs_diff_max"] = float(fresh.max())
    return out


def correct(old_logp: torch.Tensor, behavior_logp: torch.Tensor, mask: torch.Tensor,
            s: CorrectionSection, *, weigh: bool, same_weights: torch.Tensor | None = None) -> Correction:
    """Weights and masks from ρ = π_old/μ. ``weigh`` applies the weight ρ itself (the proximal
    anchor's decoupled objective), truncated when ``s.tis`` is set; masks apply either way.
    ``same_weights`` marks tokens sampled with π_old's own weights (for ``mismatch/numeric_*``)."""
    with torch.no_grad():
        log_rho = (old_logp - behavior_logp) * mask  # (N, T)
        lengths = mask.sum(dim=1).clamp(min=1)  # (N,)
        keep = mask.clone()
        if s.mask == "token":
            rho = torch.exp(log_rho)
            keep = keep * ((rho >= s.mask_low) & (rho <= s.mask_high)).float()
        elif s.mask in ("sequence", "geometric"):
            seq_log = log_rho.sum(dim=1) if s.mask == "sequence" else log_rho.sum(dim=1) / lengths
            seq = torch.exp(seq_log)
            keep = keep * ((seq >= s.mask_low) & (seq <= s.mask_high)).float()[:, None]
        if s.outlier_token > 1.0:
            bad = ((log_rho.abs() > math.log(s.outlier_token)) & mask.bool()).any(dim=1)
            keep = keep * (~bad).float()[:, None]
        weights = torch.ones_like(log_rho)
        if weigh:
            if s.tis == "sequence":
                weights = torch.exp(log_rho.sum(dim=1)).clamp(max=s.tis_cap)[:, None].expand_as(log_rho)
            elif s.tis == "token":
                weights = torch.exp(log_rho).clamp(max=s.tis_cap)
            else:
                weights = torch.exp(log_rho)
        m = mask.bool()
        metrics: dict[str, float] = {}
        if m.any():
            effective = (weights * keep)[m]
            total = effective.sum()
            metrics = {
                "ratio/is_weight_mean": float(weights[m].mean()),
                "ratio/is_weight_std": float(weights[m].std(unbiased=False)),
                "ratio/is_weight_min": float(weights[m].min()),
                "ratio/is_weight_max": float(weights[m].max()),
                "ratio/masked_frac": float(1 - keep[m].mean()),
                "ratio/ess": float(total * total
                                   / (effective.numel() * (effective * effective).sum()).clamp(min=1e-12)),
            }
        metrics.update(mismatch_metrics(old_logp, behavior_logp, mask, same_weights))
    return Correction(weights=weights.contiguous(), keep=keep, metrics=metrics)
