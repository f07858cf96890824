"""A tiny Stable Diffusion 3 pipeline built locally from configs, randomly initialised: an
SD3 transformer, a VAE, two CLIP text encoders with a character-level CLIP tokenizer, and SD3's
flow-matching scheduler (shift 3). Nothing is downloaded; it is the stand-in for a real SD3-class
pipeline in tests, ``recipes/flow-sd3-tiny.yaml`` and ``benchmarks/``, as diffusers' own tests
build theirs. A real pipeline directory is used the same way (``model.path``).

    python -m tether.families.flow.tiny_sd3 runs/tiny-sd3 [--seed 0] [--image-size 32]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

ALPHABET = [chr(c) for c in range(33, 127)]
SD3_VAE_FACTOR = 2
"""How many times the built VAE shrinks an image on a side (two levels: latents half as wide)."""


def _symbols(word: str) -> list[str]:
    """A word as CLIP's BPE starts it: one symbol a character, the last marked as a word's end."""
    return [*word[:-1], word[-1] + "</w>"]


def _bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """``word``'s tokens under the merges ``ranks``, merged as byte-pair encoding merges: the
    adjacent pair of the lowest rank first, every occurrence of it left to right, until none is
    left that a merge names."""
    symbols = _symbols(word)
    while len(symbols) > 1:
        pairs = [(ranks[p], p) for p in itertools.pairwise(symbols) if p in ranks]
        if not pairs:
            break
        pair = min(pairs)[1]
        out, i = [], 0
        while i < len(symbols):
            if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
                out.append(symbols[i] + symbols[i + 1])
                i += 2
            else:
                out.append(symbols[i])
                i += 1
        symbols = out
    return symbols


def word_merges(words: Sequence[str]) -> list[tuple[str, str]]:
    """BPE merges under which each of ``words`` is one token, as a real CLIP tokenizer holds the
    common words of its captions whole: a word still in pieces gets a merge of its first two
    pieces, ranked after every merge before it, so the merges already made apply first and each
    pass leaves every unfinished word in fewer pieces, until every word is whole."""
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    pending = sorted(set(words))
    while pending:
        left = []
        for word in pending:
            pieces = _bpe(word, ranks)
            if len(pieces) > 1:
                ranks[(pieces[0], pieces[1])] = len(merges)
                merges.append((pieces[0], pieces[1]))
                left.append(word)
        pending = left
    return merges


def _tokenizer(folder: Path, max_length: int, words: Sequence[str] = ()):
    """A CLIP tokenizer over printable ASCII characters, one token a character (the last of a word
    marked as CLIP's BPE marks it), with merges that keep each of ``words`` whole: a prompt of
    those words is a token a word, and any other text still has its characters."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        for c in ALPHABET:
            vocab[c + suffix] = len(vocab)
    merges = word_merges([w.lower() for w in words])
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=max_length,
                         pad_token="<|endoftext|>")


def prompt_tokens(prompts: Sequence[str], words: Sequence[str] = ()) -> int:
    """The most tokens any of ``prompts`` takes under the tokenizer ``build_tiny_sd3`` builds with
    ``words``, CLIP's start and end included: the shortest prompt length that cuts none short."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        tokenizer = _tokenizer(Path(folder), 1 << 16, words)
        return max(len(tokenizer(p).input_ids) for p in prompts)


def init_text_encoder(encoder, seed: int) -> None:
    """Draw a CLIP text encoder's weights from ``seed`` by the standard deviations transformers'
    CLIPPreTrainedModel gives them (token embeddings 0.02; the attention's q, k, v d^-½·(2L)^-½
    and its output d^-½; the MLP's first layer (2d)^-½ and its second d^-½·(2L)^-½; the text
    projection d^-½; biases 0, layer norms 1), positions at 0.01 as OpenAI's CLIP (Radford et al.
    2021) draws them, parameter by parameter in name order from a generator of its own. The draw is
    this function's, not the installed transformers' (whose order of drawing differs between
    versions): the same seed builds the same encoders whatever version is installed."""
    import torch

    cfg = encoder.config
    d, layers = cfg.hidden_size, cfg.num_hidden_layers
    generator = torch.Generator().manual_seed(seed)
    deep = d ** -0.5 * (2 * layers) ** -0.5
    rules = (("token_embedding", 0.02), ("position_embedding", 0.01), ("q_proj", deep), ("k_proj", deep),
             ("v_proj", deep), ("out_proj", d ** -0.5), ("fc1", (2 * d) ** -0.5), ("fc2", deep),
             ("text_projection", d ** -0.5))
    with torch.no_grad():
        for name, param in sorted(encoder.named_parameters()):
            if "norm" in name:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                std = next((s for key, s in rules if key in name), None)
                if std is None:
                    raise ValueError(f"no initialisation rule for the text encoder's {name}")
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def build_tiny_sd3(out: str | Path, *, seed: int = 0, image_size: int = 32, width: int = 32, depth: int = 2,
                   text_width: int = 32, max_prompt_tokens: int = 32, vae_width: int = 8,
                   words: Sequence[str] = ()) -> Path:
    """Write the pipeline to ``out`` (through a temporary folder and a rename: never half a
    pipeline at ``out``). ``image_size`` pixels (latents are half as wide, 4 channels);
    ``vae_width`` the VAE's first level's channels (its second has twice as many); ``words`` held
    whole by the tokenizer (``_tokenizer``; none: one token a character)."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from tether.families.flow.pipeline import importing_quietly

    with importing_quietly():
        from diffusers import (
            AutoencoderKL,
            FlowMatchEulerDiscreteScheduler,
            SD3Transformer2DModel,
            StableDiffusion3Pipeline,
        )

    out = Path(out)
    staging = out.parent / f".{out.name}.building-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    torch.manual_seed(seed)
    heads = 4
    transformer = SD3Transformer2DModel(
        sample_size=image_size // 2, patch_size=2, in_channels=4, out_channels=4, num_layers=depth,
        attention_head_dim=width // heads, num_attention_heads=heads, caption_projection_dim=width,
        joint_attention_dim=2 * text_width, pooled_projection_dim=2 * text_width,
        pos_embed_max_size=image_size)
    vae = AutoencoderKL(block_out_channels=(vae_width, 2 * vae_width), in_channels=3, out_channels=3,
                        latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2,
                        sample_size=image_size, norm_num_groups=8, scaling_factor=1.5035, shift_factor=0.0609)
    tokenizer = _tokenizer(staging / "_tokenizer", max_prompt_tokens, words)
    text = CLIPTextConfig(bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=text_width,
                          intermediate_size=2 * text_width, num_attention_heads=4, num_hidden_layers=2,
                          vocab_size=len(tokenizer.get_vocab()), projection_dim=text_width,
                          max_position_embeddings=max_prompt_tokens, hidden_act="gelu")
    encoders = [CLIPTextModelWithProjection(text) for _ in range(2)]
    for i, encoder in enumerate(encoders):
        init_text_encoder(encoder, seed=1000 * seed + 1 + i)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        text_encoder=encoders[0], tokenizer=tokenizer, text_encoder_2=encoders[1], tokenizer_2=tokenizer,
        text_encoder_3=None, tokenizer_3=None)
    from tether.families.flow.pipeline import saving_quietly

    try:
        with saving_quietly():
            pipe.save_pretrained(staging / "pipeline")
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging / "pipeline", out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image-size", type=int, default=32)
    ns = parser.parse_args(argv)
    print(build_tiny_sd3(ns.out, seed=ns.seed, image_size=ns.image_size))


if __name__ == "__main__":
    main()
