"""Tiny models of the architectures users bring, built locally from transformers configs (nothing
downloads), with a character tokenizer or a byte-level BPE tokenizer trained on a task's text.

GPT-2's config turns dropout on (0.1) as its defaults do, like the released checkpoints; the
others have none. Each is ~0.2-0.5M parameters: enough layers and heads to exercise the real
attention, norms and position code, small enough that a forward takes milliseconds.
"""

from __future__ import annotations

from pathlib import Path

SIZE = {"hidden": 128, "layers": 2, "heads": 2, "kv_heads": 1, "ffn": 256}
"""Heads of 64 dimensions: the smallest vLLM's CPU attention serves."""
ARCHITECTURES = ("gpt2", "llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2")


def config_for(arch: str, vocab_size: int, *, pad: int, bos: int, eos: int):
    from transformers import (
        Gemma2Config,
        GPT2Config,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    h, n, heads, kv, ffn = (SIZE[k] for k in ("hidden", "layers", "heads", "kv_heads", "ffn"))
    ids = dict(pad_token_id=pad, bos_token_id=bos, eos_token_id=eos, vocab_size=vocab_size)
    if arch == "gpt2":
        return GPT2Config(n_embd=h, n_layer=n, n_head=heads, n_positions=256, n_inner=ffn, **ids)
    common = dict(hidden_size=h, num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=kv,
                  intermediate_size=ffn, max_position_embeddings=256, **ids)
    if arch == "gemma2":
        return Gemma2Config(head_dim=h // heads, sliding_window=64, **common)
    return {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig,
            "phi3": Phi3Config}[arch](**common)


def bpe_tokenizer(texts: list[str], vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on ``texts`` (the GPT-2 family's kind)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", padding_side="left", model_max_length=256)


def build(out: Path, arch: str, tokenizer: str, texts: list[str], seed: int = 0) -> Path:
    """A model directory of ``arch`` with a ``char`` or ``bpe`` tokenizer, written to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    from tether.data.tiny_model import build_char_tokenizer

    tok = build_char_tokenizer() if tokenizer == "char" else bpe_tokenizer(texts)
    config = config_for(arch, len(tok), pad=tok.pad_token_id, bos=tok.bos_token_id, eos=tok.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)
    model.save_pretrained(out)
    return out
