"""A linear layer's weight as the decoders read it: its own, or a PEFT LoRA layer's with its
active adapters added (W₀ + (α/r)·B·A, ``tether.train.lora``), in the autograd graph, so the
adapters train through the shared-prompt forward and the learner's held-out evaluation decodes
at the adapted weights, as the model's own forward would.

A training forward (``terms=True``) reads an adapted layer as its low-rank terms instead
(``LowRank``: x·Wᵀ = x·W₀ᵀ + (α/r)·(x·Aᵀ)·Bᵀ, as PEFT's own forward computes it): a merged weight
is a new (out, in) tensor that autograd keeps for the backward, every adapted layer's at once, a
whole base model's worth (in float32 beside a bfloat16 base: twice its bytes)."""

from __future__ import annotations

import torch


class LowRank:
    """An adapted layer's weight as W₀ and its adapters' (A (r, in), B (out, r), scale) terms;
    ``t()`` is its transpose, which a decoder multiplies from the left (``x @ w.t()``)."""

    def __init__(self, base: torch.Tensor, terms: list[tuple[torch.Tensor, torch.Tensor, float]],
                 transposed: bool = False) -> None:
        self.base, self.terms, self.transposed = base, terms, transposed

    def t(self) -> LowRank:
        return LowRank(self.base, self.terms, not self.transposed)

    def __rmatmul__(self, x: torch.Tensor) -> torch.Tensor:
        """x @ Wᵀ (the transposed view's product): (…, in) → (…, out)."""
        assert self.transposed, "a decoder multiplies by the transposed weight"
        out = x @ self.base.t()
        for a, b, scale in self.terms:
            out = out + (x @ a.t()) @ b.t() * scale  # (…, r) first: never an (out, in) tensor
        return out


def weight_of(linear: torch.nn.Module, *, terms: bool = False) -> torch.Tensor | LowRank:
    base = getattr(linear, "base_layer", None)
    if base is None:
        return linear.weight
    weight = base.weight
    if linear.disable_adapters or linear.merged:
        return weight
    active = [name for name in linear.active_adapters if name in linear.lora_A]
    if terms and active:
        return LowRank(weight, [(linear.lora_A[n].weight, linear.lora_B[n].weight, linear.scaling[n])
                                for n in active])
    for name in active:
        weight = weight + linear.get_delta_weight(name)
    return weight


def bias_of(linear: torch.nn.Module) -> torch.Tensor | None:
    return getattr(linear, "base_layer", linear).bias
