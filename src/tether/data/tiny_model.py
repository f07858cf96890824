"""Tiny models built locally: a character-level tokenizer and a small Qwen3 or Llama model.

Both are written with ``save_pretrained`` and load offline through ``AutoTokenizer`` and
``AutoModelForCausalLM`` — the same path a user's real checkpoint takes — so nothing downloads
and every test, benchmark and demo runs on a real Hugging Face model.
"""

from __future__ import annotations

import json
import string
from dataclasses import asdict, dataclass
from pathlib import Path

from tether.errors import ConfigError

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
DEFAULT_ALPHABET = string.digits + string.ascii_letters + " +-*/=<>:()[].,?!'\"_\n"


@dataclass(frozen=True)
class ModelSize:
    """Shape of a tiny model preset."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=192),
    "small": ModelSize(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768),
    "base": ModelSize(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536),
}
"""Presets: ``tiny`` ≈ 0.1M parameters (tests), ``small`` ≈ 3M (demo, engine benchmark),
``base`` ≈ 25M (weight-channel benchmark)."""

ARCHES = ("qwen3", "llama")


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET, *, model_max_length: int = 256):
    """A character-level fast tokenizer: one token per character, left padding, no chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))
    clash = [c for c in chars if c in SPECIAL_TOKENS]
    if clash:
        raise ConfigError(f"alphabet contains special tokens {clash}")
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>", padding_side="left", model_max_length=model_max_length,
    )


def build_model(vocab_size: int, *, arch: str = "qwen3", size: str = "small", seed: int = 0,
                max_positions: int = 256, pad_token_id: int = 0, bos_token_id: int = 1,
                eos_token_id: int = 2):
    """A randomly initialised causal LM of a preset size (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    if arch not in ARCHES:
        raise ConfigError(f"unknown architecture {arch!r}; choose one of: {', '.join(ARCHES)}")
    if size not in SIZES:
        raise ConfigError(f"unknown model size {size!r}; choose one of: {', '.join(SIZES)}")
    s = SIZES[size]
    common = dict(
        vocab_size=vocab_size, hidden_size=s.hidden_size, num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
        intermediate_size=s.intermediate_size, max_position_embeddings=max_positions,
        head_dim=s.hidden_size // s.num_heads, tie_word_embeddings=True,
        pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
    )
    config = Qwen3Config(**common) if arch == "qwen3" else LlamaConfig(**common)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@dataclass(frozen=True)
class TinyModelInfo:
    """What ``init_model`` wrote, saved next to the weights as ``tether_model.json``."""

    arch: str
    size: str
    seed: int
    parameters: int
    vocab_size: int


def init_model(out: str | Path, *, arch: str = "qwen3", size: str = "small", seed: int = 0,
               alphabet: str = DEFAULT_ALPHABET, overwrite: bool = False) -> TinyModelInfo:
    """Build a tokenizer and model and save both to ``out`` (refuses to overwrite by default)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"{out} already exists and is not empty; choose another path or pass --overwrite")
    tokenizer = build_char_tokenizer(alphabet)
    model = build_model(len(tokenizer), arch=arch, size=size, seed=seed,
                        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    info = TinyModelInfo(arch=arch, size=size, seed=seed, vocab_size=len(tokenizer),
                         parameters=sum(p.numel() for p in model.parameters()))
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    (out / "tether_model.json").write_text(json.dumps(asdict(info), indent=2) + "\n")
    return info
