"""Published LoRA adapters applied by an engine that holds the base model (``train.lora_rank``),
merged into its weights (``MergedAdapter``, ``rollout.lora_apply: merge``) or as low-rank terms
(``AdapterTerms``, ``terms``).

The learner publishes only its adapter matrices, ``<layer>.lora_A.default.weight`` (r × in) and
``<layer>.lora_B.default.weight`` (out × r) for each adapted linear layer
(``tether.train.lora``). The engine keeps its own copy of each adapted layer's base weight W₀,
taken the first time, and merges every version into its weights, W = W₀ + (α/r)·B·A, so it
samples at full speed (the native decoder packs the merged weights like any others) and at the
adapter's weights exactly as the learner computes them, to float rounding.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tether.errors import ConfigError

A_SUFFIX, B_SUFFIX = ".lora_A.default.weight", ".lora_B.default.weight"


class MergedAdapter:
    """Merges published adapters into ``model``'s weights at ``scale`` = α/r."""

    def __init__(self, model: torch.nn.Module, scale: float) -> None:
        self.model = model
        self.scale = scale
        self.base: dict[str, torch.Tensor] = {}
        """The base weight W₀ of each adapted layer (by the engine's parameter name)."""

    def apply(self, weights: Mapping[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        layers = [name[: -len(A_SUFFIX)] for name in weights if name.endswith(A_SUFFIX)]
        if not layers:
            example = next(iter(weights), None)
            raise ConfigError(f"the published weights hold no LoRA adapters (e.g. {example}); the learner "
                              "trains every weight while this engine expects adapters")
        with torch.no_grad():
            for layer in layers:
                target = params.get(f"{layer}.weight")
                if target is None:
                    raise ConfigError(f"an adapter for {layer!r}, a layer this engine's model does not have")
                base = self.base.setdefault(layer, target.detach().clone())
                a = weights[layer + A_SUFFIX].to(target.device, torch.float32)
                b = weights[layer + B_SUFFIX].to(target.device, torch.float32)
                if target.dtype == torch.float32:  # one fused pass, written in place: W₀ + s·B·A
                    torch.addmm(base, b, a, alpha=self.scale, out=target.data)
                else:
                    target.copy_(torch.addmm(base.float(), b, a, alpha=self.scale).to(target.dtype))


class AdapterTerms:
    """Published adapters as PEFT's low-rank terms: the engine's model gets the learner's LoRA
    layers (``tether.train.lora.attach``, frozen here), each version is copied into their A and B,
    and every forward computes x·W₀ᵀ + (α/r)·(x·Aᵀ)·Bᵀ. Nothing is merged; a version costs a copy
    of the adapters."""

    def __init__(self, model: torch.nn.Module, train) -> None:
        from tether.train import lora

        self.model = lora.attach(model, train).requires_grad_(False).eval()  # an engine never drops
        self.params = dict(self.model.named_parameters())

    def apply(self, weights: Mapping[str, torch.Tensor]) -> None:
        names = [name for name in weights if ".lora_" in name]
        missing = [name for name in self.params if ".lora_" in name and name not in weights]
        if not names or missing:
            raise ConfigError(f"the published adapters do not match this engine's LoRA layers: missing "
                              f"{missing[:3] or 'every adapter'}")
        with torch.no_grad():
            for name in names:
                self.params[name].copy_(weights[name])
