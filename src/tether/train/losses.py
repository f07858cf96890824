"""Policy losses: pure functions on tensors, registered by name; aggregation kept separate.

Every loss has one signature, ``fn(inputs, settings) -> (per_token_loss, metrics)``, with
per-token losses (N, T) still unreduced; ``aggregate`` then reduces them (token mean, sequence
mean, …). Symbols: r = π_θ/π_anchor per token, A the sequence's advantage, ε_low/ε_high the clip
range, sg[·] stop-gradient.

- ``ppo_clip`` (PPO with DAPO's clip-higher and an optional dual clip, Ye et al. 2020):
      ℓ_t = max(−A·r_t, −A·clip(r_t, 1−ε_low, 1+ε_high));  A < 0 and dual clip c: ℓ_t = min(ℓ_t, −c·A)
- ``gspo`` (Zheng et al. 2025, the GSPO-token form): s = exp(mean_t log r_t) over the sequence,
      s_t = sg[s]·π_θ(y_t)/sg[π_θ(y_t)],  ℓ_t = max(−A·s_t, −A·clip(s_t, 1−ε_low, 1+ε_high))
  (value s for every token, gradient s·∇log π_θ(y_t); the whole sequence is clipped together)
- ``cispo`` (MiniMax-M1, 2025): ℓ_t = −sg[clip(r_t, 1−ε_low, 1+ε_high)]·A·log π_θ(y_t)
  (the weight is clipped, never the gradient; MiniMax leaves the lower bound open, ε_low = 1)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from tether.errors import ConfigError, LossError

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                                 "seq_mean_token_sum_norm")


@dataclass(frozen=True)
class LossInputs:
    logp: torch.Tensor
    """(N, T) log π_θ of the sampled tokens, with gradient."""
    anchor_logp: torch.Tensor
    """(N, T) log-probs the ratio is taken against (μ for the behavior anchor, π_prox for proximal)."""
    advantages: torch.Tensor
    """(N,) one advantage per sequence, or (N, T) one per column (the agent family's
    ``env.credit=turn``, which only ppo_clip and cispo accept)."""
    mask: torch.Tensor
    """(N, T) 1.0 on completion tokens that count, 0.0 elsewhere."""


@dataclass(frozen=True)
class LossSettings:
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float = 0.0
    """c > 1 bounds the loss of negative-advantage tokens at c·|A| (0 = off)."""


LossFn = Callable[[LossInputs, LossSettings], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""A policy loss: per-column losses (N, T), unreduced, and metrics. Registered by name in
``tether.registry.losses`` (``train.loss``; ``tether.register_loss`` adds one)."""


def loss_for(name: str) -> LossFn:
    """The loss ``train.loss`` names: Tether's own as it is; a plug-in's checked (``CheckedLoss``)."""
    from tether import registry

    fn = registry.losses.get(name)
    return fn if registry.losses.canonical(name) in registry.losses.builtins else CheckedLoss(name, fn)


class CheckedLoss:
    """A loss a plug-in registered, held to the contract Tether's own keep by construction. On its
    first call: a pair (per-column losses, metrics), the losses of the shape of ``logp`` (N, T),
    unreduced, with a gradient, and the metrics a mapping of names to numbers. On every call:
    finite losses — a plug-in's NaN is a bug, so the run stops at the first one, naming the loss,
    instead of skipping the update as a non-finite gradient of Tether's own losses is skipped."""

    def __init__(self, name: str, fn: LossFn) -> None:
        self.name = name
        self.fn = fn
        self.checked = False

    def __call__(self, x: LossInputs, s: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = self.fn(x, s)
        if not self.checked:
            self._check(out, x)
            self.checked = True
        per_column, metrics = out
        bad = ~torch.isfinite(per_column.detach())
        if bool(bad.any()):
            outside = int((bad & (x.mask <= 0)).sum())
            poison = (f" ({outside} outside the loss mask, which poison the aggregate all the same: NaN × 0 "
                      "is NaN)" if outside else "")
            raise LossError(
                f"{self._who()} returned non-finite losses: NaN or infinite in {int(bad.sum())} of its "
                f"{bad.numel()} values{poison}. A plug-in's loss must be finite everywhere: look for a log, "
                "a division or an exp that can meet 0 or overflow, and clamp it (the run stops at its first "
                "non-finite loss instead of skipping the update)")
        return per_column, metrics

    def _who(self) -> str:
        return f"train.loss={self.name} (a plug-in's loss, {_where(self.fn)})"

    def _check(self, out: object, x: LossInputs) -> None:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise LossError(f"{self._who()} returned {type(out).__name__}; it must return a pair "
                            "(per-column losses (N, T), metrics dict): e.g. `return loss, {}`")
        per_column, metrics = out
        want = tuple(x.logp.shape)
        if not isinstance(per_column, torch.Tensor) or tuple(per_column.shape) != want:
            got = (f"a tensor of shape {tuple(per_column.shape)}" if isinstance(per_column, torch.Tensor)
                   else type(per_column).__name__)
            raise LossError(
                f"{self._who()} returned {got} as its losses; it must return one loss per column of "
                f"x.logp, shape {want} (N rows, T columns), unreduced: Tether masks and aggregates them "
                "itself (train.aggregation), so return e.g. `-x.advantages[:, None] * x.logp`, not its mean")
        if torch.is_grad_enabled() and x.logp.requires_grad and not per_column.requires_grad:
            raise LossError(
                f"{self._who()} returned losses without a gradient (detached, computed under "
                "torch.no_grad(), or rebuilt from .item()/.tolist()/NumPy), so no update could learn from "
                "them; compute them from x.logp with torch operations")
        if not isinstance(metrics, Mapping):
            raise LossError(f"{self._who()} returned {type(metrics).__name__} as its metrics; return a dict "
                            "of metric name → number (or {})")
        for key, value in metrics.items():
            if not isinstance(key, str) or not _is_number(value):
                raise LossError(
                    f"{self._who()} returned metric {key!r} = {value!r:.60}; each metric must be a name "
                    "(str) and a number: a float or int, or a one-element tensor")


def _is_number(value: object) -> bool:
    if isinstance(value, str | bytes) or (isinstance(value, torch.Tensor) and value.numel() != 1):
        return False
    try:
        float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return True


def _where(fn: object) -> str:
    code = getattr(fn, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else repr(fn)


def _per_column(adv: torch.Tensor) -> torch.Tensor:
    """Advantages (N,) or (N, T) as a tensor that broadcasts over the columns."""
    return adv[:, None] if adv.ndim == 1 else adv  # (N, 1) or (N, T)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def _outside(ratio: torch.Tensor, s: LossSettings) -> torch.Tensor:
    """1.0 where the ratio is outside [1 − ε_low, 1 + ε_high], whatever the advantage's sign: the
    clip fraction Flow-GRPO's reference and TRL report (Tether's clip_frac_low/high count only the
    clips that bind, i.e. that cut a gradient)."""
    return ((ratio < 1 - s.clip_low) | (ratio > 1 + s.clip_high)).float()


def behavior_outside(logp: torch.Tensor, behavior_logp: torch.Tensor, mask: torch.Tensor,
                     s: LossSettings) -> torch.Tensor | None:
    """``ratio/behavior_outside_clip_frac``: the share of the tokens in ``mask`` whose π_θ/μ is
    outside [1 − ε_low, 1 + ε_high], whatever the anchor: the seed's and Flow-GRPO's clip fraction
    against the behaviour policy, which staleness moves even where the proximal anchor's ratio is
    1. None when ``mask`` holds no token."""
    valid = mask.bool()
    return _outside(torch.exp(logp - behavior_logp)[valid], s).mean() if valid.any() else None


def ppo_clip(x: LossInputs, s: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ratio = torch.exp(x.logp - x.anchor_logp)  # (N, T)
    adv = _per_column(x.advantages)  # (N, 1), or (N, T) per turn
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - s.clip_low, 1 + s.clip_high)
    loss = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        low = ((adv < 0) & (ratio < 1 - s.clip_low)).float()
        high = ((adv > 0) & (ratio > 1 + s.clip_high)).float()
        metrics = {"ratio/clip_frac_low": _masked_mean(low, x.mask),
                   "ratio/clip_frac_high": _masked_mean(high, x.mask),
                   "ratio/outside_clip_frac": _masked_mean(_outside(ratio, s), x.mask)}
    if s.dual_clip > 1.0:
        bound = -adv * s.dual_clip  # positive where A < 0
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
        metrics["ratio/dual_clip_frac"] = _masked_mean(dual.float().detach(), x.mask)
    return loss, metrics


def gspo(x: LossInputs, s: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    log_ratio = (x.logp - x.anchor_logp) * x.mask  # (N, T)
    lengths = x.mask.sum(dim=1).clamp(min=1)  # (N,)
    seq_ratio = torch.exp(log_ratio.sum(dim=1) / lengths)  # (N,) s_i, with gradient
    token_ratio = seq_ratio.detach()[:, None] * torch.exp(x.logp - x.logp.detach())  # (N, T)
    adv = x.advantages[:, None]
    loss = torch.maximum(-adv * token_ratio, -adv * token_ratio.clamp(1 - s.clip_low, 1 + s.clip_high))
    with torch.no_grad():
        seq_adv = x.advantages
        has_tokens = (x.mask.sum(dim=1) > 0).float()
        low = ((seq_adv < 0) & (seq_ratio < 1 - s.clip_low)).float()
        high = ((seq_adv > 0) & (seq_ratio > 1 + s.clip_high)).float()
        n = has_tokens.sum().clamp(min=1)
        metrics = {"ratio/clip_frac_low": (low * has_tokens).sum() / n,
                   "ratio/clip_frac_high": (high * has_tokens).sum() / n,
                   "ratio/outside_clip_frac": (_outside(seq_ratio, s) * has_tokens).sum() / n,
                   "ratio/seq_mean": (seq_ratio * has_tokens).sum() / n}
    return loss, metrics


def cispo(x: LossInputs, s: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ratio = torch.exp(x.logp - x.anchor_logp)  # (N, T)
    weight = ratio.clamp(1 - s.clip_low, 1 + s.clip_high).detach()
    loss = -weight * _per_column(x.advantages) * x.logp
    with torch.no_grad():
        metrics = {"ratio/clip_frac_low": _masked_mean((ratio < 1 - s.clip_low).float(), x.mask),
                   "ratio/clip_frac_high": _masked_mean((ratio > 1 + s.clip_high).float(), x.mask),
                   "ratio/outside_clip_frac": _masked_mean(_outside(ratio, s), x.mask)}
    return loss, metrics


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, *, norm_constant: float = 1.0,
              total_tokens: float | None = None, total_seqs: float | None = None) -> torch.Tensor:
    """Reduce per-token ``loss`` (N, T) over ``mask`` to a scalar.

    - ``token_mean``: Σ ℓ / Σ mask (every token weighs the same; DAPO)
    - ``seq_mean_token_mean``: mean over sequences of each sequence's token mean (GRPO)
    - ``seq_mean_token_sum``: mean over sequences of each sequence's token sum
    - ``seq_mean_token_sum_norm``: mean over sequences of token sum / ``norm_constant`` (Dr. GRPO,
      with the constant the maximum completion length)

    ``total_tokens`` / ``total_seqs`` override the denominators, so that micro-batches of one
    mini-batch sum to the mini-batch's value. Sequences without tokens do not count.
    """
    masked = loss * mask
    has_tokens = (mask.sum(dim=1) > 0).float()
    seqs = has_tokens.sum() if total_seqs is None else total_seqs
    if mode == "token_mean":
        tokens = mask.sum() if total_tokens is None else total_tokens
        return masked.sum() / max(float(tokens), 1.0)
    if mode == "seq_mean_token_mean":
        per_seq = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    elif mode == "seq_mean_token_sum":
        per_seq = masked.sum(dim=1)
    elif mode == "seq_mean_token_sum_norm":
        per_seq = masked.sum(dim=1) / norm_constant
    else:
        raise ConfigError(f"unknown aggregation {mode!r}; valid ones are: {', '.join(AGGREGATIONS)}")
    return (per_seq * has_tokens).sum() / max(float(seqs), 1.0)


# Per-token estimates of KL(π_θ ‖ π_ref) from tokens sampled by the policy (Schulman's k1-k3),
# registered by name (``tether.registry.kl_estimators``, ``train.kl_estimator``). With
# d = log π_ref − log π_θ: k1 = −d, k2 = d²/2, k3 = exp(d) − d − 1 (unbiased, ≥ 0).


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    d = ref_logp - logp
    return 0.5 * d * d


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    d = ref_logp - logp
    return torch.exp(d) - d - 1
