"""LoRA adapters on a model, for the learner and the engines alike (``train.lora_rank``).

- ``attach``: PEFT's ``inject_adapter_in_model`` replaces each targeted linear layer (a
  ``torch.nn.Linear`` but the output head; embeddings, GPT-2's Conv1D and the head are refused) by a LoRA
  layer holding the frozen base weight (``….base_layer.weight``) and two small matrices A
  (r × in) and B (out × r), B starting at zero, so the adapted layer computes W₀x + (α/r)·B·A·x
  and the model starts as the base. Only A and B train; ``adapters`` are what is published.
  ``disabled`` switches them off (the learner's KL reference: the base, with no second copy).
- ``MergedAdapter`` (``rollout.lora_apply: merge``): an engine holding the base model adds each
  published version to its own copy of the base weights, W = W₀ + (α/r)·B·A.
- ``AdapterTerms`` (``terms``): an engine's model gets the same LoRA layers and each version is
  copied into them: low-rank terms in every forward, nothing merged.

The learner's side (checkpoints, the base's identity, export) is ``tether.train.lora``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from tether.errors import ConfigError

A_SUFFIX, B_SUFFIX = ".lora_A.default.weight", ".lora_B.default.weight"


def attach(model: torch.nn.Module, train: Any) -> torch.nn.Module:
    """``model`` with LoRA adapters on the layers ``train.lora_targets`` names (in place), only
    the adapters trainable. Refused (``_check_adapted``) when a target is not a linear layer, or is
    the output head, or is too small for ``train.lora_rank``."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as exc:
        raise ConfigError("train.lora_rank needs PEFT: pip install -e '.[lora]'") from exc
    targets = list(train.lora_targets)
    config = LoraConfig(r=train.lora_rank, lora_alpha=train.lora_alpha,
                        lora_dropout=train.lora_dropout,
                        target_modules="all-linear" if targets == ["all-linear"] else targets)
    head, names = _head(model), _linear_names(model)
    try:
        with warnings.catch_warnings():  # a tied head or embedding is refused below, in Tether's words
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
            model = inject_adapter_in_model(config, model)
    except ValueError as exc:
        raise ConfigError(f"train.lora_targets={targets}: {exc}; the model's linear layers are named "
                          f"{names}") from exc
    _check_adapted(model, train, head, names)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return model


def check(model_path: str | Path, train: Any) -> None:
    """Refuse, before a run starts anything, the targets ``attach`` would refuse: attached to the
    language model's skeleton, built from its config on the meta device (no weight is read). The
    other families' models are checked when their learner builds them."""
    from tether.modeling import model_config

    config = model_config(model_path)
    if config.get("tether_family") or "model_type" not in config:
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        skeleton_config = AutoConfig.from_pretrained(model_path, local_files_only=True)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(skeleton_config)
    except (OSError, ValueError, KeyError):
        return  # not a model transformers builds: said when the learner loads it
    with torch.device("meta"):
        attach(skeleton, train)


def _head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The output head of a language model (``lm_head``), which all-linear leaves out too."""
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def _linear_names(model: torch.nn.Module) -> list[str]:
    """The names (last parts) of the layers adapters can go on: the linear layers but the head."""
    head = _head(model)
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and m is not head})


def _check_adapted(model: torch.nn.Module, train: Any, head: torch.nn.Module | None,
                   names: list[str]) -> None:
    """Refuse the adapters PEFT put on a layer that is not ``torch.nn.Linear`` (an embedding,
    GPT-2's Conv1D, a convolution: the engines merge W₀ + (α/r)·B·A into a linear layer's weight
    and into nothing else), on the output head (tied to the input embeddings in most models, and
    left out by all-linear), or on a layer whose smaller side is below the rank (A is r × in and B
    out × r, so a rank above min(in, out) adds parameters and no expressiveness)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    which = f"train.lora_targets={list(train.lora_targets)}"
    fix = (f"adapters go on the model's linear layers, named {names}, or [all-linear]" if names else
           "this model has no linear layer to adapt (but its output head); train every weight with "
           "train.lora_rank=0")
    smallest = None
    for name, layer in model.named_modules():
        if not isinstance(layer, BaseTunerLayer):
            continue
        base = layer.get_base_layer()
        if head is not None and base is head:
            raise ConfigError(f"{which} adapts {name}, the model's output head (whose weight most models "
                              f"share with the input embeddings, and which all-linear leaves out); {fix}")
        if not isinstance(base, torch.nn.Linear):
            raise ConfigError(f"{which} adapts {name}, a layer of type {type(base).__name__}, not a linear "
                              f"one: the engines merge adapters into linear layers' weights alone; {fix}")
        side = min(base.in_features, base.out_features)
        if smallest is None or side < smallest[0]:
            smallest = (side, name, base.in_features, base.out_features)
    if smallest is not None and train.lora_rank > smallest[0]:
        side, name, fan_in, fan_out = smallest
        raise ConfigError(f"train.lora_rank={train.lora_rank} is above the size of {name} ({fan_in} → "
                          f"{fan_out}): an adapter's rank is at most its layer's smaller side; set "
                          f"train.lora_rank to {side} or less, or leave that layer out of train.lora_targets")


def adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name → tensor of every adapter matrix: what is trained, published and checkpointed."""
    return {name: p.detach() for name, p in model.named_parameters() if ".lora_" in name}


@contextlib.contextmanager
def disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model: every adapter switched off inside the block."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def write_peft_dir(tensors: Mapping[str, torch.Tensor], out: str | Path, *, rank: int, alpha: float,
                   base: str | None = None) -> Path:
    """``tensors`` (``adapters``' names) as a PEFT adapter directory: ``adapter_model.safetensors``
    under PEFT's names and ``adapter_config.json`` naming the adapted modules, which
    ``PeftModel.from_pretrained(base, out)`` and vLLM's LoRA requests load."""
    import json

    from safetensors.torch import save_file

    out = Path(out)
    peft_names = {f"base_model.model.{name.removesuffix('.default.weight')}.weight": t.contiguous()
                  for name, t in tensors.items() if ".lora_" in name}
    if not peft_names:
        raise ConfigError("the published weights hold no LoRA adapters: the learner trains every weight")
    modules = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in peft_names})
    out.mkdir(parents=True, exist_ok=True)
    save_file(peft_names, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": modules, "lora_dropout": 0.0, "bias": "none",
              "base_model_name_or_path": base}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


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
                if layer not in self.base:  # the first version: keep W₀ (later ones start from it)
                    self.base[layer] = target.detach().clone()
                base = self.base[layer]
                a = weights[layer + A_SUFFIX].to(target.device, torch.float32)
                b = weights[layer + B_SUFFIX].to(target.device, torch.float32)
                if target.dtype == torch.float32:  # one fused pass, written in place: W₀ + s·B·A
                    torch.addmm(base, b, a, alpha=self.scale, out=target.data)
                else:
                    target.copy_(torch.addmm(base.float(), b, a, alpha=self.scale).to(target.dtype))


class AdapterTerms:
    """Published adapters as PEFT's low-rank terms: the engine's model gets the learner's LoRA
    layers (``attach``, frozen here), each version is copied into their A and B,
    and every forward computes x·W₀ᵀ + (α/r)·(x·Aᵀ)·Bᵀ. Nothing is merged; a version costs a copy
    of the adapters."""

    def __init__(self, model: torch.nn.Module, train) -> None:
        self.model = attach(model, train).requires_grad_(False).eval()  # an engine never drops
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
