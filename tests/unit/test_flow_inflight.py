"""In-flight weight updates for the flow family (async.inflight_update keep / recompute / abort): the engine
takes up newer weights between two denoising steps. Checked against the learner's step
log-probabilities under each version's weights, computed independently from the recorded
trajectories: every step's recorded log-prob is that of the version stamped on it."""

import pytest

torch = pytest.importorskip("torch")

from test_flow_policy import small_model  # noqa: E402

from tether.control.inflight import MODES  # noqa: E402
from tether.families.flow import scenes  # noqa: E402
from tether.families.flow.model import FlowModel  # noqa: E402
from tether.families.flow.policy import FlowSampling, step_logprobs  # noqa: E402
from tether.families.flow.rollout import FlowEngine  # noqa: E402

STEPS = 4
SAMPLING = FlowSampling(steps=STEPS, noise_level=0.7)


def engine_switching_at(mode: str, step: int):
    """An engine on weights A (version 0) that, watched in ``mode``, is handed weights B
    (version 1) when it asks before denoising step ``step``; (engine, A, B)."""
    a, b = small_model(0), small_model(1)
    engine = FlowEngine(FlowModel(a.config), SAMPLING)
    engine.load_weights(dict(a.named_parameters()), version=0)
    asked = []

    def poll():
        asked.append(len(asked) + 1)  # asked before steps 1, 2, … in turn
        if len(asked) == step:
            engine.load_weights(dict(b.named_parameters()), version=1)
            return 1
        return None

    engine.watch(poll, MODES[mode])
    return engine, a, b


def words():
    ids = torch.tensor([scenes.encode(s.prompt) for s in scenes.all_scenes()[:3]])
    return {"words": ids.repeat_interleave(2, 0)}


def logprobs_under(model, out, cond):
    with torch.no_grad():
        return step_logprobs(model, out.latents, cond, SAMPLING.times(), SAMPLING.noise_level)[0]


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_keep_goes_on_with_the_new_weights_and_stamps_each_step_with_its_version(mode):
    """recompute is keep here: with no cache an older version computed, each step after the switch
    is already wholly the new weights'."""
    torch.set_num_threads(1)
    engine, a, b = engine_switching_at(mode, 2)
    cond = words()
    out = engine.generate(cond, seed=7)
    assert out.versions == [0, 0, 1, 1]
    assert engine.take_counts() == (0, 1)  # nothing wasted, one switch
    under_a, under_b = logprobs_under(a, out, cond), logprobs_under(b, out, cond)
    torch.testing.assert_close(out.logprobs[:, :2], under_a[:, :2], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.logprobs[:, 2:], under_b[:, 2:], rtol=0, atol=1e-5)
    assert (under_a[:, 2:] - out.logprobs[:, 2:]).abs().max() > 1e-3  # the two versions differ there
    # the first two steps are those an unwatched engine on A takes from the same seed
    plain = FlowEngine(FlowModel(a.config), SAMPLING)
    plain.load_weights(dict(a.named_parameters()), version=0)
    before = plain.generate(cond, seed=7).latents[:, :3]
    torch.testing.assert_close(before, out.latents[:, :3], rtol=0, atol=0)


def test_abort_starts_the_trajectories_again_under_the_new_weights_and_counts_the_waste():
    torch.set_num_threads(1)
    engine, _a, b = engine_switching_at("abort", 3)
    cond = words()
    out = engine.generate(cond, seed=7)
    assert out.versions == [1] * STEPS  # no trajectory spans two versions
    assert engine.take_counts() == (3 * 6, 1)  # three steps of each of the 6 trajectories thrown away
    torch.testing.assert_close(out.logprobs, logprobs_under(b, out, cond), rtol=0, atol=1e-5)


def test_tether_plan_models_a_flow_trajectory_as_flow_steps_steps():
    """The planner's per-sequence model takes every trajectory at flow.steps steps: abort wastes the
    steps before a switch, keep none; plan.mean_length (a text completion's) is refused for flow."""
    from tether.config import load_config
    from tether.errors import ConfigError
    from tether.loop import simulate, summarize
    from tether.loop.virtual import timings_of

    base = ["model.family=flow", "data.task=shapes", "flow.steps=8", "async.max_staleness=2",
            "async.max_inflight=2", "plan.gen_time=1.0", "plan.train_time=0.4", "train.num_batches=30"]
    wasted = {}
    for mode in ("keep", "abort"):
        cfg = load_config(None, [*base, f"async.inflight_update={mode}"])
        timings = timings_of(cfg)
        assert (timings.mean_length, timings.max_length) == (8.0, 8)
        sim = simulate(cfg.budget(), timings, num_groups=cfg.rollout.batch_size,
                       group_size=cfg.rollout.group_size, anchor=cfg.train.anchor)
        wasted[mode] = summarize(sim)["wasted_tokens_per_batch"]
    assert wasted["keep"] == 0 < wasted["abort"]
    with pytest.raises(ConfigError, match=r"plan\.mean_length and plan\.prefill_cost model text"):
        load_config(None, [*base, "plan.mean_length=5"])
