"""An exponential moving average of the trained weights (``train.ema_decay``), as Flow-GRPO's
reference keeps one (flow_grpo/ema.py, scripts/train_sd3.py at ac4c86e: decay 0.9, every 8th
optimizer step).

After optimizer update n (0-based, counted over the whole run) with (n + 1) a multiple of
``train.ema_every``: ema ← ema + (1 − d)·(θ − ema), d = min((1 + n)/(10 + n), ``train.ema_decay``),
the reference's warm-up, so the first averages follow the weights closely. The average is of the
parameters the optimizer trains (a LoRA run's adapters), in their own dtype (float32 master
weights), and on learner ranks of each rank's shards (DTensors, elementwise: no collective). It
starts as the weights the run starts from.

Held-out evaluation runs on the average (``swapped_in``); rollouts, π_old and every update use the
trained weights. A checkpoint holds it as a second model folder (``learner_state.EMA_FOLDER``),
whole, so any world size resumes it and ``tether eval`` / ``tether export`` read it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch

from tether.errors import ConfigError


def decay_at(n: int, decay: float) -> float:
    """The decay used after update ``n``: the reference's warm-up min((1 + n)/(10 + n), decay)."""
    return min((1 + n) / (10 + n), decay)


class Ema:
    """The average of ``model``'s trained parameters."""

    def __init__(self, model: torch.nn.Module, decay: float, every: int) -> None:
        self.decay, self.every = decay, every
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        with torch.no_grad():
            self.values = {name: p.detach().clone() for name, p in self.params.items()}

    @torch.no_grad()
    def step(self, n: int) -> bool:
        """After optimizer update ``n``: fold the weights in when (n + 1) is a multiple of
        ``every``; returns whether it did."""
        if (n + 1) % self.every:
            return False
        weight = 1.0 - decay_at(n, self.decay)
        for name, p in self.params.items():
            self.values[name].lerp_(p.detach(), weight)
        return True

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model holds the average inside the block and its trained weights again after (on
        ranks: every rank enters it)."""
        with torch.no_grad():
            kept = {name: p.detach().clone() for name, p in self.params.items()}
            for name, p in self.params.items():
                p.copy_(self.values[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(kept[name])

    def load(self, state: Mapping[str, torch.Tensor], where: str) -> None:
        """Take a checkpoint's whole average (``state``), each rank its own shards."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        missing, unexpected = sorted(set(self.values) - set(state)), sorted(set(state) - set(self.values))
        if missing or unexpected:
            raise ConfigError(f"{where}: its EMA does not match the trained parameters: missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]}")
        with torch.no_grad():
            for name, v in self.values.items():
                whole = state[name].to(dtype=v.dtype)
                if isinstance(v, DTensor):
                    whole = distribute_tensor(whole.to(v.to_local().device), v.device_mesh, v.placements)
                else:
                    whole = whole.to(v.device)
                v.copy_(whole)
