"""A tiny SD3 pipeline that can learn the shapes task: its VAE trained here as an autoencoder on
drawn scene images, then its transformer warm-started by flow matching on those images' latents
with their prompts (``flow.init_backbone: sd3``).

A randomly initialised VAE decodes every latent to nearly the same picture, so no pixel reward has
anything to follow (docs/flow.md). Here:

1. **The VAE** (a 2-level ``AutoencoderKL`` of 16 and 32 channels, 16 × 16 pixels → 4 × 8 × 8) learns
   to reconstruct drawn scenes: L1 on pixels plus a small KL on the posterior (β = 1e-4), Adam,
   until its reconstructions of every scene earn the verifier's ``flow.init_vae_reward`` (checked
   every 250 steps; at most ``flow.init_vae_steps``, with a warning if it falls short). Its
   ``scaling_factor`` and ``shift_factor`` are then set from the latents' statistics (SD3's
   convention: latents = (z − shift)·scale have zero mean and unit variance), so the
   transformer's noise and the data it is mixed with have one scale.
2. **The transformer** regresses rectified flow's velocity on those latents, the prompts encoded by
   the pipeline's own (frozen, random) CLIP text encoders, a share (``flow.init_cond_dropout``) with
   the empty prompt so classifier-free guidance subtracts a velocity it learned; evaluated on the
   held-out prompts with the run's guidance, and stopped at ``warmstart.target_pass_rate`` as the
   built-in model's warm start is (``tether.families.flow.warmstart``).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from tether.errors import ConfigError
from tether.families.flow import scenes
from tether.families.flow.pipeline import saving_quietly
from tether.families.flow.warmstart import drawn_scenes
from tether.train.supervised import WarmstartResult, warmstart_loop, write_record
from tether.vocabulary import Example, Progress

VAE_WIDTH = 16
"""The VAE's first level's channels: at 8 (the tests' random pipeline) 1,500 steps reconstruct a
drawn scene well enough for the verifier's full reward on 24 % of them, at 16 on all (measured on
400 scenes)."""

VAE_KL = 1e-4
"""The KL weight of the VAE's posterior against N(0, I): small, as latent-diffusion autoencoders
keep it, enough to keep the latents near unit scale without blurring the shapes away."""


VAE_CHECK_EVERY = 250
"""Steps between two checks of the VAE's reconstructions against its target reward."""


@torch.no_grad()
def reconstructions(vae, images: torch.Tensor) -> torch.Tensor:
    """``vae``'s reconstructions of ``images`` (the posterior's mean, decoded), in eval mode."""
    was_training = vae.training
    vae.eval()
    decoded = torch.cat([vae.decode(vae.encode(chunk).latent_dist.mean).sample
                         for chunk in images.split(256)])
    vae.train(was_training)
    return decoded


def reconstruction_reward(vae, scenes_drawn: Sequence[scenes.Scene], images: torch.Tensor) -> float:
    """The verifier's mean reward on ``vae``'s reconstructions of ``images`` drawn for
    ``scenes_drawn``: what a pixel reward can reach through this VAE at best."""
    decoded = reconstructions(vae, images)
    rewards = [scenes.score(scene, scenes.to_pixels(x))
               for scene, x in zip(scenes_drawn, decoded, strict=True)]
    return sum(rewards) / len(rewards)


def check_scenes(seed: int, n: int = 256) -> tuple[list[scenes.Scene], torch.Tensor]:
    """``n`` drawn images of every scene in turn (held-out ones too: the VAE must draw any scene),
    the VAE's reconstruction check."""
    rng = random.Random(f"sd3-vae-check/{seed}")
    every = scenes.all_scenes()
    drawn = [every[i % len(every)] for i in range(n)]
    return drawn, torch.stack([scenes.from_pixels(scenes.render(scene, rng)) for scene in drawn])


def train_vae(vae, images: torch.Tensor, *, steps: int, generator: torch.Generator, batch_size: int = 64,
              lr: float = 2e-3, check: Callable[[], float] | None = None,
              target: float = 1.0) -> tuple[float, int, float | None]:
    """Fit ``vae`` (an ``AutoencoderKL``) to ``images`` (N, 3, H, W) in [−1, 1] for at most
    ``steps`` steps, stopping once ``check()`` (called every ``VAE_CHECK_EVERY`` steps and at the
    last; the reconstructions' reward) reaches ``target``. Returns (the final mean absolute
    reconstruction error over the whole pool in [−1, 1] units, the steps taken, the last check).
    Where the loss drops is a matter of rounding as much as of the seed: on one machine 1,000
    steps reconstructed every scene to the full reward, on another it took 1,500, with 0.60 at
    1,000 (docs/flow.md); so the check, not a step count, says when it is done."""
    vae.train()
    optimizer = torch.optim.Adam(vae.parameters(), lr=lr)
    reward, step = None, 0
    while step < steps:
        x = images[torch.randint(0, len(images), (batch_size,), generator=generator)]
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
        loss = (vae.decode(z).sample - x).abs().mean() + VAE_KL * posterior.kl().mean() / x[0].numel()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if check is not None and (step % VAE_CHECK_EVERY == 0 or step == steps):
            reward = check()
            if reward >= target:
                break
    vae.eval()
    return float((reconstructions(vae, images) - images).abs().mean()), step, reward


@torch.no_grad()
def set_latent_scale(vae, images: torch.Tensor) -> tuple[float, float]:
    """Set ``vae``'s ``shift_factor`` and ``scaling_factor`` to the mean and 1/std of its latents
    of ``images`` (SD3's normalisation); returns (shift, scale)."""
    z = torch.cat([vae.encode(chunk).latent_dist.mean for chunk in images.split(256)])
    shift, scale = float(z.mean()), float(1.0 / z.std())
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    return shift, scale


@torch.no_grad()
def latents_of(vae, images: torch.Tensor) -> torch.Tensor:
    """The transformer's latents of ``images``: (z − shift)·scale, z the posterior's mean."""
    c = vae.config
    return torch.cat([(vae.encode(chunk).latent_dist.mean - c.shift_factor) * c.scaling_factor
                      for chunk in images.split(256)])


def latent_flow_loss(model, x0: torch.Tensor, cond: dict[str, torch.Tensor], empty: dict[str, torch.Tensor],
                     generator: torch.Generator, cond_dropout: float) -> torch.Tensor:
    """Rectified flow's loss on latents ``x0`` with their encoded prompts ``cond``, a share
    ``cond_dropout`` of the rows on the empty prompt's encoding ``empty``; t logit-normal, as SD3
    trains."""
    dropped = torch.rand(len(x0), generator=generator) < cond_dropout
    cond = {k: torch.where(dropped.view(-1, *[1] * (v.dim() - 1)), empty[k].expand_as(v), v)
            for k, v in cond.items()}
    noise = torch.randn(x0.shape, generator=generator)
    t = torch.sigmoid(torch.randn(len(x0), generator=generator))
    tb = t.view(-1, 1, 1, 1)
    return ((model((1 - tb) * x0 + tb * noise, t, cond) - (noise - x0)) ** 2).mean()


def latent_flow_batches(model, known: Sequence[str], chosen: Sequence[str], latents: torch.Tensor, *,
                        batch_size: int, generator: torch.Generator,
                        cond_dropout: float) -> Callable[[], torch.Tensor]:
    """Rectified flow's loss on random mini-batches of ``latents`` (row i drawn for the prompt
    ``chosen[i]``), each prompt encoded once by the pipeline's text encoders among the sorted
    distinct ``known`` ones."""
    index = {p: i for i, p in enumerate(sorted(set(known)))}
    encoded, empty = model.encode_prompts(sorted(index)), model.encode_prompts([""])
    rows = torch.tensor([index[p] for p in chosen])

    def loss() -> torch.Tensor:
        idx = torch.randint(0, len(chosen), (batch_size,), generator=generator)
        return latent_flow_loss(model, latents[idx], {k: v[rows[idx]] for k, v in encoded.items()}, empty,
                                generator, cond_dropout)

    return loss


def sd3_warmstart(out: str | Path, train: Sequence[Example], held_out: Sequence[Example], score, cfg: Any, *,
                  pool: int = 4096, on_progress: Progress | None = None) -> WarmstartResult:
    """Build the tiny SD3 pipeline at ``out`` (the recipe's ``flow`` section: its width, depth,
    VAE steps and condition dropout; ``data.max_prompt_tokens`` its text encoders' length), train
    its VAE, warm-start its transformer under the ``warmstart`` section, and save it with
    ``warmstart.json``."""
    from tether.families.flow.evaluate import FlowEvaluator
    from tether.families.flow.model import load_flow_model
    from tether.families.flow.rollout import sampling_of
    from tether.families.flow.tiny_sd3 import build_tiny_sd3, prompt_tokens

    flow, settings, seed = cfg.flow, cfg.warmstart, cfg.run.seed
    words = scenes.WORDS[1:] if flow.init_tokens == "words" else ()
    need = prompt_tokens([s.prompt for s in scenes.all_scenes()], words)
    if need > cfg.data.max_prompt_tokens:
        raise ConfigError(
            f"data.max_prompt_tokens={cfg.data.max_prompt_tokens} is shorter than the shapes task's longest "
            f"prompt under flow.init_tokens={flow.init_tokens}: {need} tokens with CLIP's start and end, so "
            f"the built pipeline's text encoders would cut prompts short. Set data.max_prompt_tokens to at "
            f"least {need}" + (" (or flow.init_tokens=words, a token a word)" if not words else ""))
    torch.set_num_threads(cfg.train.threads)
    out = Path(out)
    build_tiny_sd3(out, seed=seed, image_size=scenes.SIZE, width=flow.init_width, depth=flow.init_depth,
                   max_prompt_tokens=cfg.data.max_prompt_tokens, vae_width=VAE_WIDTH, words=words)
    model = load_flow_model(out, cfg)
    sampling = sampling_of(cfg, model)
    vae = model.pipe.vae
    # drawn once, then sampled in mini-batches
    chosen, images = drawn_scenes(train, pool, random.Random(f"sd3-warmstart/{seed}"))
    generator = torch.Generator().manual_seed(seed)
    t0 = time.monotonic()
    vae.requires_grad_(True)
    drawn, check_images = check_scenes(seed)
    vae_error, vae_steps, vae_reward = train_vae(
        vae, images, steps=flow.init_vae_steps, generator=generator, target=flow.init_vae_reward,
        check=lambda: reconstruction_reward(vae, drawn, check_images))
    vae.requires_grad_(False)
    if vae_reward < flow.init_vae_reward:
        logging.getLogger("tether.data").warning(
            "the VAE's reconstructions of drawn scenes earn %.3f after flow.init_vae_steps=%d steps, below "
            "flow.init_vae_reward=%.3f: no image this pipeline decodes can score more, whatever the "
            "transformer learns. Raise flow.init_vae_steps (and rebuild) for a pipeline that can.",
            vae_reward, flow.init_vae_steps, flow.init_vae_reward)
    shift, scale = set_latent_scale(vae, images)
    vae_seconds = time.monotonic() - t0
    batch_loss = latent_flow_batches(model, [e.prompt for e in train], chosen, latents_of(vae, images),
                                     batch_size=settings.batch_size, generator=generator,
                                     cond_dropout=flow.init_cond_dropout)
    transformer = model.transformer
    transformer.requires_grad_(True)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=settings.lr, weight_decay=0.0)
    evaluator = FlowEvaluator(model, held_out, score, eval_steps=flow.eval_steps, sampling=sampling,
                              seed=seed, negative_prompt=flow.negative_prompt)

    def evaluate() -> dict[str, float]:
        m = evaluator(0)
        return {"pass_at_1": m["eval/pass_at_1"], "reward": m["eval/reward_mean"]}

    result = warmstart_loop(transformer, optimizer, lambda step: batch_loss(), evaluate, settings,
                            data="task shapes (drawn images, VAE latents)", on_progress=on_progress)
    transformer.requires_grad_(False)
    with saving_quietly():
        model.pipe.save_pretrained(out)
    write_record(out, result, {**asdict(settings),
                               "seed": seed, "cond_dropout": flow.init_cond_dropout, "backbone": "sd3",
                               "init_width": flow.init_width, "init_depth": flow.init_depth,
                               "init_tokens": flow.init_tokens,
                               "vae_steps": flow.init_vae_steps, "vae_reward_target": flow.init_vae_reward,
                               "vae_steps_taken": vae_steps, "vae_reward": vae_reward,
                               "vae_abs_error": vae_error,
                               "vae_seconds": vae_seconds, "latent_shift": shift, "latent_scale": scale})
    return result

