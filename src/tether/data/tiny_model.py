"""Models built locally: a character-level tokenizer and a Qwen3, Llama or Qwen2 model with random
weights, from tiny (tests) to the shapes of Qwen2-0.5B and Qwen2-1.5B (the scale benchmark).

A chat model (``chat=True``) adds ChatML's ``<|im_start|>`` and ``<|im_end|>`` as special tokens,
Hermes's ``<tool_call>`` and ``</tool_call>`` as tokens of their own (as Qwen2.5's vocabulary has
them), braces for JSON, and ``CHATML_TEMPLATE``: a ChatML template whose system turn lists the tools
one line each (``calculator(expression)``), short enough for a character model's context.

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
    vocab_size: int | None = None
    """Pad the tokenizer with filler tokens to this many (a real model's embedding and output
    head), or None for the tokenizer's own ~100 characters."""
    max_positions: int = 256
    rope_theta: float = 10000.0


CHAT_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>")
TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>")
CHAT_MAX_POSITIONS = 512
"""A chat model's context: its episodes hold the template's turns and the tools' JSON calls."""

CHATML_TEMPLATE = (
    "{% if messages and messages[0].role == 'system' or tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}"
    "{% if tools %}{{ '\\n' }}{% endif %}{% endif %}"
    "{% for tool in tools or [] %}"
    "{{ tool.function.name }}({{ tool.function.parameters.properties | join(',') }})"
    "{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if not (loop.first and message.role == 'system') %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML (``<|im_start|>role\ncontent<|im_end|>\n``) with a compact tools block: the system turn
holds the system prompt, then one line per tool, its name and its arguments' names; a tool's result
is a ``tool`` turn. Append-only: no turn is rendered differently once another follows."""

QWEN2_VOCAB = 151936
"""Qwen2's vocabulary size (Qwen2 technical report, arXiv:2407.10671, and its released configs)."""

SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=192),
    "small": ModelSize(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768),
    "base": ModelSize(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536),
    # the shapes of the released Qwen2-0.5B and Qwen2-1.5B configs (layers, widths, heads, vocabulary,
    # rope θ), with random weights: what benchmarks/scale.py trains
    "0.5b": ModelSize(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                      vocab_size=QWEN2_VOCAB, max_positions=4096, rope_theta=1e6),
    "1.5b": ModelSize(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960,
                      vocab_size=QWEN2_VOCAB, max_positions=4096, rope_theta=1e6),
}
"""Presets: ``tiny`` ≈ 0.1M parameters (tests), ``small`` ≈ 3M (demo, engine benchmark),
``base`` ≈ 25M (weight-channel benchmark); ``0.5b`` ≈ 494M and ``1.5b`` ≈ 1.54B with Qwen2's
vocabulary of 151,936 (the character tokenizer padded with filler tokens): the scale benchmark."""

ARCHES = ("qwen3", "llama", "qwen2")


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET, *, model_max_length: int = 256,
                         vocab_size: int | None = None):
    """A character-level fast tokenizer: one token per character, left padding, no chat template;
    with ``vocab_size``, filler tokens ``<x_N>`` after the characters up to that many."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))
    clash = [c for c in chars if c in SPECIAL_TOKENS]
    if clash:
        raise ConfigError(f"alphabet contains special tokens {clash}")
    tokens = [*SPECIAL_TOKENS, *chars]
    if vocab_size is not None:
        if vocab_size < len(tokens):
            raise ConfigError(f"a vocabulary of {vocab_size} cannot hold the {len(tokens)} characters")
        tokens += [f"<x_{i}>" for i in range(vocab_size - len(tokens))]
    vocab = {tok: i for i, tok in enumerate(tokens)}
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
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    if arch not in ARCHES:
        raise ConfigError(f"unknown architecture {arch!r}; choose one of: {', '.join(ARCHES)}")
    if size not in SIZES:
        raise ConfigError(f"unknown model size {size!r}; choose one of: {', '.join(SIZES)}")
    s = SIZES[size]
    common = dict(
        vocab_size=vocab_size, hidden_size=s.hidden_size, num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
        intermediate_size=s.intermediate_size, max_position_embeddings=max(max_positions, s.max_positions),
        head_dim=s.hidden_size // s.num_heads, tie_word_embeddings=True, rope_theta=s.rope_theta,
        pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
    )
    config = {"qwen3": Qwen3Config, "llama": LlamaConfig, "qwen2": Qwen2Config}[arch](**common)
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


def add_chat_tokens(tokenizer) -> None:
    """Make a character tokenizer a chat one: ChatML's special tokens, the tool-call tags as tokens
    of their own, and ``CHATML_TEMPLATE``. Its EOS stays ``<eos>``: a turn ends at ``<|im_end|>``,
    the template's end of turn (``tether.decoding.stops``), as under Qwen's base models."""
    tokenizer.add_special_tokens({"additional_special_tokens": list(CHAT_SPECIAL_TOKENS)})
    tokenizer.add_tokens(list(TOOL_CALL_TOKENS))
    tokenizer.chat_template = CHATML_TEMPLATE


def init_model(out: str | Path, *, arch: str = "qwen3", size: str = "small", seed: int = 0,
               alphabet: str = DEFAULT_ALPHABET, overwrite: bool = False,
               chat: bool = False) -> TinyModelInfo:
    """Build a tokenizer and model and save both to ``out`` (refuses to overwrite by default);
    ``chat``: a chat model (``add_chat_tokens``, braces added to ``alphabet``, a context of
    ``CHAT_MAX_POSITIONS``)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"{out} already exists and is not empty; choose another path or pass --overwrite")
    if size not in SIZES:  # before the tokenizer, which reads the size's vocabulary
        raise ConfigError(f"unknown model size {size!r}; choose one of: {', '.join(SIZES)}")
    shape = SIZES[size]
    positions = max(CHAT_MAX_POSITIONS if chat else 256, shape.max_positions)
    tokenizer = build_char_tokenizer(alphabet + ("{}" if chat else ""), vocab_size=shape.vocab_size,
                                     model_max_length=positions)
    if chat:
        add_chat_tokens(tokenizer)
    model = build_model(len(tokenizer), arch=arch, size=size, seed=seed, max_positions=positions,
                        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    info = TinyModelInfo(arch=arch, size=size, seed=seed, vocab_size=len(tokenizer),
                         parameters=sum(p.numel() for p in model.parameters()))
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    (out / "tether_model.json").write_text(json.dumps(asdict(info), indent=2) + "\n")
    return info
