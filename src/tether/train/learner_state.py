"""What a ``TorchLearner`` checkpoint holds and how it is read back: the model folder (safetensors
and tokenizer, a LoRA run's adapters, or a family's own layout), optimizer, scheduler, RNG and the
learner's counters in ``learner.pt``; with ``train.ema_decay`` the EMA's weights in ``ema``.
With ranks, either gathered whole and written by rank 0 in the single-process format (any world
size resumes from it) or each rank's own shards (``checkpoint.sharded``), the model folder then
holding a marker saying where its weights are."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tether.errors import ConfigError
from tether.train import fsdp, lora

if TYPE_CHECKING:
    from tether.train.learner import TorchLearner


EMA_FOLDER = "ema"
"""With ``train.ema_decay``, the EMA's weights beside ``model``, in its layout: what held-out
evaluation measured, what ``tether eval`` and ``tether export`` read, what a resume averages on from."""


def model_folder(learner_dir: Path, *, trained: bool = False) -> Path:
    """A checkpoint's model folder (``learner_dir`` is its ``learner``): the EMA's weights where it
    holds them, what the run's held-out evaluations measured, unless ``trained``; else the
    trained weights."""
    ema = learner_dir / EMA_FOLDER
    return ema if ema.is_dir() and not trained else learner_dir / "model"


def save(learner: TorchLearner, path: Path) -> None:
    """``learner``'s checkpoint in ``path`` (every rank calls it; rank 0 writes what is whole)."""
    extra = {"scheduler": learner.scheduler.state_dict(), "torch_rng": torch.get_rng_state(),
             "committed": learner.committed, "skipped": learner.skipped}
    extra.update(_save_weights(learner, path / "model", optimizer=True))
    if learner.ema is not None:
        with learner.ema.swapped_in():  # every rank: a collective with ranks
            _save_weights(learner, path / EMA_FOLDER, optimizer=False)
    if learner.group.rank == 0:
        torch.save(extra, path / "learner.pt")


def _save_weights(learner: TorchLearner, folder: Path, *, optimizer: bool) -> dict:
    """The model's weights as the model folder ``folder`` (rank 0 writes it), with ``optimizer``
    its state too; returns what ``learner.pt`` records of them."""
    extra: dict = {}
    weights = None
    if learner.group.world == 1:
        if learner.s.lora_rank:  # written below as the ranks' gathered adapters are
            weights = lora.adapters(learner.model)
        else:
            learner.policy.save(learner.model, learner.tokenizer, folder)
        if optimizer:
            extra["optimizer"] = learner.optimizer.state_dict()
    elif learner.cfg.checkpoint.sharded and optimizer:
        fsdp.save_shards(learner.model, learner.optimizer, folder.parent / "sharded")
        extra.update(format="sharded", world_size=learner.group.world)
    elif optimizer:
        weights, extra["optimizer"] = fsdp.gather_state(learner.model, learner.optimizer, learner.names)
    else:
        weights = fsdp.whole_weights(learner.model, learner.names)
    if learner.group.rank == 0 and (learner.group.world > 1 or learner.s.lora_rank):
        _write_model_folder(learner, folder, weights)
        if learner.tokenizer is not None:
            learner.tokenizer.save_pretrained(folder)
    return extra


def _write_model_folder(learner: TorchLearner, folder: Path, weights: dict[str, torch.Tensor] | None) -> None:
    """The model folder of ``weights`` (gathered whole; None: sharded, a marker says where)."""
    from tether.modeling import SHARDED_MARKER

    folder.mkdir(parents=True, exist_ok=True)
    if learner.s.lora_rank:  # the adapters (sharded checkpoints are refused with LoRA)
        lora.save(weights, folder, learner.s, learner.model_path, learner.base_fingerprint)
    else:  # the family's layout (PolicyBase's: transformers')
        learner.policy.write_folder(learner.model, folder, weights)
    if weights is None:
        (folder / SHARDED_MARKER).write_text(
            "This model's weights are shards in ../sharded (torch.distributed.checkpoint), written "
            f"by {learner.group.world} learner ranks. Tether reads them as a model directory.\n")


def load(learner: TorchLearner, path: Path) -> None:
    """Continue from a checkpoint written at any world size, whole or sharded."""
    # onto the CPU first: the optimizer moves its state to each parameter's device, so a
    # checkpoint loads wherever this learner trains
    extra = torch.load(path / "learner.pt", weights_only=False, map_location="cpu")
    if extra.get("format") == "sharded":
        fsdp.load_shards(learner.model, learner.optimizer, path / "sharded",
                         single_process=learner.group.world == 1)
    else:
        _load_whole(learner, path, extra["optimizer"])
    learner.scheduler.load_state_dict(extra["scheduler"])
    torch.set_rng_state(extra["torch_rng"])
    learner.committed, learner.skipped = extra["committed"], extra["skipped"]
    _load_ema(learner, path)


def _load_ema(learner: TorchLearner, path: Path) -> None:
    held = (path / EMA_FOLDER).is_dir()
    if held != (learner.ema is not None):
        what = "holds an EMA of the weights" if held else "holds no EMA of the weights"
        raise ConfigError(f"checkpoint {path} {what} and train.ema_decay={learner.s.ema_decay}: resume with "
                          "the train.ema_decay it was written with")
    if held:
        learner.ema.load(_read_weights(learner, path, EMA_FOLDER), f"checkpoint {path}")


def _read_weights(learner: TorchLearner, path: Path, folder: str) -> dict[str, torch.Tensor]:
    """The published weights in the checkpoint's model folder ``folder``, checked against the model."""
    if learner.s.lora_rank:
        state = lora.load(path / folder, learner.s, learner.model_path)
    else:
        state = dict(learner.policy.read_weights(path / folder))
    buffers = {name for name, _ in learner.model.named_buffers()}  # saved by some, never trained
    state = {name: tensor for name, tensor in state.items() if name not in buffers}
    expected = set(learner.names)
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ConfigError(f"checkpoint {path} does not match the model: missing "
                          f"{missing[:3]}, unexpected {unexpected[:3]}")
    return state


def _load_whole(learner: TorchLearner, path: Path, optimizer: dict) -> None:
    state = _read_weights(learner, path, "model")
    if learner.group.world == 1:
        learner.model.load_state_dict(state, strict=False)  # a tied head follows its embedding
        learner.optimizer.load_state_dict(optimizer)
    else:
        fsdp.scatter_state(learner.model, learner.optimizer, state, optimizer)
