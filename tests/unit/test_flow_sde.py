"""Flow-GRPO's SDE sampler against a model whose answer is known in closed form."""

import itertools
import math

import pytest
import torch

from tether.families.flow.sde import sde_step, step_log_prob, step_mean_std, timesteps


def gaussian_velocity(m: float, s: float):
    """The exact rectified-flow velocity for data x₀ ~ N(m, s²) (per coordinate): x_t = (1−t)x₀ + t·ε
    is jointly Gaussian with x₀ and ε, so E[ε − x₀ | x_t] is linear in x_t."""
    def v(x: torch.Tensor, t: float) -> torch.Tensor:
        var = (1 - t) ** 2 * s * s + t * t
        mean = (1 - t) * m
        cov_eps = t            # Cov(ε, x_t)
        cov_x0 = (1 - t) * s * s  # Cov(x₀, x_t)
        e_eps = (cov_eps / var) * (x - mean)
        e_x0 = m + (cov_x0 / var) * (x - mean)
        return e_eps - e_x0
    return v


@pytest.mark.parametrize("noise_level", [0.0, 0.7])
def test_the_sde_keeps_the_odes_marginals(noise_level):
    """From pure noise, 100 steps of either sampler end at the data distribution N(m, s²): the
    drift correction σ²/(2t)·(x + (1−t)v) is what keeps the noisy one there (without it the final
    spread is wrong)."""
    m, s = 1.5, 0.4
    v = gaussian_velocity(m, s)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20000, 1, dtype=torch.float64, generator=gen)
    ts = timesteps(100).double().tolist()
    for t, t_next in itertools.pairwise(ts):
        x, _ = sde_step(x, v(x, t), t, t_next, noise_level, generator=gen)
    assert x.mean().item() == pytest.approx(m, abs=0.02)
    assert x.std().item() == pytest.approx(s, rel=0.05)


def test_without_the_drift_correction_the_marginals_drift():
    """The test above can fail: the same noise without the correction ends far from N(m, s²)."""
    m, s, a = 1.5, 0.4, 0.7
    v = gaussian_velocity(m, s)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20000, 1, dtype=torch.float64, generator=gen)
    ts = timesteps(100).double().tolist()
    for t, t_next in itertools.pairwise(ts):
        _, std = step_mean_std(x, v(x, t), t, t_next, a)
        x = x + v(x, t) * (t_next - t) + std * torch.randn(x.shape, dtype=x.dtype, generator=gen)
    assert abs(x.std().item() - s) > 0.1


def test_a_steps_log_probability_is_its_gaussians_density():
    x = torch.randn(3, 2, 4, 4)
    v = torch.randn_like(x)
    mean, std = step_mean_std(x, v, 0.6, 0.5, 0.7)
    gen = torch.Generator().manual_seed(1)
    out, logp = sde_step(x, v, 0.6, 0.5, 0.7, generator=gen)
    expected = torch.distributions.Normal(mean, std).log_prob(out).flatten(1).sum(1)
    assert torch.allclose(logp, expected, atol=1e-3)
    assert torch.allclose(step_log_prob(out, mean, std), logp)
    assert std == pytest.approx(0.7 * math.sqrt(0.6 / 0.4) * math.sqrt(0.1))


def reference_step(x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, j: int, noise_level: float):
    """One step of Flow-GRPO's reference sampler as its paper and code state it, written out:
    std_dev_t = a·√(σ / (1 − σ)), with σ = 1 replaced by the schedule's second sigma (sigma_max);
    mean = x·(1 + std_dev_t²/(2σ)·dt) + v·(1 + std_dev_t²·(1 − σ)/(2σ))·dt; std = std_dev_t·√(−dt)."""
    sigma, nxt = float(sigmas[j]), float(sigmas[j + 1])
    dt = nxt - sigma
    sigma_max = float(sigmas[1])
    std_dev_t = math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) * noise_level
    c = std_dev_t ** 2 / (2 * sigma)
    mean = x * (1 + c * dt) + v * (1 + c * (1 - sigma)) * dt
    return mean, std_dev_t * math.sqrt(-dt)


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_every_steps_mean_and_std_equal_the_references_at_any_shift(shift):
    torch.manual_seed(0)
    sigmas = timesteps(8, shift=shift).double()
    x, v = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    for j in range(7):  # the last step, to t = 0, is the same Euler step in both
        mean, std = step_mean_std(x, v, float(sigmas[j]), float(sigmas[j + 1]), 0.7)
        ref_mean, ref_std = reference_step(x, v, sigmas, j, 0.7)
        assert std == pytest.approx(ref_std, abs=1e-6), j
        assert torch.allclose(mean, ref_mean, atol=1e-6), j
    if shift == 3.0:  # the step the old guard max(1 − t, |dt|) got wrong: 0.684 against 0.749
        std = step_mean_std(x, v, float(sigmas[1]), float(sigmas[2]), 0.7)[1]
        assert std == pytest.approx(0.749, abs=1e-3)
