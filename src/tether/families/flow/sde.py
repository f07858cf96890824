"""Flow-GRPO's sampler: a flow-matching model's ODE turned into an SDE with the same marginals,
so each denoising step is a Gaussian policy with an exact log-probability.

Rectified flow interpolates data x₀ and noise x₁ ~ N(0, I) as x_t = (1 − t)·x₀ + t·x₁ and learns
the velocity v(x_t, t) ≈ E[x₁ − x₀ | x_t]; sampling integrates dx = v dt from t = 1 to 0. Liu et
al. (Flow-GRPO, arXiv 2505.05470, §4.1) give the reverse-time SDE with the same marginal at every
t:

    dx = [v + σ_t²/(2t) · (x + (1 − t)·v)] dt + σ_t dw,    σ_t = a·√(t / (1 − t)),

``a`` the noise level. One Euler–Maruyama step from t to s < t (dt = s − t < 0) is the Gaussian

    x_s ~ N(x_t + [v + σ_t²/(2t)·(x_t + (1 − t)·v)]·dt,  σ_t²·|dt|·I),

whose log-density of the sampled x_s is the step's log-probability: the quantity the policy
ratio of Flow-GRPO compares between the sampling and the training model. With a = 0 the step
is the ODE's Euler step (deterministic sampling, used for evaluation).
"""

from __future__ import annotations

import math

import torch

from tether.errors import ConfigError


def timesteps(steps: int, *, shift: float = 1.0) -> torch.Tensor:
    """``steps`` + 1 times from 1 to 0 (uniform, or bent towards the noise end by ``shift`` as
    SD3 does: t ↦ shift·t / (1 + (shift − 1)·t))."""
    if steps < 1:
        raise ConfigError(f"flow.steps must be >= 1, got {steps}")
    t = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return (shift * t / (1 + (shift - 1) * t)).float()


def step_coefficients(t, s, noise_level: float) -> tuple[torch.Tensor, ...]:
    """The numbers of the steps from ``t`` to ``s`` < ``t`` (floats, or tensors of any one shape),
    in float64: (σ_t²/(2t), 1 − t, dt = s − t, the std σ_t·√|dt|). σ_t = a·√(t / (1 − t)); at
    t = 1, where it is infinite, 1 − t is replaced by 1 − s, the next timestep's, as Flow-GRPO's
    reference does (its ``sigma_max``), at any shift of the schedule. A step from t = 0 has no
    SDE term."""
    t = torch.as_tensor(t, dtype=torch.float64)
    dt = torch.as_tensor(s, dtype=torch.float64) - t
    sig = noise_level * torch.sqrt(t / torch.where(t >= 1, dt.abs(), 1 - t))
    coef = torch.where(t > 0, sig * sig / (2 * t), torch.zeros_like(t))
    return coef, 1 - t, dt, sig * torch.sqrt(-dt)


def gaussian_mean(x: torch.Tensor, v: torch.Tensor, coef, one_minus_t, dt) -> torch.Tensor:
    """The mean of a step's Gaussian, x + [v + σ_t²/(2t)·(x + (1 − t)·v)]·dt, from
    ``step_coefficients`` (floats, or tensors that broadcast against x)."""
    return x + (v + coef * (x + one_minus_t * v)) * dt


def step_mean_std(x: torch.Tensor, v: torch.Tensor, t: float, s: float,
                  noise_level: float) -> tuple[torch.Tensor, float]:
    """The Gaussian of one step from ``t`` to ``s``: its mean (shaped like x) and its std."""
    coef, one_minus_t, dt, std = (float(c) for c in step_coefficients(t, s, noise_level))
    return gaussian_mean(x, v, coef, one_minus_t, dt), std


def sde_step(x: torch.Tensor, v: torch.Tensor, t: float, s: float, noise_level: float, *,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample x_s; returns (x_s, its log-probability per sample: summed over all but dim 0)."""
    mean, std = step_mean_std(x, v, t, s, noise_level)
    if std == 0:
        return mean, torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
    noise = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)
    out = mean + std * noise
    return out, step_log_prob(out, mean, std)


def step_log_prob(x_next: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    """log N(x_next; mean, std²·I), summed over every dimension but the first."""
    d = x_next[0].numel()
    z = ((x_next - mean) / std).flatten(1)
    return -0.5 * (z * z).sum(1) - d * (math.log(std) + 0.5 * math.log(2 * math.pi))
