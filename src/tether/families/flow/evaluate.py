"""Held-out evaluation of a flow model: images sampled by the deterministic ODE with more steps
than training uses (and, with ``eval.num_samples``, by the training SDE), scored by the reward.

``eval/pass_at_1``: the share of held-out prompts whose ODE image earns the full reward (the
counterpart of a language model's greedy pass@1); ``eval/reward_mean`` its mean reward;
``eval/sampled_reward_mean`` and ``eval/sampled_pass_at_1``: the same over k SDE samples per prompt
at the training settings (its SDE window too). The noise is fixed by the seed, so evaluations
along a run differ only by the weights. ``images_to``: also write a grid of the first ``grid``
prompts' ODE images at each evaluation (``samples/step_NNNNNN.png`` in the run directory), for
``tether report``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tether.data.rewards import Scorer
from tether.families.flow import conditioning
from tether.families.flow.policy import FlowSampling, generate_latents, sample
from tether.vocabulary import Example


class FlowEvaluator:
    def __init__(self, model, examples: Sequence[Example], score: Scorer, *, eval_steps: int,
                 sampling: FlowSampling, seed: int = 0, num_samples: int = 1, images_to: Path | None = None,
                 grid: int = 16, batch_size: int = 256, negative_prompt: str = "") -> None:
        self.model = model
        self.examples = list(examples)
        self.score = score
        self.eval_steps = eval_steps
        self.sampling = sampling
        self.seed = seed
        self.num_samples = num_samples
        self.images_to = images_to
        self.grid = grid
        self.batch_size = batch_size
        self.cond = model.encode_prompts([e.prompt for e in self.examples])
        self.negative = model.encode_prompts([negative_prompt]) if sampling.guided else None
        self.times = model.times(eval_steps, sampling.shift)

    def _chunks(self, cond: dict[str, torch.Tensor]):
        n = conditioning.num_rows(cond)
        for i in range(0, n, self.batch_size):
            yield conditioning.rows(cond, torch.arange(i, min(n, i + self.batch_size)))

    def images(self, cond: dict[str, torch.Tensor], seed: int) -> list:
        """(H, W, 3) pixels of ODE samples of ``cond``, in chunks, from noise fixed by ``seed``."""
        generator = torch.Generator().manual_seed(seed)
        return [image for chunk in self._chunks(cond)
                for image in self.model.decode(generate_latents(
                    self.model, chunk, self.times, generator=generator, negative=self.negative,
                    guidance=self.sampling.guidance_scale))]

    def _rewards(self, images: list, examples: Sequence[Example]) -> list[float]:
        return [self.score(e, x) for e, x in zip(examples, images, strict=True)]

    def __call__(self, step: int) -> Mapping[str, float]:
        was_training = self.model.training
        self.model.eval()
        try:
            ode = self.images(self.cond, self.seed)
            rewards = self._rewards(ode, self.examples)
            k = self.num_samples
            repeated = conditioning.rows(self.cond, torch.arange(len(self.examples)).repeat_interleave(k))
            seed = self.seed * 7919 + step
            # the window training's batch ``step`` had (drawn, or its place in the slide)
            generator, window = torch.Generator().manual_seed(seed), self.sampling.window_steps(seed, step)
            finals = (sample(self.model, chunk, self.sampling, generator=generator, negative=self.negative,
                             window=window).final for chunk in self._chunks(repeated))
            sampled_images = [image for final in finals for image in self.model.decode(final)]
            sampled = self._rewards(sampled_images, [e for e in self.examples for _ in range(k)])
        finally:
            self.model.train(was_training)
        if self.images_to is not None:
            save_grid(ode[: self.grid], self.images_to / f"step_{step:06d}.png")
            (self.images_to / "prompts.txt").write_text(  # what each tile was asked for, row by row
                "".join(f"{e.prompt}\n" for e in self.examples[: self.grid]))
        n = len(rewards)
        return {"eval/pass_at_1": sum(r >= 1.0 for r in rewards) / n,
                "eval/reward_mean": sum(rewards) / n,
                "eval/sampled_reward_mean": sum(sampled) / len(sampled),
                "eval/sampled_pass_at_1": sum(r >= 1.0 for r in sampled) / len(sampled),
                "eval/examples": float(n)}


def save_grid(tiles: list, path: Path, *, columns: int = 8, scale: int = 0) -> None:
    """Write ``tiles`` ((H, W, 3) uint8 pixels) as one PNG, ``columns`` wide, each pixel
    ``scale``× (0: up to about 64 pixels a tile), written by a temporary file and a rename: a
    reader never sees half a picture."""
    import os

    import numpy as np
    from PIL import Image

    h, w = tiles[0].shape[:2]
    scale = scale or max(1, 64 // max(h, w))
    rows = -(-len(tiles) // columns)
    canvas = np.full((rows * (h + 1) + 1, columns * (w + 1) + 1, 3), 64, dtype=np.uint8)
    for i, tile in enumerate(tiles):
        r, c = divmod(i, columns)
        canvas[1 + r * (h + 1):1 + r * (h + 1) + h, 1 + c * (w + 1):1 + c * (w + 1) + w] = tile
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    size = (canvas.shape[1] * scale, canvas.shape[0] * scale)
    Image.fromarray(canvas).resize(size, Image.NEAREST).save(tmp)
    os.replace(tmp, path)


def report_samples(pictures: list[Path], evals: list[dict[str, Any]], path: Path, rows: int = 5) -> Path:
    """Up to ``rows`` evaluations' image grids, evenly spaced from the first to the last, each
    titled with its step and held-out reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    chosen = evenly_spaced(len(pictures), rows)
    reward = {int(e["step"]): e.get("eval/reward_mean") for e in evals}
    fig, axes = plt.subplots(len(chosen), 1, figsize=(8, 1.6 * len(chosen) + 0.4), squeeze=False)
    for ax, i in zip(axes[:, 0], chosen, strict=True):
        step = int(pictures[i].stem.split("_")[1])
        ax.imshow(Image.open(pictures[i]))
        r = reward.get(step)
        ax.set_title(f"after {step} batches" + (f": held-out reward {r:.3f}" if r is not None else ""),
                     fontsize=9)
        ax.axis("off")
    fig.suptitle("held-out prompts (ODE samples, fixed noise)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def evenly_spaced(n: int, most: int) -> list[int]:
    """Up to ``most`` of the indices 0 … n − 1, evenly spaced, the first and the last among them."""
    shown = min(most, n)
    return sorted({round(i * (n - 1) / max(shown - 1, 1)) for i in range(shown)})
