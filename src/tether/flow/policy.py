"""The flow model as a policy: sampling a trajectory, and the log-probabilities of its steps.

A sample is a trajectory x_{t_0} → x_{t_1} → … → x_{t_T} (t_0 = 1 noise, t_T = 0 the image);
step j is a Gaussian policy action (``tether.flow.sde``). Its log-probability is taken per
dimension — the Gaussian log-density averaged over the C·H·W coordinates of the image — as
Flow-GRPO's reference implementation does: the ratio of two steps is then the geometric mean of
the per-coordinate density ratios, which keeps PPO's clip range meaningful for images of any
size. Engine and learner both compute it with ``step_logprobs`` / ``sample``, so at the same
weights they agree to float rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tether.flow.sde import sde_step, step_mean_std, timesteps


@dataclass(frozen=True)
class FlowSampling:
    """How a trajectory is sampled (the ``flow`` recipe section)."""

    steps: int = 8
    """T: denoising steps of a training trajectory, each one policy action."""
    noise_level: float = 0.7
    """a in σ_t = a·√(t/(1 − t)): the SDE's exploration noise (0 = the deterministic ODE)."""
    shift: float = 1.0
    """Timestep shift towards the noise end (SD3's t ↦ s·t/(1 + (s − 1)·t)); 1 = uniform."""

    def times(self) -> torch.Tensor:
        return timesteps(self.steps, shift=self.shift)


def _per_dim(log_density: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return log_density / x[0].numel()


def step_log_density(x_next: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    """log N(x_next; mean, std²) averaged over every coordinate of each sample: (N,)."""
    z = ((x_next - mean) / std).flatten(1)
    return -0.5 * (z * z).mean(1) - math.log(std) - 0.5 * math.log(2 * math.pi)


@torch.no_grad()
def sample(model, words: torch.Tensor, settings: FlowSampling, *, generator: torch.Generator,
           poll=None) -> tuple[torch.Tensor, torch.Tensor, list[int] | None]:
    """One trajectory per row of ``words``: (latents (N, T + 1, C, H, W), step log-probs (N, T),
    and — with ``poll`` — the version each step was sampled under). ``poll()`` is called before
    every step and returns the version of the weights the model holds then."""
    cfg = model.config
    n, times = words.shape[0], settings.times()
    device = next(model.parameters()).device
    x = torch.randn((n, cfg.channels, cfg.image_size, cfg.image_size), generator=generator).to(device)
    latents, logps, versions = [x], [], [] if poll is not None else None
    for j in range(settings.steps):
        if poll is not None:
            versions.append(poll())
        t, s = float(times[j]), float(times[j + 1])
        v = model(x, torch.full((n,), t, device=device), words)
        mean, std = step_mean_std(x, v, t, s, settings.noise_level)
        noise = torch.randn(x.shape, generator=generator).to(device)
        x = mean + std * noise if std > 0 else mean
        latents.append(x)
        logps.append(step_log_density(x, mean, std) if std > 0 else torch.zeros(n, device=device))
    return torch.stack(latents, 1), torch.stack(logps, 1), versions


@torch.no_grad()
def generate_images(model, words: torch.Tensor, steps: int, *, generator: torch.Generator,
                    noise_level: float = 0.0, shift: float = 1.0) -> torch.Tensor:
    """Final images (N, C, H, W) of ``steps`` steps: the deterministic ODE by default (evaluation)."""
    cfg = model.config
    n, times = words.shape[0], timesteps(steps, shift=shift)
    device = next(model.parameters()).device
    x = torch.randn((n, cfg.channels, cfg.image_size, cfg.image_size), generator=generator).to(device)
    for j in range(steps):
        t, s = float(times[j]), float(times[j + 1])
        v = model(x, torch.full((n,), t, device=device), words)
        x, _ = sde_step(x, v, t, s, noise_level, generator=generator) if noise_level > 0 else \
            (step_mean_std(x, v, t, s, 0.0)[0], None)
    return x


def step_means(model, latents: torch.Tensor, words: torch.Tensor, times: torch.Tensor,
               noise_level: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Every step's Gaussian under ``model`` for recorded trajectories, in one forward over all
    N·T (x_{t_j}, t_j) pairs: (means (N, T, C, H, W), stds (T,))."""
    n, t_plus_1 = latents.shape[:2]
    steps = t_plus_1 - 1
    x = latents[:, :-1].reshape(n * steps, *latents.shape[2:])
    t = times[:-1].to(x.device).repeat(n)
    w = words.repeat_interleave(steps, dim=0)
    v = model(x, t, w).view(n, steps, *latents.shape[2:])
    means, stds = [], []
    for j in range(steps):
        mean, std = step_mean_std(latents[:, j], v[:, j], float(times[j]), float(times[j + 1]), noise_level)
        means.append(mean)
        stds.append(std)
    return torch.stack(means, 1), torch.tensor(stds)


def step_logprobs(model, latents: torch.Tensor, words: torch.Tensor, times: torch.Tensor,
                  noise_level: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probs (N, T) of the recorded steps under ``model``, the step means (N, T, C, H, W),
    the stds (T,)); differentiable in ``model``'s parameters."""
    means, stds = step_means(model, latents, words, times, noise_level)
    steps = means.shape[1]
    logp = torch.stack([step_log_density(latents[:, j + 1], means[:, j], float(stds[j]))
                        for j in range(steps)], 1)
    return logp, means, stds


def gaussian_kl(means: torch.Tensor, ref_means: torch.Tensor, stds: torch.Tensor) -> torch.Tensor:
    """KL(π_θ ‖ π_ref) per step, closed form for two Gaussians of the same std, averaged over the
    coordinates as the log-probs are: ‖μ_θ − μ_ref‖² / (2σ² · C·H·W), (N, T)."""
    sq = (means - ref_means).flatten(2).pow(2).mean(-1)
    return sq / (2 * stds.to(sq.device)[None] ** 2)


def gaussian_entropy(stds: torch.Tensor) -> torch.Tensor:
    """Entropy of each step's Gaussian per coordinate, (T,): log σ + ½·log(2πe)."""
    return torch.log(stds) + 0.5 * math.log(2 * math.pi * math.e)
