"""The learner's precision (``train.dtype``): float32 master weights and optimizer state, and the
forwards in bfloat16 where the recipe asks for it.

- One process: every policy forward (the training one, π_old, the reference model's log-probs,
  the held-out evaluation) runs under ``torch.autocast(device, bfloat16)``: matrix multiplies
  and attention in bfloat16 from the float32 parameters, which stay the optimizer's; a weight's
  gradient flows back through the cast into its float32 ``.grad``.
- FSDP2 ranks: ``fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype=bfloat16,
  reduce_dtype=train.reduce_dtype))``: each rank all-gathers its units' parameters in bfloat16
  for compute, its shards (and AdamW's state) stay float32, and gradients are reduce-scattered in
  ``train.reduce_dtype``. The same autocast runs around it, so both layouts compute the same ops in
  the same dtype (rounding differs: a rank's residual stream is bfloat16, one process's float32).

The log-softmax, the gather of the sampled tokens' log-probs and everything after them (the loss,
the corrections, the KL) stay float32: the families upcast the logits before ``log_softmax``
(``tether.families.text.batch.token_logprobs``, ``SharedPrefixForward``), and ``Mixed.forward``
hands back float32 tensors, outside the autocast region.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tether.modeling import check_dtype_on_device

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Precision:
    """How a learner on ``device`` computes: ``compute()`` wraps its forwards."""

    def __init__(self, dtype: str, device: torch.device, reduce_dtype: str = "float32") -> None:
        check_dtype_on_device(dtype, device)
        self.dtype, self.device, self.reduce_dtype = dtype, device, reduce_dtype
        self.mixed = dtype != "float32"

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """The region a forward runs in: autocast to bfloat16, or nothing in float32."""
        if not self.mixed:
            yield
            return
        with torch.autocast(self.device.type, dtype=DTYPES[self.dtype]):
            yield

    def load_dtype(self, frozen: bool) -> torch.dtype:
        """The dtype a model is read in: the compute dtype for one that stays frozen but for
        adapters (a LoRA run's base: its float32 copy would only be cast down for every matrix
        multiply, and a bfloat16 base is half the bytes; PEFT users load a base in bfloat16 for
        the same reason), else float32, the optimizer's master weights. Under autocast the matrix
        multiplies are the same; the embedding's output, and so the residual stream, become
        bfloat16."""
        return DTYPES[self.dtype] if frozen else torch.float32

    def load(self, policy: Any, path: Any, *, frozen: bool) -> tuple[Any, Any]:
        """``policy.load`` in ``load_dtype(frozen)``; a plug-in family's ``load`` that takes no
        dtype reads float32 (``settle`` casts its frozen part afterwards)."""
        dtype = self.load_dtype(frozen)
        if dtype == torch.float32 or "dtype" not in inspect.signature(policy.load).parameters:
            return policy.load(path)
        return policy.load(path, dtype=dtype)

    def settle(self, model: torch.nn.Module) -> int:
        """Every parameter the optimizer updates in float32 (PEFT makes a layer's adapters its base
        weight's dtype), every frozen one in ``load_dtype(frozen=True)`` (what a family's ``load``
        that takes no dtype read in float32); returns the parameters cast."""
        frozen = self.load_dtype(frozen=True)
        cast = 0
        with torch.no_grad():
            for p in model.parameters():  # tied weights are one Parameter: cast once, still tied
                want = torch.float32 if p.requires_grad else frozen
                if p.dtype != want and p.dtype in (torch.float32, frozen):
                    p.data = p.data.to(want)
                    cast += p.numel()
        return cast

    def fsdp_policy(self) -> Any:
        """The ``MixedPrecisionPolicy`` of a sharded model's units, or None in float32."""
        if not self.mixed:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=DTYPES[self.dtype], reduce_dtype=DTYPES[self.reduce_dtype])

    def policy(self, policy: Any) -> Any:
        """A family's policy whose forwards run in this precision (itself in float32)."""
        return Mixed(policy, self) if self.mixed else policy

    def evaluating(self, evaluate: Callable[[int], Any]) -> Callable[[int], Any]:
        """A held-out evaluator that runs in this precision (itself in float32)."""
        if not self.mixed:
            return evaluate

        def run(step: int) -> Any:
            with self.compute():
                return evaluate(step)

        return run


def of(cfg: Any, device: torch.device) -> Precision:
    """The recipe's learner precision on ``device``."""
    return Precision(cfg.train.dtype, device, cfg.train.reduce_dtype)


def _float32(value: Any) -> Any:
    return value.float() if isinstance(value, torch.Tensor) and value.is_floating_point() else value


class Mixed:
    """A family's ``Policy`` whose ``forward`` runs under autocast and returns float32 tensors;
    every other member is the policy's own."""

    def __init__(self, policy: Any, precision: Precision) -> None:
        self._policy, self._precision = policy, precision

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)

    def forward(self, model, batch: Any, **kwargs: Any) -> tuple:
        with self._precision.compute():
            out = self._policy.forward(model, batch, **kwargs)
        return tuple(_float32(x) for x in out)
