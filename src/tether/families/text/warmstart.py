"""The text family's warm start: fine-tune on a task's demonstrations (``tether.train.supervised``)
until held-out greedy pass@1 reaches ``warmstart.target_pass_rate``, so RL has something to work
with. Each training example's demonstration (or its answer) followed by EOS is the target; the
loss covers target tokens only.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from tether.decoding.sampling import sample, stop_ids_for
from tether.errors import ConfigError
from tether.train.supervised import WarmstartResult, warmstart_loop, write_record
from tether.vocabulary import Example, Progress, SamplingParams

Score = Callable[[Example, str], float]
"""A completion's reward for an example, in [0, 1]; 1 counts as solved."""


def encode_demonstrations(tokenizer, examples: Sequence[Example]) -> list[tuple[list[int], int]]:
    """(prompt + target + eos token ids, prompt length) per example."""
    out = []
    for ex in examples:
        prompt = tokenizer(ex.prompt, add_special_tokens=False).input_ids
        target = tokenizer(ex.target, add_special_tokens=False).input_ids
        out.append((prompt + target + [tokenizer.eos_token_id], len(prompt)))
    return out


def sft_batch(encoded: Sequence[tuple[list[int], int]], pad_id: int):
    """Right-padded (B, L) ids, attention mask, and labels with -100 on prompt and padding."""
    width = max(len(ids) for ids, _ in encoded)
    ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)  # (B, L)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (seq, plen) in enumerate(encoded):
        ids[i, : len(seq)] = torch.as_tensor(seq)
        mask[i, : len(seq)] = 1
        labels[i, plen: len(seq)] = torch.as_tensor(seq[plen:])
    return ids, mask, labels


def pass_at_1(model, tokenizer, score: Score, examples: Sequence[Example], *, stop_text: str = "\n",
              batch_size: int = 256, max_new_tokens: int | None = None) -> float:
    """Share of examples whose greedy completion earns the full reward."""
    was_training = model.training
    model.eval()
    if max_new_tokens is None:
        longest = max(len(tokenizer(ex.target, add_special_tokens=False).input_ids) for ex in examples)
        max_new_tokens = longest + 2
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    stops = stop_ids_for(tokenizer, stop_text)
    correct = 0
    for i in range(0, len(examples), batch_size):
        chunk = examples[i: i + batch_size]
        prompts = [tokenizer(ex.prompt, add_special_tokens=False).input_ids for ex in chunk]
        out = sample(model, prompts, params, stop_ids=stops, pad_id=tokenizer.pad_token_id)
        for ex, toks in zip(chunk, out.tokens, strict=True):
            text = tokenizer.decode(toks, skip_special_tokens=True)
            correct += score(ex, text) >= 1.0
    model.train(was_training)
    return correct / len(examples)


def warmstart(
    model_dir: str | Path,
    train_examples: Sequence[Example],
    held_out: Sequence[Example],
    score: Score,
    *,
    settings: Any,
    seed: int = 0,
    threads: int = 1,
    stop_text: str = "\n",
    description: str = "",
    out_dir: str | Path | None = None,
    on_progress: Progress | None = None,
) -> WarmstartResult:
    """Fine-tune the model in ``model_dir`` on demonstrations under the ``warmstart`` section's
    ``settings``, with ``threads`` torch threads (the same model comes out at the same count on
    any machine); save to ``out_dir`` (default: in place) with ``warmstart.json``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ConfigError(
            f"{model_dir} is not a model directory (no config.json); run `tether init-model` first"
        )
    s = settings
    torch.set_num_threads(threads)  # the thread count decides the rounding, so the model
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    train = encode_demonstrations(tokenizer, train_examples)
    # Not the fused kernel the learner uses: its different rounding changes which step reaches
    # the target and so the demo's starting model (tried: 21% after 590 steps instead of 22%
    # after 535, and the demo's RL gained 17 points from there instead of 24.5); it would save
    # ~4 s of ~65.
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    rng = random.Random(seed)

    def loss_at(step: int) -> torch.Tensor:
        chosen = rng.sample(train, min(s.batch_size, len(train)))
        ids, mask, labels = sft_batch(chosen, tokenizer.pad_token_id)
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss

    def evaluate() -> dict[str, float]:
        return {"pass_at_1": pass_at_1(model, tokenizer, score, held_out, stop_text=stop_text)}

    result = warmstart_loop(model, optimizer, loss_at, evaluate, s, data=description, on_progress=on_progress)
    out = Path(out_dir) if out_dir is not None else model_dir
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    write_record(out, result, {**asdict(s), "seed": seed})
    return result


def run_warmstart(cfg: Any, model_dir: Path, out_dir: Path, on_progress: Progress | None = None):
    """Warm-start ``model_dir`` on the recipe's data and reward; write the result to ``out_dir``."""
    family = cfg.family()
    data = family.data(cfg, model_dir)
    return warmstart(model_dir, data.train, data.eval, family.scorer(cfg), stop_text=data.stop_text,
                     description=data.description, out_dir=out_dir, settings=cfg.warmstart,
                     seed=cfg.run.seed, threads=cfg.train.threads, on_progress=on_progress)
