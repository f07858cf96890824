"""Loading a Hugging Face causal LM from a local directory, and naming its parameters.

Shared by the rollout engine, the learner and warm start, so none of them depends on another.
"""

from __future__ import annotations

import hashlib
import json
import logging
import warnings
from pathlib import Path

import torch

from tether import narrow_load
from tether.errors import ConfigError

log = logging.getLogger("tether.modeling")


def is_model_dir(path: str | Path) -> bool:
    """A model directory: ``config.json`` (a language model, a flow model or a checkpoint), or a
    diffusers pipeline's ``model_index.json``."""
    path = Path(path)
    return (path / "config.json").is_file() or (path / "model_index.json").is_file()


def model_config(path: str | Path) -> dict:
    """A model directory's ``config.json`` (a diffusers pipeline's: its transformer's, marked as
    the flow family's); a clear error when there is none, or it is unreadable."""
    path = Path(path)
    if not (path / "config.json").is_file() and (path / "model_index.json").is_file():
        return {**model_config(path / "transformer"), "tether_family": "flow"}
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path} is not a model directory (no config.json)")
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path / 'config.json'} cannot be read as JSON: {exc}") from exc


CONTENT = "sha256:"
"""How a fingerprint of a folder's contents begins; one without it (recorded before fingerprints
hashed a base's weights) covers its files' sizes alone."""


def _files(folder: Path, skip: tuple[str, ...]) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).parts[0] not in skip)


def fingerprint(folder: str | Path, *, skip: tuple[str, ...] = ()) -> str:
    """What identifies a model directory: every file's path and the SHA-256 of its contents (but
    those under the top-level folders ``skip``). Each large file is hashed once, then read from
    ``tether.filehash``'s cache while its size, times and inode stay the same."""
    from tether.filehash import hashes

    folder = Path(folder)
    files = _files(folder, skip)
    digest = hashlib.sha256()
    for path, sha in hashes(files).items():
        digest.update(f"{path.relative_to(folder)}:{sha}\n".encode())
    return CONTENT + digest.hexdigest()[:16]


def sizes_fingerprint(folder: str | Path, *, skip: tuple[str, ...] = ()) -> str:
    """The fingerprint checkpoints recorded before ``fingerprint`` hashed the weights: every
    file's path and size, and the JSON files' contents."""
    folder = Path(folder)
    digest = hashlib.sha256()
    for path in _files(folder, skip):
        digest.update(f"{path.relative_to(folder)}:{path.stat().st_size}\n".encode())
        if path.suffix == ".json":
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def fingerprint_as(saved: str, folder: str | Path, *, skip: tuple[str, ...] = ()) -> str:
    """``folder``'s fingerprint of the kind ``saved`` is: of its contents, or, for a record written
    before contents were hashed, of its files' sizes (then said in a warning: weights replaced by
    others of the same size go unnoticed until a new checkpoint records their contents)."""
    if saved.startswith(CONTENT):
        return fingerprint(folder, skip=skip)
    log.warning(
        "the base model %s is checked against a fingerprint of its files' sizes alone (%s, recorded "
        "before checkpoints recorded their base's contents); the next checkpoint records its contents",
        folder, saved)
    return sizes_fingerprint(folder, skip=skip)


def check_base(holder: Path, base: Path, saved: str, *, what: str, skip: tuple[str, ...] = ()) -> None:
    """Refuse ``holder`` (a checkpoint's folder holding ``what`` trained on the model at ``base``,
    saved with fingerprint ``saved``) when that base is gone or has changed since."""
    if not base.is_dir():
        raise ConfigError(f"{holder} holds {what} {base}, which is gone; put it back at that path (it is not "
                          "saved with the checkpoint)")
    now = fingerprint_as(saved, base, skip=skip)
    if now != saved:
        raise ConfigError(f"{holder} holds {what} {base} with fingerprint {saved}; that folder now has "
                          f"{now} (its files, or their contents, differ); restore the one it was trained on")


def context_length(config: dict) -> int | None:
    """The positions a model attends over, from its config (None when it does not say)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if isinstance(config.get(key), int):
            return config[key]
    return None


def _check_language_model(path: Path) -> None:
    """Refuse a directory that holds another family's model (its config.json names the family)."""
    family = model_config(path).get("tether_family")
    if family:
        raise ConfigError(f"{path} holds a model.family={family} model (its config.json says tether_family: "
                          f"{family}), not a language model; set model.family={family}, or point model.path "
                          "(or --model) at a Hugging Face causal LM directory")


def load_tokenizer(path: str | Path):
    """The tokenizer of a local model directory, offline, with a pad token (EOS if it has none);
    a clear error when the directory is not a language model's."""
    from transformers import AutoTokenizer

    path = Path(path)
    _check_language_model(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"cannot load a tokenizer from {path} ({type(exc).__name__}: {exc}); a language "
                          "model directory holds its tokenizer's files beside config.json") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def dropout_settings(config: dict) -> dict[str, float]:
    """The dropout probabilities a model's config turns on (``*dropout*``, ``*pdrop``), by key."""
    return {k: float(v) for k, v in config.items()
            if ("dropout" in k or k.endswith("pdrop")) and isinstance(v, int | float)
            and not isinstance(v, bool) and v > 0}


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout module's probability to 0; returns how many had one above 0. A policy's
    forward must be the distribution the engine sampled from: with dropout on, every training
    forward is another random sub-network, and ratios, clipping and attribution measure that
    noise (verl, OpenRLHF and TRL turn it off too)."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            module.p = 0.0
            changed += 1
    return changed


SHARDED_MARKER = "TETHER_SHARDED_CHECKPOINT.txt"
"""In a sharded checkpoint's ``learner/model`` folder: its weights are the shards beside it."""


def load_causal_lm(path: str | Path, *, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a local directory, offline; a clear error when it is not one. The
    model folder of a sharded checkpoint (``checkpoint.sharded``) reads its weights from the
    shards beside it, whole, in this process. In a dtype narrower than float32 the weights are
    read part by part where the folder allows it (``tether.narrow_load``): the load's peak is the
    model in ``dtype``, not the folder's float32 weights beside it."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = Path(path)
    tokenizer = load_tokenizer(path)
    if (path / SHARDED_MARKER).is_file():
        return _from_shards(path, dtype), tokenizer
    config = _without_dropout(path)
    model = narrow_load.load(path, config, dtype) if dtype != torch.float32 else None
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, local_files_only=True)
    disable_dropout(model)
    return model, tokenizer


def _without_dropout(path: Path):
    """The model's config with every dropout probability 0 (attention implementations read theirs
    from the config, not from a module)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    for key in dropout_settings(config.to_dict()):
        if hasattr(config, key):
            setattr(config, key, 0.0)
    return config


def _from_shards(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_without_dropout(path), dtype=dtype)
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


def cast_parameters(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """``model`` with its parameters in ``dtype`` (``float32``, ``bfloat16``), tied ones still
    tied; its buffers (the rotary ``inv_freq``) stay float32, as a learner's are under autocast."""
    target = getattr(torch, dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != target:
                p.data = p.data.to(target)
    return model


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


def check_dtype_on_device(dtype: str, device: torch.device | str, key: str = "train.dtype") -> None:
    """Refuse bfloat16 on a CUDA device (or build) without it, naming ``key``, the setting that
    asked for it. Every CPU build of torch computes in bfloat16 (natively where the CPU has
    AVX512-BF16 or AMX, else emulated)."""
    device = torch.device(device)
    if dtype == "float32" or device.type != "cuda" or not torch.cuda.is_available():
        return  # no CUDA here: the device key's own check says so
    if not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise ConfigError(f"{key}=bfloat16, but {name} (torch {torch.__version__}, CUDA "
                          f"{torch.version.cuda}) has no bfloat16 support; set {key}=float32")
