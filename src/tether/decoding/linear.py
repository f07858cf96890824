"""A linear layer's weight as the decoders read it: its own, or a PEFT LoRA layer's with its
active adapters added (W₀ + (α/r)·B·A, ``tether.train.lora``), in the autograd graph, so the
adapters train through the shared-prompt forward and the learner's held-out evaluation decodes
at the adapted weights, as the model's own forward would."""

from __future__ import annotations

import torch


def weight_of(linear: torch.nn.Module) -> torch.Tensor:
    base = getattr(linear, "base_layer", None)
    if base is None:
        return linear.weight
    weight = base.weight
    if linear.disable_adapters or linear.merged:
        return weight
    for name in linear.active_adapters:
        if name in linear.lora_A:
            weight = weight + linear.get_delta_weight(name)
    return weight


def bias_of(linear: torch.nn.Module) -> torch.Tensor | None:
    return getattr(linear, "base_layer", linear).bias
