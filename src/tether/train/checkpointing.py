"""``train.activation_checkpointing``: the learner's model recomputes each layer's activations in
the backward instead of keeping them from the forward (``tether.recompute``).

The layers are the family's (``Policy.layers``: a language model's decoder layers, the flow
transformer's blocks). What a forward with gradients keeps falls from every layer's
intermediate tensors to each layer's input; the backward pays one more forward of each layer.
Both training forwards go through the marked layers: the model's own (each layer's ``forward``)
and the shared-prompt one (``tether.decoding.prefix_forward``, through ``recompute.run``).
Forwards without gradients — π_old, the reference, evaluations — run as before.
"""

from __future__ import annotations

import logging
from typing import Any

from tether.errors import ConfigError
from tether.recompute import recompute

log = logging.getLogger("tether.train")


def apply(model: Any, policy: Any, train: Any, *, family: str, rank: int = 0) -> None:
    """Mark ``model``'s layers when ``train.activation_checkpointing`` asks for it, before any
    sharding (``tether.train.fsdp.shard``). Refuses a model with no layers to mark."""
    if not train.activation_checkpointing:
        return
    layers = policy.layers(model)
    if not layers:
        raise ConfigError(
            f"train.activation_checkpointing=true: the model.family={family} model ({type(model).__name__}) "
            "has no layers to recompute (its policy's layers() is empty); set "
            "train.activation_checkpointing=false")
    recompute(layers)
    if rank == 0:
        log.info("train.activation_checkpointing: %d layers recompute their activations in the backward",
                 len(layers))
