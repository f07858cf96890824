"""Tiny GGUF files written here with the ``gguf`` package's writer, for the import command's tests:
a two-layer Llama with random float32 weights, tied embeddings and a byte-level BPE tokenizer of
263 tokens with a ChatML template (the layout of SmolLM2's file, at a size that takes a second),
and the same header under an architecture transformers cannot read."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("Ġ t", "h e", "Ġt he")
HIDDEN, LAYERS, HEADS, KV_HEADS, INTER = 32, 2, 4, 2, 64


def _byte_symbols() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for bytes (GPT-2's table): printable
    Latin-1 bytes stand for themselves, the rest map to code points from 256 up, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(extra)) for b in range(256)]


def vocabulary() -> list[str]:
    return [*SPECIALS, *_byte_symbols(), *(m.replace(" ", "") for m in MERGES)]


def write_tiny_gguf(path: str | Path, *, architecture: str = "llama", seed: int = 0) -> Path:
    """A two-layer model of ``architecture`` (its tensors named as llama.cpp names a Llama's)."""
    import gguf
    import numpy as np

    path = Path(path)
    rng = np.random.default_rng(seed)
    tokens = vocabulary()
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("tether tiny test model")
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))  # CONTROL, NORMAL
    w.add_token_merges(list(MERGES))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def add(name: str, *shape: int, scale: float = 0.2, base: float = 0.0) -> None:
        w.add_tensor(name, (base + scale * rng.standard_normal(shape)).astype(np.float32))

    d, kv = HIDDEN // HEADS, KV_HEADS * (HIDDEN // HEADS)
    add("token_embd.weight", len(tokens), HIDDEN)
    add("output_norm.weight", HIDDEN, scale=0.1, base=1.0)
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", HIDDEN, scale=0.1, base=1.0)
        add(f"blk.{i}.ffn_norm.weight", HIDDEN, scale=0.1, base=1.0)
        add(f"blk.{i}.attn_q.weight", HEADS * d, HIDDEN)
        add(f"blk.{i}.attn_k.weight", kv, HIDDEN)
        add(f"blk.{i}.attn_v.weight", kv, HIDDEN)
        add(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * d)
        add(f"blk.{i}.ffn_gate.weight", INTER, HIDDEN)
        add(f"blk.{i}.ffn_up.weight", INTER, HIDDEN)
        add(f"blk.{i}.ffn_down.weight", HIDDEN, INTER)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
