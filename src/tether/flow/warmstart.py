"""Build the tiny flow model and warm-start it with flow matching on drawn images.

Rectified flow's training objective: for an image x₀ of a training prompt, noise x₁ and
t ~ logit-normal (SD3's choice, most weight mid-way), x_t = (1 − t)·x₀ + t·x₁ and the model
regresses the velocity x₁ − x₀. The images are drawn by ``scenes.render`` for the train split's
prompts only; held-out prompts are new combinations of the same words. As for language models
(``tether.data.warmstart``) it stops as soon as held-out pass@1 (the ODE image earning the full
reward) reaches ``warmstart.target_pass_rate``, so RL starts from a model that is sometimes
right, with room above it to show.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from tether.data.types import Example
from tether.data.warmstart import WarmstartResult, WarmstartSettings
from tether.flow import scenes
from tether.flow.evaluate import FlowEvaluator
from tether.flow.model import FlowModel, FlowModelConfig
from tether.flow.policy import FlowSampling


def drawn_images(examples: Sequence[Example], n: int,
                 rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` (image, prompt word ids) pairs drawn for random training prompts."""
    chosen = [scenes.Scene.parse(rng.choice(examples).prompt) for _ in range(n)]
    images = torch.stack([scenes.from_pixels(scenes.render(s, rng)) for s in chosen])
    return images, torch.tensor([scenes.encode(s.prompt) for s in chosen])


def flow_matching_loss(model: FlowModel, images: torch.Tensor, words: torch.Tensor,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    n = images.shape[0]
    noise = torch.randn(images.shape, generator=generator)
    t = torch.sigmoid(torch.randn(n, generator=generator))
    tb = t[:, None, None, None]
    return ((model((1 - tb) * images + tb * noise, t, words) - (noise - images)) ** 2).mean()


def flow_warmstart(out_dir: str | Path, config: FlowModelConfig, train: Sequence[Example],
                   held_out: Sequence[Example], score, *, settings: WarmstartSettings, eval_steps: int,
                   sampling: FlowSampling, pool: int = 8192,
                   on_progress: Callable[[int, Mapping[str, float]], None] | None = None) -> WarmstartResult:
    """Train a new ``FlowModel`` and save it to ``out_dir`` with ``warmstart.json``."""
    s = settings
    torch.manual_seed(s.seed)
    model = FlowModel(config)
    rng = random.Random(f"flow-warmstart/{s.seed}")
    images, words = drawn_images(train, pool, rng)  # drawn once, then sampled in mini-batches
    evaluator = FlowEvaluator(model, held_out, score, eval_steps=eval_steps, sampling=sampling, seed=s.seed)
    generator = torch.Generator().manual_seed(s.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    t0 = time.monotonic()

    def evaluate() -> tuple[float, float]:
        m = evaluator(0)
        return m["eval/pass_at_1"], m["eval/reward_mean"]

    before, reward_before = evaluate()
    result = WarmstartResult(data="task shapes (drawn images)", steps=0, seconds=0.0, pass_at_1_before=before,
                             pass_at_1_after=before, stopped_because="max_steps")
    reward_after = reward_before
    model.train()
    for step in range(1, s.max_steps + 1):
        idx = torch.randint(0, pool, (s.batch_size,), generator=generator)
        loss = flow_matching_loss(model, images[idx], words[idx], generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        result.steps = step
        metrics = {"loss": float(loss.detach()), "seconds": time.monotonic() - t0}
        if step % s.eval_every == 0 or step == s.max_steps:
            result.pass_at_1_after, reward_after = evaluate()
            metrics.update(pass_at_1=result.pass_at_1_after, reward=reward_after)
            result.history.append({"step": step, **metrics})
        if on_progress is not None:
            on_progress(step, metrics)
        if "pass_at_1" in metrics and result.pass_at_1_after >= s.target_pass_rate:
            result.stopped_because = "target_pass_rate"
            break
        if metrics["seconds"] > s.max_seconds:
            result.stopped_because = "max_seconds"
            result.pass_at_1_after, reward_after = evaluate()
            break
    result.seconds = time.monotonic() - t0
    out = Path(out_dir)
    model.save_pretrained(out)
    (out / "warmstart.json").write_text(json.dumps(
        {**asdict(result), "reward_before": reward_before, "reward_after": reward_after,
         "settings": asdict(s)}, indent=2) + "\n")
    return result
