"""What a learner whose model FSDP2 shards over ranks needs besides the training math.

The sharding itself; the whole weights for a publication, gathered on rank 0 or written by every
rank straight into the weight channel's shared block; and its state for a checkpoint, either
gathered whole in the single-process format (weights by name, AdamW's state keyed by parameter
index, so any world size reads it) or as each rank's own shards (torch.distributed.checkpoint).
Every rank calls every function here (all but ``write_own_rows`` are collectives).
"""

from __future__ import annotations

from pathlib import Path

import torch


def shard(model: torch.nn.Module, layers: list[torch.nn.Module], mp_policy=None, *,
          cpu_offload: bool = False) -> None:
    """Each of ``layers`` (the family's, ``Policy.layers``) a unit of its own, the rest
    (embeddings, final norm, a tied head) the root's. Gradients are summed over ranks, not
    averaged: each rank's loss is already its part of the mini-batch's (normalised by the whole
    mini-batch's counts). ``mp_policy``: a ``MixedPrecisionPolicy`` (``tether.train.precision``:
    bfloat16 compute, float32 shards), or None for float32 throughout. ``cpu_offload``
    (``train.cpu_offload``): shards, gradients and optimizer state in host memory
    (``CPUOffloadPolicy``; FSDP2 copies a unit's shards to the GPU for its forward and backward).

    Layers marked for recomputation (``tether.recompute``, ``train.activation_checkpointing``) are
    marked before this, so FSDP's hooks wrap the checkpointed forward: the order torchtitan's
    ``parallelize_llama`` uses (``apply_ac``, then ``apply_fsdp``), and the one torch 2.13's
    ``FSDPState._pre_forward`` is written for ("when composing with module-hook-based activation
    checkpointing, the pre-backward hook is responsible for the unshard"): the layer's weights are
    all-gathered again before its recompute, and freed after its backward."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = mp_policy or MixedPrecisionPolicy()
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for layer in layers:
        fully_shard(layer, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mp_policy=mp, offload_policy=offload)
    for unit in [*layers, model]:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-scaled one)


def _whole():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def whole_weights(model: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """``names`` → whole tensors on the CPU, on rank 0 (the other ranks get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    full = get_model_state_dict(model, options=_whole())
    return {name: full[name] for name in names} if full else {}


def write_own_rows(model: torch.nn.Module, names: list[str], views: dict[str, torch.Tensor], *,
                   rank: int) -> None:
    """Copy this rank's shard of every parameter in ``names`` into its rows of ``views`` (whole
    tensors in a shared block): FSDP2 shards dim 0 as ``torch.chunk`` does, so rank r holds rows
    [r·c, (r+1)·c) of each, c = ⌈rows / world⌉, the last rank fewer (or none). A parameter that
    is not sharded (every rank holds it whole) is written by rank 0. No collective: together the
    ranks fill every row, and nothing is gathered."""
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in names:
            p, out = params[name], views[name]
            if not isinstance(p, DTensor):
                if rank == 0:
                    out.copy_(p)
                continue
            mesh = p.device_mesh
            world, rank = mesh.size(), mesh.get_local_rank()
            local = p.to_local()
            chunk = -(-out.shape[0] // world)
            start = min(rank * chunk, out.shape[0])
            rows = max(0, min(chunk, out.shape[0] - start))
            if tuple(local.shape) != (rows, *out.shape[1:]):
                raise ValueError(f"{name}: rank {rank}'s shard is {tuple(local.shape)}, not rows "
                                 f"{start}:{start + rows} of the channel's {tuple(out.shape)}")
            out[start:start + rows].copy_(local)


def trainable_names(model: torch.nn.Module) -> list[str]:
    """The names of the optimizer's parameters, in its order (its state is keyed by index)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def gather_state(model, optimizer, names: list[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """(whole weights of ``names``, whole optimizer state keyed by index) on rank 0; ({}, {})
    on the others."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    weights = whole_weights(model, names)
    by_name = get_optimizer_state_dict(model, optimizer, options=_whole())
    if not weights:
        return {}, {}
    index = {name: i for i, name in enumerate(trainable_names(model))}
    return weights, {"state": {index[name]: value for name, value in by_name["state"].items()},
                     "param_groups": [{**group, "params": [index[n] for n in group["params"]]}
                                      for group in by_name["param_groups"]]}


def scatter_state(model, optimizer, weights: dict[str, torch.Tensor], state: dict) -> None:
    """Each rank takes its shards of whole weights and of an index-keyed optimizer state."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    names = trainable_names(model)
    options = StateDictOptions(full_state_dict=True, strict=False)  # a tied head follows its embedding
    set_model_state_dict(model, weights, options=options)
    by_name = {"state": {names[i]: value for i, value in state["state"].items()},
               "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                                for group in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=options)


def save_shards(model, optimizer, path: Path) -> None:
    """Every rank writes its own shards of the model and the optimizer into ``path``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, state = get_state_dict(model, optimizer)
    dcp.save({"model": weights, "optimizer": state}, checkpoint_id=str(path))


def load_shards(model, optimizer, path: Path, *, single_process: bool) -> None:
    """Each rank reads the shards it needs from ``path``, resharded to this world size (one
    process reads them whole)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from tether.modeling import read_shards

    weights, state = get_state_dict(model, optimizer)
    loaded = read_shards({"model": weights, "optimizer": state}, path, single_process=single_process)
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
