"""Reading a model folder's weights into a model of a narrower dtype, part by part: a float32
folder read as a bfloat16 model holds the bfloat16 model and one slice of one tensor, never the
whole float32 model.

transformers' ``from_pretrained(dtype=bfloat16)`` maps the safetensors file and casts each tensor
from the mapping: every page it touched stays mapped (and counted in the process's resident
memory) until the load ends, so at 1.5B parameters a float32 folder's load peaks at its 6 GB of
file pages plus the 3 GB bfloat16 model. Here the model is built without initialising its
weights, and each tensor is read with ordinary reads (the file's pages stay in the page cache,
outside the process) in slices of at most ``SLICE_BYTES``, cast as it is copied into its
parameter.

Only a folder whose safetensors tensors are the model's parameters and persistent buffers by
name (what ``save_pretrained`` writes for the architectures transformers does not rename) is read
this way; ``layout`` returns None for any other, and the caller loads it through
``from_pretrained``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

SLICE_BYTES = 64 << 20
"""The most bytes of a file read at once (a 151,936 × 1536 float32 embedding is 933 MB)."""

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
"""safetensors' names of the floating dtypes read here."""


def header(file: Path) -> tuple[int, dict]:
    """(where its data starts, its tensors' entries) of a safetensors file."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        entries = json.loads(f.read(size))
    entries.pop("__metadata__", None)
    return 8 + size, entries


def files(folder: Path) -> list[Path]:
    """The folder's weight files: ``model.safetensors``, or the shards its index names."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [folder / "model.safetensors"] if (folder / "model.safetensors").is_file() else []


def layout(folder: Path, names: set[str]) -> dict[str, tuple[Path, int, dict]] | None:
    """Each of ``names`` → (file, data start, entry), when the folder holds exactly those tensors
    in floating dtypes read here; else None."""
    found: dict[str, tuple[Path, int, dict]] = {}
    for file in files(folder):
        start, entries = header(file)
        found.update({name: (file, start, entry) for name, entry in entries.items()})
    if set(found) != names or any(entry["dtype"] not in DTYPES for _, _, entry in found.values()):
        return None
    return found


def targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a folder must hold for ``model``: its parameters (a tied one under its first name,
    as ``save_pretrained`` writes it) and persistent buffers."""
    out = dict(model.named_parameters())
    non_persistent = {f"{prefix}.{name}" if prefix else name for prefix, module in model.named_modules()
                      for name in module._non_persistent_buffers_set}
    out.update({name: b for name, b in model.named_buffers() if name not in non_persistent})
    return out


def read_into(tensor: torch.Tensor, file: Path, start: int, entry: dict) -> None:
    """Fill ``tensor`` from its entry in ``file``, a slice of rows at a time, cast on the copy."""
    source = DTYPES[entry["dtype"]]
    begin, end = entry["data_offsets"]
    flat = tensor.detach().view(-1)  # (numel,)
    item = torch.empty((), dtype=source).element_size()
    if list(tensor.shape) != entry["shape"] or end - begin != flat.numel() * item:
        raise ValueError(f"{file}: a tensor of shape {entry['shape']} for one of {list(tensor.shape)}")
    step = max(1, SLICE_BYTES // item)
    buffer = torch.empty(min(step, flat.numel()), dtype=source)
    with open(file, "rb", buffering=0) as f:
        f.seek(start + begin)
        for at in range(0, flat.numel(), step):
            part = buffer[: min(step, flat.numel() - at)]
            f.readinto(part.view(torch.uint8).numpy())
            flat[at: at + part.numel()].copy_(part)


def build(config, dtype: torch.dtype) -> torch.nn.Module:
    """The causal LM of ``config`` in ``dtype``, its weights allocated and not initialised."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # left undone without initialisation: a tied head is the embedding again
    return model


def load(folder: Path, config, dtype: torch.dtype) -> torch.nn.Module | None:
    """The model of ``folder`` in ``dtype``, read part by part; None when ``layout`` cannot read it
    (nothing is allocated then)."""
    with torch.device("meta"):
        skeleton = build(config, dtype)
    where = layout(folder, set(targets(skeleton)))
    if where is None:
        return None
    model = build(config, dtype)
    with torch.no_grad():
        for name, tensor in targets(model).items():
            read_into(tensor, *where[name])
    if (folder / "generation_config.json").is_file():  # the end ids from_pretrained would read
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(folder)
    model.config.name_or_path = str(folder)  # as from_pretrained records it
    model.eval()
    return model
