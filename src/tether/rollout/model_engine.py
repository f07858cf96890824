"""What every engine around a torch module shares: its own version, and weights that change only
when told — bound in place (shared-memory or object-store views, on the CPU) or copied in.

``TorchEngine`` (token sequences) and the flow family's ``FlowEngine`` (image trajectories)
subclass it and add how they sample; ``_weights_changed`` lets them drop what they derived from
the old weights (the native decoder's packed matrices).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tether.modeling import bind_into, load_into
from tether.rollout.watch import Watched


class ModelEngine(Watched):
    """A ``tether.vocabulary.Engine`` over ``model``, stamping ``version`` on what it samples."""

    def __init__(self, model: torch.nn.Module, *, version: int = 0) -> None:
        self.model = model.eval()
        self._version = version
        self.device = next(self.model.parameters()).device
        self.adapter = None
        """With LoRA (``use_adapter``): what merges published adapters into the weights."""

    @property
    def version(self) -> int:
        return self._version

    def _weights_changed(self) -> None:
        """The model's parameters are other tensors now."""

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``weights`` into the model (from any device to the engine's), unless the model
        already uses them (bound views)."""
        if self.adapter is not None:
            self.adapter.apply(weights)
        else:
            load_into(self.model, weights)
        self._weights_changed()
        self._version = version

    def use_adapter(self, scale: float, terms=None) -> None:
        """Published weights are LoRA adapters from now on (``tether.adapters``): merged
        into this engine's base weights at ``scale`` = α/r, or with ``terms`` (the ``train``
        section) applied as low-rank terms in the model's own forward."""
        from tether.adapters import AdapterTerms, MergedAdapter

        self.adapter = MergedAdapter(self.model, scale) if terms is None else AdapterTerms(self.model, terms)

    def bind(self, weights: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Use ``weights`` (e.g. shared-memory views) as the model's parameters, without copying;
        with ``version``, they are that version from now on (a new object per version). An engine
        on a GPU cannot sample from host memory, and one in another precision must cast them, so
        there they are copied in instead."""
        if self.device.type != "cpu" or self.adapter is not None or self._casts(weights):
            self.load_weights(weights, self._version if version is None else version)
            return
        bind_into(self.model, weights)
        self._weights_changed()
        if version is not None:
            self._version = version

    def _casts(self, weights: Mapping[str, torch.Tensor]) -> bool:
        """The engine holds its weights in another precision than they are published in (a
        bfloat16 engine of a float32 learner): they are cast on the way in, never bound."""
        return any(p.dtype != weights[name].dtype for name, p in self.model.named_parameters()
                   if name in weights)

    def close(self) -> None:
        """Nothing outside this process to release."""
