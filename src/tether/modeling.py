"""Loading a Hugging Face causal LM from a local directory, and naming its parameters.

Shared by the rollout engine, the learner and warm start, so none of them depends on another.
"""

from __future__ import annotations

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


def load_causal_lm(path: str | Path, *, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a local directory, offline; a clear error when it is not one."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(Path(path), dtype=dtype, local_files_only=True)
    return model, tokenizer


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


def unique_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name → tensor for every parameter, tied ones once (the names ``named_parameters`` gives)."""
    return {name: p.detach() for name, p in model.named_parameters()}
