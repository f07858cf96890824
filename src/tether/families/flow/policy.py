"""The flow model as a policy: sampling a trajectory, and the log-probabilities of its steps.

A sample is a trajectory x_{t_0} → x_{t_1} → … → x_{t_T} (t_0 = 1 noise, t_T = 0 the image);
step j is a Gaussian policy action (``tether.families.flow.sde``). Its log-probability is taken per
dimension — the Gaussian log-density averaged over the C·H·W coordinates of the image — as
Flow-GRPO's reference implementation does: the ratio of two steps is then the geometric mean of
the per-coordinate density ratios, which keeps PPO's clip range meaningful for images of any
size. Engine and learner both compute it with ``step_logprobs`` / ``sample``, so at the same
weights they agree to float rounding.

An SDE window (``FlowSampling.window``: Flow-GRPO-Fast's, MixGRPO's) makes only K consecutive
steps of the T stochastic policy actions; the steps before and after it are the deterministic ODE
(no noise drawn, no log-probability), and a trajectory records only the window's K + 1 latents.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from tether.families.flow.conditioning import num_rows, rows, velocity
from tether.families.flow.sde import step_coefficients, step_mean, step_mean_std, timesteps

WINDOW_STREAM = 0x5DE
"""Mixed into a batch's seed to draw its SDE window's start (``FlowSampling.window_steps``)."""


@dataclass(frozen=True)
class FlowSampling:
    """How a trajectory is sampled (the ``flow`` recipe section)."""

    steps: int = 8
    """T: denoising steps of a training trajectory, each one policy action."""
    noise_level: float = 0.7
    """a in σ_t = a·√(t/(1 − t)): the SDE's exploration noise (0 = the deterministic ODE)."""
    shift: float = 1.0
    """Timestep shift towards the noise end (SD3's t ↦ s·t/(1 + (s − 1)·t)); 1 = uniform; 0 = the
    model's own (a diffusers scheduler's; 1 for the built-in model)."""
    guidance_scale: float = 1.0
    """Classifier-free guidance w (1 = none): v = v_u + w·(v_c − v_u)."""
    schedule: tuple[float, ...] = ()
    """The model's own ``steps`` + 1 times (a diffusers scheduler's sigmas); empty: ``timesteps``."""
    window: int = 0
    """K: the SDE steps of a trajectory, consecutive; the others are the ODE's. 0 = all T."""
    window_range: int = 0
    """R: the window lies within steps 0 … R − 1 (its start drawn from 0 … R − K); 0 = T."""
    window_slide: int = 0
    """N > 0: batch b's window starts at (b // N) mod (R − K + 1) instead of a drawn start."""
    sde_type: str = "sde"
    """The SDE steps' rule: ``sde`` (Flow-GRPO's) or ``cps`` (Coefficients-Preserving Sampling)."""
    same_latent: bool = False
    """A group's trajectories start from one initial noise (``sample``'s ``group``)."""

    def times(self) -> torch.Tensor:
        if self.schedule:
            return torch.tensor(self.schedule, dtype=torch.float32)
        return timesteps(self.steps, shift=self.shift or 1.0)

    def window_steps(self, seed: int, batch: int | None = None) -> range:
        """The SDE steps of rollout batch ``batch`` sampled with ``seed``: all T without a window;
        else K consecutive ones, the start drawn uniformly from 0 … R − K by ``seed`` (a stream of
        its own, apart from the noise's), or with ``window_slide`` N the batch's place in the slide,
        (batch // N) mod (R − K + 1); either way a resumed run samples the same window for the same
        batch. Without ``batch`` (none is known) the start is drawn."""
        k = self.window
        if k <= 0 or k >= self.steps:
            return range(self.steps)
        starts = (self.window_range or self.steps) - k + 1
        if self.window_slide > 0 and batch is not None:
            start = (batch // self.window_slide) % starts
        else:
            start = int(np.random.default_rng((seed % 2 ** 63, WINDOW_STREAM)).integers(0, starts))
        return range(start, start + k)

    @property
    def guided(self) -> bool:
        return self.guidance_scale != 1.0


def _per_dim(log_density: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return log_density / x[0].numel()


def step_log_density(x_next: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    """log N(x_next; mean, std²) averaged over every coordinate of each sample: (N,)."""
    z = ((x_next - mean) / std).flatten(1)
    return -0.5 * (z * z).mean(1) - math.log(std) - 0.5 * math.log(2 * math.pi)


def _noise(model, n: int, generator: torch.Generator, device) -> torch.Tensor:
    return torch.randn((n, *model.latent_shape), generator=generator).to(device)


@dataclass(frozen=True)
class Trajectories:
    """N sampled trajectories as a batch records them: the window's steps, and the final image."""

    latents: torch.Tensor
    """(N, K + 1, C, H, W): x at the window's K + 1 times (all T + 1 without a window)."""
    logprobs: torch.Tensor
    """(N, K): each window step's log-probability per coordinate under the sampling weights."""
    versions: list[int] | None
    """(K,) the version each window step was sampled under (with ``poll``), or None."""
    first_step: int
    """The window's first step: latents[:, i] is x at time index ``first_step`` + i."""
    final: torch.Tensor
    """(N, C, H, W): x at t = 0, the image's latent (the window's last latent when it ends at T)."""


@torch.no_grad()
def sample(model, cond: dict[str, torch.Tensor], settings: FlowSampling, *, generator: torch.Generator,
           negative: dict[str, torch.Tensor] | None = None, poll=None,
           window: range | None = None, group: int = 1) -> Trajectories:
    """One trajectory per row of ``cond`` (the prompts' conditioning; ``negative``: the
    unconditional prompt's, for guidance): SDE steps in ``window`` (default all T), each with its
    log-probability, the deterministic ODE step (no noise drawn) elsewhere. ``poll(j)`` is called
    before every step j and returns the version of the weights the model holds for it (an engine
    that takes up weights between steps puts them in place there); the window's steps record it.
    With ``settings.same_latent`` each run of ``group`` consecutive rows (a prompt's group) starts
    from one initial noise; the ODE steps before the window, the same for the whole group, are
    then computed once a group."""
    n, times = num_rows(cond), settings.times()
    window = range(settings.steps) if window is None else window
    assert 0 <= window.start < window.stop <= settings.steps, window
    device = next(model.parameters()).device
    together = settings.same_latent and group > 1  # one row a group until the window parts them
    if together:
        assert n % group == 0, (n, group)
        x = _noise(model, n // group, generator, device)
        group_cond = rows(cond, torch.arange(0, n, group))
    else:
        x = _noise(model, n, generator, device)
    latents, logps, versions = [], [], [] if poll is not None else None
    for j in range(settings.steps):
        sde = j in window
        version = poll(j) if poll is not None else None
        if sde and versions is not None:
            versions.append(version)
        if j == window.start:
            if together:
                x, together = x.repeat_interleave(group, 0), False
            latents.append(x)
        t, s = float(times[j]), float(times[j + 1])
        v = velocity(model, x, torch.full((len(x),), t, device=device), group_cond if together else cond,
                     negative, settings.guidance_scale)
        mean, std = step_mean_std(x, v, t, s, settings.noise_level if sde else 0.0, settings.sde_type)
        if not sde:  # the ODE's Euler step
            x = mean
            continue
        noise = torch.randn(x.shape, generator=generator).to(device)
        x = mean + std * noise if std > 0 else mean
        latents.append(x)
        logps.append(step_log_density(x, mean, std) if std > 0 else torch.zeros(n, device=device))
    return Trajectories(torch.stack(latents, 1), torch.stack(logps, 1), versions, window.start, x)


@torch.no_grad()
def generate_latents(model, cond: dict[str, torch.Tensor], times: torch.Tensor, *, generator: torch.Generator,
                     negative: dict[str, torch.Tensor] | None = None, guidance: float = 1.0) -> torch.Tensor:
    """Final latents (N, C, H, W) of the deterministic ODE over ``times`` (evaluation)."""
    n = num_rows(cond)
    device = next(model.parameters()).device
    x = _noise(model, n, generator, device)
    for j in range(len(times) - 1):
        t, s = float(times[j]), float(times[j + 1])
        v = velocity(model, x, torch.full((n,), t, device=device), cond, negative, guidance)
        x = step_mean_std(x, v, t, s, 0.0)[0]
    return x


def step_gaussians(model, x: torch.Tensor, t: torch.Tensor, s: torch.Tensor, cond: dict[str, torch.Tensor],
                   noise_level: float, negative: dict[str, torch.Tensor] | None = None,
                   guidance: float = 1.0, *, detach_uncond: bool = False,
                   sde_type: str = "sde") -> tuple[torch.Tensor, torch.Tensor]:
    """The Gaussians of K recorded steps of each of N trajectories, in one forward over all N·K
    (x_t, t) pairs: x (N, K, C, H, W) the steps' starting points, t and s (N, K) their times
    (each step from t to s < t; any steps, in any order), ``cond`` each trajectory's prompt
    conditioning (N rows; guided by ``negative`` at ``guidance``, ``detach_uncond`` as
    ``conditioning.velocity``; ``sde_type`` the steps' rule, ``FlowSampling.sde_type``). Returns
    (means (N, K, C, H, W), stds (N, K)). The coefficients are computed in float64 and rounded
    once, as the engine's Python-float step (``sde.step_mean_std``) does, so both give the same
    float32 numbers."""
    n, k = t.shape
    shape = (n, k) + (1,) * (x.dim() - 2)
    *numbers, std = step_coefficients(t.double(), s.double(), noise_level, sde_type)
    numbers = [c.float().view(shape).to(x.device) for c in numbers]
    per_step = {key: value.repeat_interleave(k, dim=0) for key, value in cond.items()}
    v = velocity(model, x.flatten(0, 1), t.flatten().to(x.device), per_step, negative, guidance,
                 detach_uncond=detach_uncond).view_as(x)
    return step_mean(x, v, numbers, sde_type), std.float().to(x.device)


def _steps_or_all(latents: torch.Tensor, steps: torch.Tensor | None) -> torch.Tensor:
    """``steps``, or every step of each of the recorded trajectories: (N, T) indices."""
    if steps is not None:
        return steps
    n, t_plus_1 = latents.shape[:2]
    return torch.arange(t_plus_1 - 1, device=latents.device).expand(n, -1)


def step_means(model, latents: torch.Tensor, cond: dict[str, torch.Tensor], times: torch.Tensor,
               noise_level: float, steps: torch.Tensor | None = None, *,
               negative: dict[str, torch.Tensor] | None = None,
               guidance: float = 1.0, detach_uncond: bool = False,
               sde_type: str = "sde") -> tuple[torch.Tensor, torch.Tensor]:
    """The Gaussians of recorded trajectories' steps under ``model``: every step, or with
    ``steps`` ((N, K) indices into 0 … T − 1) those of each trajectory. Returns (means
    (N, K, C, H, W), stds (N, K))."""
    steps = _steps_or_all(latents, steps)
    rows = torch.arange(len(latents), device=latents.device)[:, None]
    times = times.to(steps.device)
    return step_gaussians(model, latents[rows, steps], times[steps], times[steps + 1], cond, noise_level,
                          negative, guidance, detach_uncond=detach_uncond, sde_type=sde_type)


def step_logprobs(model, latents: torch.Tensor, cond: dict[str, torch.Tensor], times: torch.Tensor,
                  noise_level: float, steps: torch.Tensor | None = None, *,
                  negative: dict[str, torch.Tensor] | None = None, guidance: float = 1.0,
                  detach_uncond: bool = False,
                  sde_type: str = "sde") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probs (N, K) of the recorded steps under ``model``, the step means (N, K, C, H, W),
    the stds (N, K)); every step (K = T), or the ``steps`` of each trajectory. Differentiable in
    ``model``'s parameters."""
    steps = _steps_or_all(latents, steps)
    means, stds = step_means(model, latents, cond, times, noise_level, steps, negative=negative,
                             guidance=guidance, detach_uncond=detach_uncond, sde_type=sde_type)
    n, k = stds.shape
    x_next = latents[torch.arange(n, device=latents.device)[:, None], steps + 1]
    z = ((x_next - means) / stds.view(n, k, *[1] * (means.dim() - 2))).flatten(2)
    logp = -0.5 * (z * z).mean(2) - torch.log(stds) - 0.5 * math.log(2 * math.pi)
    return logp, means, stds


def gaussian_kl(means: torch.Tensor, ref_means: torch.Tensor, stds: torch.Tensor) -> torch.Tensor:
    """KL(π_θ ‖ π_ref) per step, closed form for two Gaussians of the same std, averaged over the
    coordinates as the log-probs are: ‖μ_θ − μ_ref‖² / (2σ² · C·H·W), (N, K); ``stds`` (N, K),
    or (K,) shared by every row."""
    sq = (means - ref_means).flatten(2).pow(2).mean(-1)
    return sq / (2 * stds.to(sq.device).expand_as(sq) ** 2)


def gaussian_entropy(stds: torch.Tensor) -> torch.Tensor:
    """Entropy of each step's Gaussian per coordinate, shaped like ``stds``: log σ + ½·log(2πe)."""
    return torch.log(stds) + 0.5 * math.log(2 * math.pi * math.e)
