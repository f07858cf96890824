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

Coefficients-Preserving Sampling (``flow.sde_type: cps``; Wang & Yu, arXiv 2509.05952, the option
Flow-GRPO's newer upstream recommends at noise level 0.8) steps instead through the model's own
estimates of the image, x̂₀ = x_t − t·v, and of the noise, x̂₁ = x_t + (1 − t)·v:

    x_s ~ N((1 − s)·x̂₀ + s·cos(a·π/2)·x̂₁,  (s·sin(a·π/2))²·I),

so the noise in x_s keeps exactly the coefficient s the schedule gives it (cos² + sin² = 1), at
every step and every a in [0, 1], where the SDE above adds more noise than the schedule's at
coarse steps. At a = 0 it is again the Euler step; into s = 0 its noise is 0, so its last step is
the ODE's (the SDE's last step still draws noise).
"""

from __future__ import annotations

import math

import torch

from tether.errors import ConfigError

START = 1 - 1e-5
"""Times at or above this are t = 1, the start of the trajectory (float32 rounds 1 to 1 − 2.4·10⁻⁶
in a scheduler's shift arithmetic)."""
NOISE_LEVEL_MAX = 2.0
"""The largest ``a``: a step multiplies x by 1 − a²·r/2, r = |dt|/(1 − t) (``step_ratios``), and
the first step's r is 1 at any schedule; above 2 that factor leaves [−1, 1], the step expands the
noise it should shrink (by 11.5 at a = 5) and the sample blows up."""
SHIFT_RANGE = (0.1, 20.0)
"""The shifts allowed (besides 0, the model's own). Below 0.1 float32 rounding moves the schedule's
first time away from 1 (SD3's scheduler: 1.013 at 0.001, 7.5·10⁻⁵ at 10⁻⁶, NaN at 10⁻¹²); above
20 the last steps' r grows as shift/T, and at 10⁶ every float32 time is 1 (NaN)."""


def step_ratios(times: torch.Tensor) -> torch.Tensor:
    """r = |dt|/(1 − t) of each step that has an SDE term (from t > 0), 1 at the first (``START``):
    the step's mean is x·(1 − a²·r/2) + (a multiple of v), so it stays bounded while a²·r ≤ 4."""
    t, s = times[:-1].double(), times[1:].double()
    r = torch.where(t >= START, torch.ones_like(t), (t - s) / (1 - t).clamp_min(1e-300))
    return r[t > 0]


def check_sde(noise_level: float, shift: float, steps: int, *, own_shift: float = 0.0,
              sde_type: str = "sde") -> None:
    """Refuse settings whose SDE does not stay finite: ``flow.noise_level`` above
    ``NOISE_LEVEL_MAX`` (its floor, 0.01, is the knob's), ``flow.shift`` outside ``SHIFT_RANGE``, and (on the
    shift formula's times, those of the built-in model and, up to its last step, of SD3's
    scheduler) a step whose factor on x, 1 − a²·r/2, leaves [−1, 1]. ``own_shift``: the model's own
    shift, which ``flow.shift: 0`` takes (a pipeline's scheduler's; 0 for the built-in model's
    uniform times). Under ``sde_type`` cps every step stays finite (a blend of the model's own
    estimates); its a is an angle, meaningful up to 1 (the whole of the step's noise fresh)."""
    lo, hi = SHIFT_RANGE
    if sde_type == "cps" and noise_level > 1:
        raise ConfigError(f"flow.noise_level={noise_level:g} with flow.sde_type=cps is outside [0.01, 1]: a "
                          "step's fresh noise is s·sin(a·π/2), the whole of the schedule's s at a = 1, and "
                          "a larger a only repeats smaller ones; the reference uses 0.8")
    if noise_level > NOISE_LEVEL_MAX:
        raise ConfigError(f"flow.noise_level={noise_level:g} is outside the SDE's finite range [0.01, "
                          f"{NOISE_LEVEL_MAX:g}]: its first step multiplies x by 1 − a²/2 = "
                          f"{1 - noise_level ** 2 / 2:.3g}, which blows the samples up; Flow-GRPO uses 0.7")
    if shift and not lo <= shift <= hi:
        raise ConfigError(f"flow.shift={shift:g} is outside [{lo:g}, {hi:g}] (or 0, the model's own): "
                          "below, float32 rounding moves the schedule's first time away from 1; above, the "
                          "last steps' noise grows as shift/flow.steps until the times round to 1 (NaN). SD3 "
                          "uses 3")
    if sde_type == "cps":
        return
    used = shift or own_shift or 1.0
    r = float(step_ratios(timesteps(steps, shift=used)).max())
    if noise_level ** 2 * r > 4:
        factor = 1 - noise_level ** 2 * r / 2
        named = f"flow.shift={shift:g}" + (f" (the model's own, {used:g})" if not shift and own_shift else "")
        raise ConfigError(f"flow.noise_level={noise_level:g} with {named} and flow.steps="
                          f"{steps}: a step of this schedule multiplies x by 1 − a²·r/2 = {factor:.3g} (r = "
                          f"|dt|/(1 − t) = {r:.3g}), which blows the samples up; at this shift and steps the "
                          f"SDE stays finite for flow.noise_level ≤ {2 / math.sqrt(r):.3g}; lower it, lower "
                          "flow.shift or raise flow.steps")


def timesteps(steps: int, *, shift: float = 1.0) -> torch.Tensor:
    """``steps`` + 1 times from 1 to 0 (uniform, or bent towards the noise end by ``shift`` as
    SD3 does: t ↦ shift·t / (1 + (shift − 1)·t))."""
    if steps < 1:
        raise ConfigError(f"flow.steps must be >= 1, got {steps}")
    t = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return (shift * t / (1 + (shift - 1) * t)).float()


def step_coefficients(t, s, noise_level: float, sde_type: str = "sde") -> tuple[torch.Tensor, ...]:
    """The numbers of the steps from ``t`` to ``s`` < ``t`` (floats, or tensors of any one shape),
    in float64: those ``step_mean`` takes, then the step's std last. For the SDE: (σ_t²/(2t),
    1 − t, dt = s − t, the std σ_t·√|dt|), σ_t = a·√(t / (1 − t)); at t = 1, where σ_t is
    infinite, 1 − t is replaced by 1 − s, the next timestep's, as Flow-GRPO's reference does (its
    ``sigma_max``), at any shift of the schedule. A step from t = 0 has no SDE term. A time within
    float32 rounding of 1 (``START``: SD3's scheduler gives 0.9999976 at shift 0.1) is the start:
    1/(1 − t) there would be 4·10⁵. For CPS: (1 − s, t, s·cos(a·π/2), 1 − t, the std
    s·sin(a·π/2)). At a = 0 both are the ODE's Euler step; the ODE steps of a trajectory always
    take the SDE's numbers (``step_mean_std``), so they do not depend on ``sde_type``."""
    t = torch.as_tensor(t, dtype=torch.float64)
    s = torch.as_tensor(s, dtype=torch.float64)
    if sde_type == "cps":
        angle = noise_level * math.pi / 2
        return 1 - s, t, s * math.cos(angle), 1 - t, s * math.sin(angle)
    dt = s - t
    sig = noise_level * torch.sqrt(t / torch.where(t >= START, dt.abs(), 1 - t))
    coef = torch.where(t > 0, sig * sig / (2 * t), torch.zeros_like(t))
    return coef, 1 - t, dt, sig * torch.sqrt(-dt)


def gaussian_mean(x: torch.Tensor, v: torch.Tensor, coef, one_minus_t, dt) -> torch.Tensor:
    """The mean of an SDE step's Gaussian, x + [v + σ_t²/(2t)·(x + (1 − t)·v)]·dt, from
    ``step_coefficients`` (floats, or tensors that broadcast against x)."""
    return x + (v + coef * (x + one_minus_t * v)) * dt


def cps_mean(x: torch.Tensor, v: torch.Tensor, one_minus_s, t, keep, one_minus_t) -> torch.Tensor:
    """The mean of a CPS step's Gaussian, (1 − s)·x̂₀ + s·cos(a·π/2)·x̂₁ with x̂₀ = x − t·v and
    x̂₁ = x + (1 − t)·v, from ``step_coefficients`` (``keep`` = s·cos(a·π/2))."""
    return one_minus_s * (x - t * v) + keep * (x + one_minus_t * v)


def step_mean(x: torch.Tensor, v: torch.Tensor, numbers, sde_type: str = "sde") -> torch.Tensor:
    """A step's mean from ``step_coefficients``' numbers (all but its std)."""
    return cps_mean(x, v, *numbers) if sde_type == "cps" else gaussian_mean(x, v, *numbers)


def step_mean_std(x: torch.Tensor, v: torch.Tensor, t: float, s: float,
                  noise_level: float, sde_type: str = "sde") -> tuple[torch.Tensor, float]:
    """The Gaussian of one step from ``t`` to ``s``: its mean (shaped like x) and its std. With
    ``noise_level`` 0 (an ODE step) the SDE's numbers, whatever ``sde_type``."""
    kind = sde_type if noise_level > 0 else "sde"
    *numbers, std = (float(c) for c in step_coefficients(t, s, noise_level, kind))
    return step_mean(x, v, numbers, kind), std


def sde_step(x: torch.Tensor, v: torch.Tensor, t: float, s: float, noise_level: float, *,
             generator: torch.Generator | None = None,
             sde_type: str = "sde") -> tuple[torch.Tensor, torch.Tensor]:
    """Sample x_s; returns (x_s, its log-probability per sample: summed over all but dim 0)."""
    mean, std = step_mean_std(x, v, t, s, noise_level, sde_type)
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
