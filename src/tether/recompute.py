"""Activation checkpointing of a model's layers: each marked layer keeps only its inputs through a
forward with gradients, and recomputes its activations in the backward (``train.activation_checkpointing``).

``recompute(layers)`` marks the layers by giving each a subclass of its own class whose
``forward`` runs through ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. Nothing else
about the model changes: parameter names, state dicts, ``isinstance`` and PEFT's adapters are
those of the unmarked model. A forward without gradients (π_old, the reference, an evaluation)
runs the layer as it is: nothing to recompute, nothing paid.

``run(layer, fn, *args)`` is the same for a forward that reads a layer's weights itself rather
than calling it (the shared-prompt forward, ``tether.decoding.prefix_forward``): ``fn`` is
checkpointed when ``layer`` is marked.

Under FSDP2 the marking comes first and ``fully_shard`` after, so FSDP's hooks sit outside the
checkpointed region: its pre-backward hook all-gathers the layer's weights again before the
recompute, which runs on the whole weights, and its post-backward hook frees them and
reduce-scatters the gradients (``tether.train.fsdp.shard`` says where the order is documented).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["recompute", "recomputes", "run"]


class _Recomputed:
    """Mixed in before a layer's own class: its forward, checkpointed."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return run(self, super().forward, *args, **kwargs)  # type: ignore[misc]


_CLASSES: dict[type, type] = {}


def _marked_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Recomputed{cls.__name__}", (_Recomputed, cls), {"__module__": cls.__module__})
    return _CLASSES[cls]


def recompute(layers: Iterable[torch.nn.Module]) -> int:
    """Mark ``layers`` (in place); returns how many. Marking twice is marking once."""
    count = 0
    for layer in layers:
        if not isinstance(layer, _Recomputed):
            layer.__class__ = _marked_class(type(layer))
        count += 1
    return count


def recomputes(module: torch.nn.Module) -> bool:
    """Whether ``module`` was marked."""
    return isinstance(module, _Recomputed)


def run(layer: torch.nn.Module, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``: checkpointed when ``layer`` is marked and gradients are on."""
    if isinstance(layer, _Recomputed) and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return fn(*args, **kwargs)
