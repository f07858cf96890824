"""Flow-GRPO's SDE sampler against a model whose answer is known in closed form."""

import itertools
import math

import numpy as np
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


# -- bounds: where the SDE stays finite -----------------------------------------------------------

def sampled_size(noise_level: float, times: torch.Tensor, n: int = 256) -> float:
    """The largest |x| after sampling from noise over ``times`` with the exact velocity of data
    N(0, 0.5²): a sound schedule ends near the data (|x| ≲ 2.5), a blown one far from it."""
    v = gaussian_velocity(0.0, 0.5)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 48, generator=gen, dtype=torch.float64)
    for t, s in itertools.pairwise(times.tolist()):
        x = sde_step(x, v(x, t), t, s, noise_level, generator=gen)[0]
    return float(x.abs().max())


def test_the_bounds_hold_the_sde_finite_and_outside_them_it_blows_up():
    from tether.families.flow.sde import NOISE_LEVEL_MAX, SHIFT_RANGE, step_ratios

    uniform = timesteps(8)
    assert sampled_size(0.7, uniform) < 3 and sampled_size(NOISE_LEVEL_MAX, uniform) < 3
    assert sampled_size(5.0, uniform) > 1e3            # the 5: the first step's factor is −11.5
    for shift in SHIFT_RANGE:  # at either end, at the noise level the load check allows
        times = timesteps(8, shift=shift)
        a = min(0.7, 2 / math.sqrt(float(step_ratios(times).max())))
        assert sampled_size(a, times) < 10, shift
    from tether.families.flow.sde import START

    assert (timesteps(8, shift=1e6)[:-1] >= START).all()  # every time but the last rounds to 1: one step
    shifted = timesteps(8, shift=3)
    assert float(step_ratios(shifted).max()) == pytest.approx(1.2, abs=0.01)  # a ≤ 2/√1.2 = 1.83 at shift 3


def test_a_first_time_rounded_below_one_is_the_start():
    """SD3's scheduler at shift 0.1 gives a first sigma of 0.9999976 (float32 rounding): taken at
    face value, 1/(1 − t) = 4·10⁵ would blow the first step up."""
    times = timesteps(8, shift=0.1)
    rounded = times.clone()
    rounded[0] = 0.9999976
    x, v = torch.randn(4, 3), torch.randn(4, 3)
    assert step_mean_std(x, v, float(rounded[0]), float(rounded[1]), 0.7)[1] == pytest.approx(
        step_mean_std(x, v, 1.0, float(rounded[1]), 0.7)[1], rel=1e-4)
    assert sampled_size(0.7, rounded) < 3


@pytest.mark.parametrize(("overrides", "message"), [
    (["flow.noise_level=5"], "flow.noise_level=5 is outside the SDE's finite range [0.01, 2]"),
    (["flow.noise_level=2.01"], "flow.noise_level=2.01 is outside the SDE's finite range [0.01, 2]"),
    (["flow.noise_level=0.001"], "flow.noise_level must be >= 0.01 (allowed: 0.01–2;"),
    (["flow.shift=-1"], "flow.shift must be >= 0 (allowed: 0, the model's own, or 0.1–20)"),
    (["flow.shift=1e6"], "flow.shift=1e+06 is outside [0.1, 20] (or 0, the model's own)"),
    (["flow.shift=1e-12"], "flow.shift=1e-12 is outside [0.1, 20] (or 0, the model's own)"),
    (["flow.shift=3", "flow.noise_level=2"], "the SDE stays finite for flow.noise_level ≤ 1.83"),
])
def test_noise_level_and_shift_outside_the_finite_range_are_refused_at_load(overrides, message):
    from tether.config.config import load_config
    from tether.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.family=flow", "data.task=shapes", *overrides])
    assert message in str(err.value)


def test_at_shift_0_the_bound_is_the_models_own_shifts():
    """flow.shift: 0 takes the model's own schedule: a pipeline's scheduler shift (SD3's 3)
    lowers the largest noise level as flow.shift=3 would, and the refusal says whose shift it was."""
    from tether.errors import ConfigError
    from tether.families.flow.sde import check_sde

    check_sde(1.9, 0.0, 8)  # the built-in model's uniform times
    with pytest.raises(ConfigError, match=r"flow.shift=0 \(the model's own, 3\) .* flow.noise_level ≤ 1.83"):
        check_sde(1.9, 0.0, 8, own_shift=3.0)
    check_sde(1.8, 0.0, 8, own_shift=3.0)


def test_settings_at_the_bounds_load():
    from tether.config.config import load_config

    for overrides in (["flow.noise_level=2"], ["flow.shift=0.1"], ["flow.shift=20", "flow.noise_level=0.7"],
                      ["flow.shift=3", "flow.noise_level=1.8"]):
        load_config(None, ["model.family=flow", "data.task=shapes", *overrides])


def test_a_non_finite_engine_step_names_the_settings_that_produce_it():
    """Past the load check (a recipe read before it, or a model that produces it), the engine's
    batch is refused naming the step and flow.noise_level, flow.shift, flow.steps, guidance."""
    from tether.errors import RolloutError
    from tether.families.flow import scenes
    from tether.families.flow.model import FlowModel, FlowModelConfig
    from tether.families.flow.policy import FlowSampling
    from tether.families.flow.rollout import FlowEngine, check_finite

    torch.manual_seed(0)
    model = FlowModel(FlowModelConfig(vocab=scenes.WORDS, width=32, depth=2, patch=4))
    sampling = FlowSampling(steps=8, noise_level=1e6, shift=1.0)
    engine = FlowEngine(model, sampling)
    cond = model.encode_prompts(["one red square left"] * 2)
    out = engine.generate(cond, seed=0)
    latents, logps = out.latents, out.logprobs
    assert not torch.isfinite(latents).all()
    with pytest.raises(RolloutError) as err:
        check_finite(out, sampling)
    text = str(err.value)
    for words in ("non-finite values at step", "flow.noise_level=1e+06", "flow.shift=1", "flow.steps=8",
                  "flow.guidance_scale=1"):
        assert words in text, text
    # the learner's own guard on a batch's log-probs names them too
    from tether.families.flow.learn import to_flow_batch
    from tether.families.flow.rollout import FlowBatch

    batch = FlowBatch(positions=[0], prompts=["p"], cond={"words": cond["words"][:1].numpy()},
                      latents=latents.numpy(), logprobs=np.full(tuple(logps.shape), np.nan, np.float32),
                      versions=[[0] * 8] * 2, rewards=[0.0] * 2, times=sampling.times().numpy(),
                      noise_level=1e6, group_size=2)
    with pytest.raises(RolloutError, match=r"flow.noise_level=1e\+06, flow.guidance_scale=1"):
        to_flow_batch(batch)


# -- Coefficients-Preserving Sampling (flow.sde_type: cps) ------------------------------------------

def reference_cps_step(x: torch.Tensor, v: torch.Tensor, sigma: float, nxt: float, noise_level: float):
    """CPS as its paper (Wang & Yu, arXiv 2509.05952) and Flow-GRPO's newer upstream write it:
    std = σ_next·sin(a·π/2), x̂₀ = x − σ·v, x̂₁ = x + (1 − σ)·v,
    mean = x̂₀·(1 − σ_next) + x̂₁·√(σ_next² − std²)."""
    std = nxt * math.sin(noise_level * math.pi / 2)
    mean = (x - sigma * v) * (1 - nxt) + (x + (1 - sigma) * v) * math.sqrt(nxt * nxt - std * std)
    return mean, std


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_every_cps_steps_mean_and_std_equal_the_papers(shift):
    torch.manual_seed(0)
    sigmas = timesteps(8, shift=shift).double().tolist()
    x, v = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    for j in range(8):
        mean, std = step_mean_std(x, v, sigmas[j], sigmas[j + 1], 0.8, "cps")
        ref_mean, ref_std = reference_cps_step(x, v, sigmas[j], sigmas[j + 1], 0.8)
        assert std == pytest.approx(ref_std, abs=1e-12), j
        assert torch.allclose(mean, ref_mean, atol=1e-12), j
    # into t = 0 it has no noise and is the ODE's Euler step; at a → 0 every step is
    last_mean, last_std = step_mean_std(x, v, sigmas[-2], 0.0, 0.8, "cps")
    assert last_std == 0 and torch.allclose(last_mean, x - sigmas[-2] * v)
    for j in range(8):
        mean, std = step_mean_std(x, v, sigmas[j], sigmas[j + 1], 1e-9, "cps")
        assert torch.allclose(mean, x + (sigmas[j + 1] - sigmas[j]) * v, atol=1e-8)


def test_cps_keeps_the_schedules_noise_coefficient_where_the_sde_adds_more():
    """With one data point m, x_t = (1 − t)·m + t·ε and the exact velocity gives back m and ε from
    x_t: the noise in x_t must stay exactly t·ε. CPS keeps it after every step of a coarse 4-step
    schedule; Flow-GRPO's SDE at a = 0.7, whose Euler–Maruyama steps are exact only as dt → 0,
    leaves more (s² + a²·dt²/(1 − t) + … in variance), and noise in the final image."""
    m = 1.5
    v = gaussian_velocity(m, 0.0)
    times = timesteps(4, shift=3.0).double().tolist()

    def noise_left(sde_type: str, a: float) -> list[float]:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(100000, 1, dtype=torch.float64, generator=gen)
        errors = []
        for t, t_next in itertools.pairwise(times):
            x = sde_step(x, v(x, t), t, t_next, a, generator=gen, sde_type=sde_type)[0]
            assert x.mean().item() == pytest.approx((1 - t_next) * m, abs=0.01)
            errors.append(abs(x.std().item() - t_next))
        return errors

    assert max(noise_left("cps", 0.8)) < 0.01
    assert max(noise_left("cps", 1.0)) < 0.01           # every step's noise drawn fresh
    sde = noise_left("sde", 0.7)
    assert max(sde) > 0.3 and sde[-1] > 0.3            # noise the schedule does not have, to the end


def test_a_cps_steps_log_probability_is_its_gaussians_density():
    x = torch.randn(3, 2, 4, 4)
    v = torch.randn_like(x)
    mean, std = step_mean_std(x, v, 0.6, 0.5, 0.8, "cps")
    out, logp = sde_step(x, v, 0.6, 0.5, 0.8, generator=torch.Generator().manual_seed(1), sde_type="cps")
    assert std == pytest.approx(0.5 * math.sin(0.4 * math.pi))
    expected = torch.distributions.Normal(mean, std).log_prob(out).flatten(1).sum(1)
    assert torch.allclose(logp, expected, atol=1e-3)


@pytest.mark.parametrize(("overrides", "message"), [
    (["flow.noise_level=1.2"], "flow.noise_level=1.2 with flow.sde_type=cps is outside [0.01, 1]"),
    ([], "every step is an SDE step (flow.sde_window=0): keep the window off it"),
    (["flow.sde_window=2"], "the flow.sde_window of 2 can reach it"),
    (["flow.sde_window=2", "flow.sde_window_range=8"], "flow.sde_window_range=7 (or less)"),
])
def test_cps_settings_it_cannot_sample_are_refused_at_load(overrides, message):
    from tether.config.config import load_config
    from tether.errors import ConfigError

    cps = ["model.family=flow", "data.task=shapes", "flow.sde_type=cps"]
    with pytest.raises(ConfigError) as err:
        load_config(None, [*cps, "flow.noise_level=0.8", *overrides])
    assert message in str(err.value)
    cfg = load_config(None, [*cps, "flow.noise_level=1", "flow.sde_window=2", "flow.sde_window_range=4"])
    assert cfg.flow.sde_type == "cps"
