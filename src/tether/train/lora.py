"""LoRA adapters on the learner's model (``train.lora_rank`` > 0), through PEFT: the adapters
(``tether.adapters``: ``attach``, ``adapters``, ``disabled``) are what trains and is published,
and the KL reference is the same model with them switched off, not a second copy.

A checkpoint's model folder holds the adapters (``adapter.safetensors``, the learner's names)
and ``adapter.json``: the settings and the base model's path and fingerprint (a hash of its
files' contents), so a resume, an evaluation or an export against another base, or against a base
whose weights changed, is refused, naming both. ``load_merged`` and ``write_peft`` are what
``tether eval`` and ``tether export`` make of such a folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tether.adapters import adapters, attach, disabled  # noqa: F401 (the learner's names for them)
from tether.errors import ConfigError

ADAPTER_FILE = "adapter.safetensors"
RECORD_FILE = "adapter.json"


def record(train: Any, base: str | Path, fingerprint: str | None = None) -> dict[str, Any]:
    """What ``adapter.json`` says: the settings, and the base by absolute path and the fingerprint
    of its contents (``fingerprint``, else computed here)."""
    from tether.modeling import fingerprint as of_folder

    return {"rank": train.lora_rank, "alpha": train.lora_alpha, "targets": list(train.lora_targets),
            "dropout": train.lora_dropout, "base": str(Path(base).resolve()),
            "base_fingerprint": fingerprint or of_folder(base)}


def save(tensors: dict[str, torch.Tensor], folder: Path, train: Any, base: str | Path,
         fingerprint: str | None = None) -> None:
    """The adapters (``adapters(model)``, or gathered from learner ranks) and what they adapt, in
    a checkpoint's model folder; ``fingerprint``: the base's, taken when it was loaded."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(folder / ADAPTER_FILE),
              metadata={"format": "pt"})
    (folder / RECORD_FILE).write_text(json.dumps(record(train, base, fingerprint), indent=2) + "\n")


def load(folder: Path, train: Any, base: str | Path) -> dict[str, torch.Tensor]:
    """The adapters a checkpoint's model folder holds; refuses adapters of another base model (by
    path, or by contents: ``tether.modeling.fingerprint_as``), or of other settings than the recipe's."""
    from safetensors.torch import load_file

    from tether.modeling import fingerprint_as

    if not (folder / RECORD_FILE).is_file():
        raise ConfigError(f"{folder} holds no LoRA adapters ({RECORD_FILE}): the checkpoint trained every "
                          "weight; resume it with train.lora_rank=0")
    saved = json.loads((folder / RECORD_FILE).read_text())
    path, now = str(Path(base).resolve()), fingerprint_as(saved["base_fingerprint"], base)
    if (saved["base"], saved["base_fingerprint"]) != (path, now):
        fix = ("point model.path at the base they were trained on" if saved["base"] != path else
               "that folder's files or their contents changed since; restore the base they were trained on")
        raise ConfigError(f"{folder} holds adapters trained on the base model {saved['base']} (fingerprint "
                          f"{saved['base_fingerprint']}); this run's base is {path} (fingerprint {now}); "
                          f"{fix}")
    recipe = {"rank": train.lora_rank, "alpha": train.lora_alpha, "targets": list(train.lora_targets)}
    for key, value in recipe.items():
        if saved[key] != value:
            raise ConfigError(f"{folder} holds adapters of LoRA {key} {saved[key]}; the recipe says "
                              f"{value} (train.lora_{key}); make them agree")
    return load_file(str(folder / ADAPTER_FILE))


def is_adapter_dir(folder: str | Path) -> bool:
    """A checkpoint model folder of LoRA adapters (``adapter.json``)."""
    return (Path(folder) / RECORD_FILE).is_file()


def base_of(folder: str | Path) -> Path:
    """The base model an adapter folder's adapters were trained on."""
    return Path(json.loads((Path(folder) / RECORD_FILE).read_text())["base"])


def _checked_record(folder: Path) -> dict[str, Any]:
    from tether.modeling import check_base

    saved = json.loads((folder / RECORD_FILE).read_text())
    check_base(folder, Path(saved["base"]), saved["base_fingerprint"], what="adapters of the base model")
    return saved


def load_merged(folder: str | Path, policy: Any):
    """(model, tokenizer) of an adapter folder: its base with the adapters merged into the
    weights, W₀ + (α/r)·B·A (what the engines sampled from), a plain model of the family."""
    from safetensors.torch import load_file

    from tether.adapters import MergedAdapter

    folder = Path(folder)
    saved = _checked_record(folder)
    model, tokenizer = policy.load(saved["base"])
    MergedAdapter(model, saved["alpha"] / saved["rank"]).apply(load_file(str(folder / ADAPTER_FILE)))
    return model, tokenizer


def write_peft(folder: str | Path, out: str | Path) -> Path:
    """The adapters of ``folder`` as a PEFT adapter directory (``tether.adapters.write_peft_dir``)."""
    from safetensors.torch import load_file

    from tether.adapters import write_peft_dir

    folder = Path(folder)
    saved = _checked_record(folder)
    tensors = load_file(str(folder / ADAPTER_FILE))
    return write_peft_dir(tensors, out, rank=saved["rank"], alpha=saved["alpha"], base=saved["base"])
