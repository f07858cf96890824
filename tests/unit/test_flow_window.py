"""The SDE window (``flow.sde_window``, Flow-GRPO-Fast's and MixGRPO's faster rollouts): K
consecutive SDE steps whose start the batch's seed draws, the ODE elsewhere, only the window's
steps recorded and trained; its refusals, and the planner's price of it."""

import pytest

torch = pytest.importorskip("torch")

from tether.config.config import load_config  # noqa: E402
from tether.errors import ConfigError  # noqa: E402
from tether.families.flow import scenes  # noqa: E402
from tether.families.flow.conditioning import velocity  # noqa: E402
from tether.families.flow.learn import FlowPolicy, to_flow_batch  # noqa: E402
from tether.families.flow.model import FlowModel, FlowModelConfig  # noqa: E402
from tether.families.flow.policy import FlowSampling, generate_latents  # noqa: E402
from tether.families.flow.rollout import FlowBatch, FlowEngine  # noqa: E402
from tether.families.flow.sde import step_mean_std  # noqa: E402

FLOW = ["model.family=flow", "data.task=shapes"]


def small_model(seed=0):
    torch.manual_seed(seed)
    model = FlowModel(FlowModelConfig(vocab=scenes.WORDS, width=32, depth=2, patch=4))
    with torch.no_grad():  # adaLN-Zero starts at v = 0; give every path a nonzero weight
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def test_the_window_is_drawn_from_the_batch_seed_within_its_range():
    sampling = FlowSampling(steps=8, window=2, window_range=5)
    windows = [sampling.window_steps(seed) for seed in range(400)]
    assert all(len(w) == 2 and 0 <= w.start <= 3 for w in windows)  # inside steps 0 … 4
    assert {w.start for w in windows} == {0, 1, 2, 3}  # every start drawn
    assert windows == [sampling.window_steps(seed) for seed in range(400)]  # the same seed, the same window
    assert {w.start for w in map(FlowSampling(steps=8, window=3).window_steps, range(400))} == set(range(6))
    assert FlowSampling(steps=8).window_steps(3) == range(8)  # no window: every step is an SDE step
    assert FlowSampling(steps=8, window=8).window_steps(3) == range(8)


def test_a_sliding_window_starts_at_the_first_step_and_moves_one_step_every_n_batches():
    """MixGRPO's progressive schedule: batch b starts at (b // N) mod (R − K + 1), whatever the
    seed, returning to the first step after the last start; without a batch index it is drawn."""
    sliding = FlowSampling(steps=8, window=2, window_range=5, window_slide=3)
    starts = [sliding.window_steps(seed=1000 + b, batch=b).start for b in range(15)]
    assert starts == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 0, 0, 0]  # starts 0 … 3 inside steps 0 … 4
    assert all(len(sliding.window_steps(seed=7, batch=b)) == 2 for b in range(40))
    whole = FlowSampling(steps=6, window=2, window_slide=1)  # R = 0: the whole trajectory
    assert [whole.window_steps(0, b).start for b in range(7)] == [0, 1, 2, 3, 4, 0, 1]
    drawn = FlowSampling(steps=8, window=2, window_range=5)
    assert [sliding.window_steps(s) for s in range(50)] == [drawn.window_steps(s) for s in range(50)]
    assert [drawn.window_steps(s, batch=0) for s in range(50)] == [drawn.window_steps(s) for s in range(50)]


def ode_from(model, x, cond, times, steps):
    """The deterministic ODE's steps ``steps`` from x (the evaluation sampler's Euler step)."""
    for j in steps:
        t, s = float(times[j]), float(times[j + 1])
        v = velocity(model, x, torch.full((len(x),), t), cond, None, 1.0)
        x = step_mean_std(x, v, t, s, 0.0)[0]
    return x


def test_only_the_windows_steps_are_recorded_and_the_others_are_the_odes():
    """Steps before the window are the ODE's from the seed's noise (no noise drawn), steps after it
    the ODE's from the window's last latent; the window's K steps are the recorded actions, and the
    learner's log-probs of them equal the engine's at the same weights."""
    torch.set_num_threads(1)
    model = small_model()
    sampling = FlowSampling(steps=6, noise_level=0.7, window=2, window_range=4)
    engine = FlowEngine(FlowModel(model.config), sampling)
    engine.load_weights(dict(model.named_parameters()), version=3)
    words = torch.tensor([scenes.encode(s.prompt) for s in scenes.all_scenes()[:4]]).repeat_interleave(4, 0)
    cond, times = {"words": words}, sampling.times()
    seed = next(s for s in range(50) if sampling.window_steps(s).start == 1)  # ODE before and after
    window = sampling.window_steps(seed)
    out = engine.generate(cond, seed=seed)
    assert out.first_step == 1 and out.versions == [3, 3]
    assert out.latents.shape == (16, 3, 3, 16, 16) and out.logprobs.shape == (16, 2)
    with torch.no_grad():
        noise = torch.Generator().manual_seed(seed)
        before = generate_latents(model, cond, times[: window.start + 1], generator=noise)
        assert torch.allclose(out.latents[:, 0], before, atol=1e-6)  # x at the window's start: the ODE's
        after = ode_from(model, out.latents[:, -1], cond, times, range(window.stop, sampling.steps))
        assert torch.allclose(out.final, after, atol=1e-6)  # the image: the ODE's from the window's end
        # the window's steps are stochastic: the same start, an ODE step instead, lands elsewhere
        ode_step = ode_from(model, out.latents[:, 0], cond, times, [window.start])
        assert (ode_step - out.latents[:, 1]).abs().mean() > 0.05
    batch = FlowBatch(positions=list(range(4)), prompts=["p"] * 4, cond={"words": words[::4].numpy()},
                      latents=out.latents.numpy(), logprobs=out.logprobs.numpy(),
                      versions=[out.versions] * 16, rewards=[0.0] * 16,
                      times=times[window.start:window.stop + 1].numpy(), noise_level=0.7, group_size=4,
                      first_step=out.first_step)
    batch.check()
    tb = to_flow_batch(batch)
    assert tb.steps.shape == (16, 2) and tb.behavior_logp.shape == (16, 2)  # the window's steps alone
    learner_logp = FlowPolicy().forward(model, tb)[0].detach()
    assert (learner_logp - tb.behavior_logp).abs().max() <= 1e-5
    # flow.train_steps within the window: one of its two steps per trajectory, that very step's log-prob
    one = to_flow_batch(batch, train_steps=1)
    assert torch.equal(one.behavior_logp, out.logprobs.gather(1, one.steps))


def test_a_window_over_every_step_is_full_sde_sampling():
    model = small_model()
    words = torch.tensor([scenes.encode(s.prompt) for s in scenes.all_scenes()[:2]])
    full = FlowEngine(model, FlowSampling(steps=4)).generate({"words": words}, seed=5)
    whole = FlowEngine(model, FlowSampling(steps=4, window=4)).generate({"words": words}, seed=5)
    assert torch.equal(full.latents, whole.latents) and torch.equal(full.logprobs, whole.logprobs)
    assert full.latents.shape[1] == 5 and torch.equal(full.final, full.latents[:, -1])


@pytest.mark.parametrize(("overrides", "message"), [
    (["flow.sde_window=9"], "flow.sde_window=9 exceeds the flow.steps=8 steps"),
    (["flow.sde_window_range=4"], "flow.sde_window_range=4 places an SDE window, but flow.sde_window is 0"),
    (["flow.sde_window=3", "flow.sde_window_range=2"], "set it from 3 to 8"),
    (["flow.sde_window=3", "flow.sde_window_range=9"], "set it from 3 to 8"),
    (["flow.sde_window=2", "flow.train_steps=3"],
     "flow.train_steps=3 exceeds the flow.sde_window=2 SDE steps"),
    (["flow.sde_window_slide=25"], "flow.sde_window=0 of flow.steps=8 leaves nothing to slide"),
    (["flow.sde_window=8", "flow.sde_window_slide=25"], "set flow.sde_window below flow.steps"),
])
def test_a_window_that_does_not_fit_the_trajectory_is_refused_at_load(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*FLOW, *overrides])
    assert message in str(err.value)


def test_the_planner_prices_an_update_at_the_trained_steps_share():
    from tether.loop.virtual import timings_of

    timed = [*FLOW, "flow.steps=8", "plan.train_time=8", "plan.gen_time=3", "plan.train_time_steps=8"]
    window = timings_of(load_config(None, [*timed, "flow.sde_window=2", "flow.sde_window_range=4"]))
    assert window.train_time == pytest.approx(2.0)  # K/T of the update timed over all T steps
    assert window.gen_time == 3  # generation: every step still runs, at the same cost
    assert timings_of(load_config(None, timed)).train_time == pytest.approx(8.0)
    assert timings_of(load_config(None, [*timed, "flow.sde_window=4", "flow.train_steps=1"])).train_time == 1
    # 0: train_time was timed on the recipe's own updates
    own = [*FLOW, "flow.steps=8", "plan.train_time=8", "flow.sde_window=2"]
    assert timings_of(load_config(None, own)).train_time == 8
    with pytest.raises(ConfigError, match=r"plan\.train_time_steps"):  # the flow family's key alone
        load_config(None, ["plan.train_time_steps=8"])
