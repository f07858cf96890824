"""Loading a Hugging Face causal LM from a local directory, and naming its parameters.

Shared by the rollout engine, the learner and warm start, so none of them depends on another.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from tether.errors import ConfigError


def load_tokenizer(path: str | Path):
    """The tokenizer of a local model directory, offline, with a pad token (EOS if it has none);
    a clear error when the directory is not a model."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path} is not a model directory (no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


SHARDED_MARKER = "TETHER_SHARDED_CHECKPOINT.txt"
"""In a sharded checkpoint's ``learner/model`` folder: its weights are the shards beside it."""


def load_causal_lm(path: str | Path, *, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a local directory, offline; a clear error when it is not one. The
    model folder of a sharded checkpoint (``checkpoint.sharded``) reads its weights from the
    shards beside it, whole, in this process."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = Path(path)
    tokenizer = load_tokenizer(path)
    if (path / SHARDED_MARKER).is_file():
        return _from_shards(path, dtype), tokenizer
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model, tokenizer


def _from_shards(path: Path, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = read_shards({"model": model.state_dict()}, path.parent / "sharded", single_process=True)
    model.load_state_dict(state["model"])
    return model


def read_shards(state: dict, path: Path, *, single_process: bool) -> dict:
    """Fill ``state`` (its tensors say what to read and how it is sharded here) from the
    torch.distributed.checkpoint shards in ``path``; ``single_process``: this process alone reads
    them, whole."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # one process reading shards is what is meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=single_process)
    return state


def torch_device(name: str, *, who: str, fix: str) -> torch.device:
    """``name`` ('cpu', 'cuda', 'cuda:N') as a device this process can use. Asking for CUDA that
    is not there is a ConfigError: "{who}, but this process sees no CUDA device (…); {fix}"."""
    device = torch.device(name)
    if device.type == "cuda":
        import os

        if not torch.cuda.is_available():
            raise ConfigError(
                f"{who}, but this process sees no CUDA device (torch {torch.__version__}, "
                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); {fix}")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"{who}, but this process sees {torch.cuda.device_count()} CUDA "
                              f"device(s); choose cuda:0..cuda:{torch.cuda.device_count() - 1}")
    elif device.type != "cpu":
        raise ConfigError(f"{who}: only 'cpu', 'cuda' and 'cuda:N' are supported")
    return device


def learner_device(name: str) -> torch.device:
    """``train.device`` as a torch device, checked."""
    return torch_device(name, who=f"train.device={name}",
                        fix="install a CUDA build of torch on a machine with a GPU, or set train.device=cpu")


def copy_weights(model: torch.nn.Module, weights) -> None:
    """Copy ``weights`` (name → tensor, e.g. a learner's exported ones) into ``model``'s parameters."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)


def unique_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name → tensor for every parameter, tied ones once (the names ``named_parameters`` gives)."""
    return {name: p.detach() for name, p in model.named_parameters()}


def load_into(model: torch.nn.Module, weights) -> None:
    """Copy ``weights`` (name → tensor, from any device) into ``model``'s parameters, skipping
    any the model already uses (bound views); every parameter must be there."""
    params = dict(model.named_parameters())
    missing = [name for name in params if name not in weights]
    if missing:
        raise ConfigError(f"published weights lack {len(missing)} parameters, e.g. {missing[:3]}")
    with torch.no_grad():
        for name, p in params.items():
            src = weights[name]
            if src.data_ptr() != p.data_ptr():
                p.copy_(src)


def bind_into(model: torch.nn.Module, weights) -> None:
    """Make ``weights`` (e.g. shared-memory views) ``model``'s parameters, without copying."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            src = weights[name]
            if src.shape != p.shape or src.dtype != p.dtype:
                raise ConfigError(f"cannot bind {name}: {tuple(src.shape)} {src.dtype} vs "
                                  f"{tuple(p.shape)} {p.dtype}")
            p.data = src
