"""Draining at turn boundaries (``async.inflight_update=drain`` with ``env.switch_at=turn``): a
publication waits for the turns in flight, not for whole episodes. Each worker takes the new weights
up as soon as no turn of its own is generating, and every turn is sampled on one version. Real
worker processes, a real tiny model, an environment whose steps take their time."""

import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tether.config.config import load_config
from tether.modeling import load_causal_lm, unique_parameters
from tether.rollout.backends.local.pool import ProcessPool
from tether.rollout.settings import PoolSettings
from tether.vocabulary import Example, GenerationRequest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
ENVS = Path(__file__).with_name("envs.py")


def turn_versions(model, versions):
    """The set of versions of each model turn (run of model tokens) of one sample."""
    turns, current = [], None
    for m, v in zip([*model, 0], [*versions, -1], strict=True):
        if m:
            current = (current or set()) | {v}
        elif current is not None:
            turns.append(current)
            current = None
    return turns


def test_a_publication_waits_for_the_turns_in_flight_not_for_the_episodes(tiny_model_dir, tmp_path):
    stepped = tmp_path / "stepped"
    cfg = load_config(None, [
        "model.family=agent", "data.task=kv_lookup", f"model.path={tiny_model_dir}",
        f"env.env_class={ENVS}:SlowEcho", f"env.kwargs={{stepped: {stepped}}}", "env.max_turns=4",
        "env.max_turn_tokens=5", "rollout.max_new_tokens=5", "env.step_timeout_s=20", "rollout.group_size=4",
        "rollout.num_workers=1", "async.inflight_update=drain", "env.switch_at=turn",
    ])
    assert cfg.budget().drain_at_turns and not cfg.budget().drains
    settings = PoolSettings(cfg, str(tiny_model_dir), stop_text="\n")
    assert settings.inflight.name == "keep"  # the engines run as keep, taking weights between turns

    def batches(index):
        return [(2 * index + k, Example(prompt=f"task {k}", answer=str(k))) for k in range(2)]

    model, _ = load_causal_lm(tiny_model_dir)
    weights = unique_parameters(model)
    with ProcessPool(settings, batches, weights) as pool:
        pool.launch(GenerationRequest(index=0, version=0))
        deadline = time.monotonic() + 60
        while not stepped.exists():  # the first turn is sampled; its environment steps take 0.3 s each
            assert time.monotonic() < deadline, "no environment step began within 60 s"
            time.sleep(0.01)
        t0 = time.monotonic()
        metrics = pool.publish(weights, 1)
        waited = time.monotonic() - t0
        # it returned with the worker holding version 1 and the batch not yet collected; that it
        # waited for a turn boundary, not for the episodes to end, is what the turns' versions
        # below show (each episode's later turns ran on version 1), whatever the machine's speed
        assert pool._workers[0].held == 1
        assert pool.inflight == 1
        assert metrics["sync/turn_wait_s"] <= waited
        (batch,) = pool.wait(60)
    episodes = batch.payload
    assert batch.behavior_version == 0 and batch.newest_version == 1
    for flags, versions in zip(episodes.model, episodes.versions, strict=True):
        turns = turn_versions(flags, versions)
        assert len(turns) == 3 and all(len(t) == 1 for t in turns)  # every turn on one version
        assert turns[0] == {0} and turns[-1] == {1}
    assert batch.metrics["rollout/turn_boundary_switches"] == 1
    assert batch.metrics["rollout/weight_switches"] == 1  # none inside a turn


def test_draining_at_turns_needs_an_agent_recipe_with_switch_at_turn(tiny_model_dir):
    from tether.errors import ConfigError

    text = load_config(None, [f"model.path={tiny_model_dir}", "data.task=arithmetic"])
    assert not text.budget().drain_at_turns and text.budget().drains
    agent = load_config(None, ["model.family=agent", "data.task=kv_lookup", f"model.path={tiny_model_dir}"])
    assert agent.budget().drains  # drain with switch_at=token: whole batches, as for text
    with pytest.raises(ConfigError, match=r"switch_at=turn .* needs async\.inflight_update=drain or keep"):
        load_config(None, ["model.family=agent", "data.task=kv_lookup", f"model.path={tiny_model_dir}",
                           "async.inflight_update=abort", "env.switch_at=turn"])
