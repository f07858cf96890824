"""Build the tiny flow model and warm-start it with flow matching on drawn images.

Rectified flow's training objective: for an image x₀ of a training prompt, noise x₁ and
t ~ logit-normal (SD3's choice, most weight mid-way), x_t = (1 − t)·x₀ + t·x₁ and the model
regresses the velocity x₁ − x₀. A share of the images (``flow.init_cond_dropout``: 0.1, the 10 %
of captions Stable Diffusion's base models drop; Ho & Salimans 2022 use 0.1–0.2) is trained with
the empty prompt, all ``<pad>``, so the unconditional branch that classifier-free guidance
subtracts is a velocity the model learned (the mean over every scene), not one it never saw. The
images are drawn by ``scenes.render`` for the train split's prompts only; held-out prompts are
new combinations of the same words. As for language models (``tether.families.text.warmstart``)
it stops as soon as held-out pass@1 (the ODE image earning the full reward) reaches
``warmstart.target_pass_rate``, so RL starts from a model that is sometimes right, with room
above it to show.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from tether.families.flow import scenes
from tether.families.flow.evaluate import FlowEvaluator
from tether.families.flow.model import FlowModel, FlowModelConfig
from tether.families.flow.policy import FlowSampling
from tether.train.supervised import WarmstartResult, warmstart_loop, write_record
from tether.vocabulary import Example, Progress


def drawn_scenes(examples: Sequence[Example], n: int, rng: random.Random) -> tuple[list[str], torch.Tensor]:
    """``n`` random prompts of ``examples`` and an image drawn for each, (n, 3, H, W) in [−1, 1]."""
    chosen = [rng.choice(examples).prompt for _ in range(n)]
    images = torch.stack([scenes.from_pixels(scenes.render(scenes.Scene.parse(p), rng)) for p in chosen])
    return chosen, images


def drawn_images(examples: Sequence[Example], n: int,
                 rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` (image, prompt word ids) pairs drawn for random training prompts."""
    chosen, images = drawn_scenes(examples, n, rng)
    return images, torch.tensor([scenes.encode(p) for p in chosen])


def dropped_conditions(words: torch.Tensor, rate: float, generator: torch.Generator | None = None
                       ) -> torch.Tensor:
    """``words`` (N, L) with each row replaced by the empty prompt's (all ``<pad>``, id 0) with
    probability ``rate``; the same tensor at rate 0 (no draw either)."""
    if rate == 0:
        return words
    dropped = torch.rand(words.shape[0], generator=generator) < rate  # (N,)
    return torch.where(dropped[:, None], torch.zeros_like(words), words)


def flow_matching_loss(model: FlowModel, images: torch.Tensor, words: torch.Tensor,
                       generator: torch.Generator | None = None, cond_dropout: float = 0.0) -> torch.Tensor:
    n = images.shape[0]
    words = dropped_conditions(words, cond_dropout, generator)
    noise = torch.randn(images.shape, generator=generator)
    t = torch.sigmoid(torch.randn(n, generator=generator))
    tb = t[:, None, None, None]
    return ((model((1 - tb) * images + tb * noise, t, words) - (noise - images)) ** 2).mean()


def flow_warmstart(out_dir: str | Path, config: FlowModelConfig, train: Sequence[Example],
                   held_out: Sequence[Example], score, *, settings: Any, seed: int, threads: int = 1,
                   eval_steps: int,
                   sampling: FlowSampling, pool: int = 8192, cond_dropout: float = 0.0,
                   on_progress: Progress | None = None) -> WarmstartResult:
    """Train a new ``FlowModel`` under the ``warmstart`` section's ``settings`` and save it to
    ``out_dir`` with ``warmstart.json``; ``cond_dropout`` of the images with the empty prompt."""
    s = settings
    torch.set_num_threads(threads)  # the thread count decides the rounding, so the model
    torch.manual_seed(seed)
    model = FlowModel(config)
    rng = random.Random(f"flow-warmstart/{seed}")
    images, words = drawn_images(train, pool, rng)  # drawn once, then sampled in mini-batches
    evaluator = FlowEvaluator(model, held_out, score, eval_steps=eval_steps, sampling=sampling, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)

    def loss_at(step: int) -> torch.Tensor:
        idx = torch.randint(0, pool, (s.batch_size,), generator=generator)
        return flow_matching_loss(model, images[idx], words[idx], generator, cond_dropout)

    def evaluate() -> dict[str, float]:
        m = evaluator(0)
        return {"pass_at_1": m["eval/pass_at_1"], "reward": m["eval/reward_mean"]}

    result = warmstart_loop(model, optimizer, loss_at, evaluate, s, data="task shapes (drawn images)",
                            on_progress=on_progress)
    out = Path(out_dir)
    model.save_pretrained(out)
    write_record(out, result, {**asdict(s), "seed": seed, "cond_dropout": cond_dropout})
    return result
