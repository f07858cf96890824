"""What a learner gathers over one rollout batch's updates (``BatchStats``) and the figures it
reports for the batch from them (``batch_metrics``)."""

from __future__ import annotations

from typing import Any

import torch

from tether.procinfo import peak_rss_mb


class BatchStats:
    """Accumulates per-token tensors and scalars over one batch's updates."""

    def __init__(self) -> None:
        self.ratios: list[torch.Tensor] = []
        self.entropy: list[torch.Tensor] = []
        self.scalars: dict[str, list[float]] = {}
        self.skips: dict[str, int] = {}  # updates not made, by reason
        self.parts: dict[str, float] = {}
        self.tokens = [0, 0]  # real tokens, positions of the updates' micro-batches (padded grids)

    def add(self, name: str, value: float | torch.Tensor) -> None:
        self.scalars.setdefault(name, []).append(float(value))

    def part(self, name: str, value: float | torch.Tensor) -> None:
        """A micro-batch's share of an update's value (the shares sum to it), added by ``done``."""
        self.parts[name] = self.parts.get(name, 0.0) + float(value)

    def done(self) -> None:
        """The end of an update's micro-batches: each value's sum of shares is one figure."""
        for name, value in self.parts.items():
            self.add(name, value)
        self.parts.clear()

    def mean(self, name: str) -> float | None:
        values = self.scalars.get(name)
        return sum(values) / len(values) if values else None


ALWAYS = ("loss/policy", "loss/total", "train/grad_norm", "train/entropy", "ratio/mean", "ratio/std",
          "ratio/min", "ratio/max", "ratio/clip_frac_low", "ratio/clip_frac_high",
          "ratio/outside_clip_frac", "ratio/behavior_outside_clip_frac", "ratio/is_weight_mean",
          "ratio/is_weight_std", "ratio/is_weight_min", "ratio/is_weight_max", "ratio/masked_frac",
          "ratio/ess", "mismatch/logprob_abs_diff_mean", "mismatch/logprob_abs_diff_max", "mismatch/k3",
          "mismatch/numeric_token_frac", "mismatch/numeric_logprob_abs_diff_mean",
          "mismatch/numeric_logprob_abs_diff_max")
"""Reported for every batch; NaN when undefined (e.g. every group dropped for zero variance)."""


def batch_metrics(stats: BatchStats, *, lr: float, frac_zero_std: float, skipped: int, group: Any,
                  device: torch.device) -> dict[str, float]:
    """One batch's figures from its updates' ``stats``: every name in ``ALWAYS`` (NaN when
    undefined), the learning rate, skipped updates by reason, padding over every rank's
    micro-batches and the largest rank's peak memory."""
    out: dict[str, float] = dict.fromkeys(ALWAYS, float("nan"))
    out.update({k: v for k in stats.scalars if (v := stats.mean(k)) is not None})
    out["loss/kl"] = out.get("loss/kl", 0.0)
    out["train/lr"] = lr
    out["train/skipped_updates"] = float(skipped)
    for reason in ("train/skipped_no_signal", "train/skipped_nonfinite_grad"):
        out[reason] = float(stats.skips.get(reason, 0))
    out["reward/frac_zero_std"] = frac_zero_std
    _, tokens = group.collect(torch.tensor([stats.tokens], dtype=torch.float64),
                              torch.tensor([group.rank]))  # every rank's micro-batches
    real, grid = tokens.sum(0).tolist()
    if grid:
        out["train/pad_frac"] = 1.0 - real / grid
    out["memory/trainer_peak_mb"] = group.most(peak_rss_mb())  # with ranks: the largest rank's
    if device.type == "cuda":
        gpu_peak = torch.cuda.max_memory_allocated(device) / 2**20
        out["memory/trainer_gpu_peak_mb"] = group.most(gpu_peak)
    if stats.ratios:
        ratios = torch.cat(stats.ratios)
        out.update({"ratio/mean": float(ratios.mean()), "ratio/std": float(ratios.std(unbiased=False)),
                    "ratio/min": float(ratios.min()), "ratio/max": float(ratios.max())})
        out["train/entropy"] = float(torch.cat(stats.entropy).mean())
    return out
