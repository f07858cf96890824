"""Contract tests: every implementation of a seam passes the same checks.

- every rollout pool (the fake, and each backend's: local processes, Ray actors, and a plug-in's —
  tests/plugins/thread_backend.py's threads), built as a run builds it: launches at the held
  version only, counts what is in flight, returns each batch once, refuses to publish over running
  work, and generates under what it last published;
- every learner layout (one process, local ranks, Ray actors), as assembled for a run: trains,
  exports the model's weights, saves and loads them exactly, evaluates;
- every policy family (text, flow, agent, and a plug-in's): its declarations are well formed, its
  sampler's payload is whole, and its learner scores the sampled actions as its engine did;
- every token engine (the built-in one and a plug-in's — tests/plugins/hf_engine.py; vLLM's in
  tests/vllm_cpu), built as a worker builds it: the same seed gives the same tokens, per-token
  log-probs of the distribution sampled (the model's own, recomputed here) and versions, and the
  figures a batch logs.
"""

import dataclasses
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tether import registry  # noqa: E402
from tether.config import load_config  # noqa: E402
from tether.config.features import FEATURE_NAMES  # noqa: E402
from tether.control.inflight import inflight_mode  # noqa: E402
from tether.data.stream import PromptStream  # noqa: E402
from tether.errors import ConfigError, TetherError  # noqa: E402
from tether.modeling import unique_parameters  # noqa: E402
from tether.vocabulary import Family, GenerationRequest, WorkItem  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
PLUGIN = PLUGINS / "bandit.py"
ENGINE_PLUGIN, BACKEND_PLUGIN = PLUGINS / "hf_engine.py", PLUGINS / "thread_backend.py"
B, G = 2, 4
STREAM = PromptStream(registry.tasks.get("arithmetic").examples("train", 100, seed=0), batch_size=B)


# -- families -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bandit_plugin():
    """The test suite's own family, loaded as a recipe loads it, and unloaded after."""
    yield load_config(None, [f"run.plugins=[{PLUGIN}]", "model.family=bandit", "data.task=arms"])
    for reg, name in ((registry.families, "bandit"), (registry.tasks, "arms")):
        reg.unregister(name)
    sys.modules.pop(registry.plugin_module_name(PLUGIN), None)
    registry._loaded_plugins.pop(str(PLUGIN), None)


@pytest.fixture(scope="module")
def runner_plugins():
    """The test suite's own engine and backend, loaded as a recipe loads them, and unloaded after."""
    plugins = f"run.plugins=[{ENGINE_PLUGIN}, {BACKEND_PLUGIN}]"
    load_config(None, [plugins])
    yield plugins
    for reg, name in ((registry.engines, "hf"), (registry.backends, "threads")):
        reg.unregister(name)
    for path in (ENGINE_PLUGIN, BACKEND_PLUGIN):
        sys.modules.pop(registry.plugin_module_name(path), None)
        registry._loaded_plugins.pop(str(path), None)


@pytest.fixture(scope="module", params=["text", "flow", "agent", "bandit"])
def family_run(request, tiny_model_dir, tmp_path_factory):
    """(config, model directory) of a tiny run of each family."""
    name = request.param
    common = [f"rollout.batch_size={B}", f"rollout.group_size={G}", "data.num_train=64", "data.num_eval=8"]
    if name == "text":
        cfg = load_config(None, [f"model.path={tiny_model_dir}", "data.task=arithmetic",
                                 "rollout.max_new_tokens=5", *common])
        return cfg, Path(tiny_model_dir)
    if name == "agent":
        cfg = load_config(None, [f"model.path={tiny_model_dir}", "model.family=agent", "data.task=kv_lookup",
                                 "env.max_turns=3", "rollout.max_new_tokens=6", *common])
        return cfg, Path(tiny_model_dir)
    path = tmp_path_factory.mktemp(name) / "model"
    if name == "flow":
        cfg = load_config(None, [f"model.path={path}", "model.family=flow", "data.task=shapes",
                                 "flow.steps=3", "flow.eval_steps=3", "flow.init_width=16",
                                 "flow.init_depth=1", "warmstart.max_steps=2", "warmstart.eval_every=2",
                                 *common])
    else:
        request.getfixturevalue("bandit_plugin")
        cfg = load_config(None, [f"run.plugins=[{PLUGIN}]", "model.family=bandit", "data.task=arms",
                                 f"model.path={path}", *common])
    cfg.family().build_model(cfg, path, None)
    return cfg, path


def test_a_family_declares_what_it_is_and_supports(family_run):
    cfg, _ = family_run
    family = cfg.family()
    assert isinstance(family, Family) and registry.families.get(family.name) is family
    assert set(family.capabilities.features) <= FEATURE_NAMES
    kind = family.capabilities.engine_kind
    assert any(kind in registry.engines.get(n).kinds for n in registry.engines.names())  # an engine runs it
    assert set(family.capabilities.backends or ()) <= set(registry.backends.names())
    assert "drain" in family.capabilities.inflight_updates
    if family.section is not None:
        name, section = family.section
        assert dataclasses.is_dataclass(section) and isinstance(cfg.section(name), section)
        assert all(f.metadata.get("help") for f in dataclasses.fields(section))  # documented knobs
    assert family.norm_constant(cfg) >= 1


def item_of(cfg, data, index=0, version=0) -> WorkItem:
    stream = PromptStream(data.train, B, seed=0)
    return WorkItem(batch_index=index, version=version, examples=list(stream.batch(index)), group_size=G,
                    params=cfg.sampling(), seed=index)


def test_a_familys_learner_scores_its_samples_as_its_engine_did(family_run):
    """The payload is whole and stamped with the engine's version; the policy's batch has the
    learner's shapes; at the same weights, the learner's log-probs of the sampled actions are
    the engine's (the ratio starts at 1), and after a load the engine stamps the new version."""
    cfg, model_dir = family_run
    family = cfg.family()
    data = family.data(cfg, model_dir)
    sampler = family.sampler(cfg, str(model_dir), data.stop_text, device=torch.device("cpu"), threads=1,
                             seed=0)
    engine = sampler.engine
    payload = sampler.generate(item_of(cfg, data))
    payload.check()
    assert (payload.num_groups, payload.group_size) == (B, G)
    assert payload.version_shares() == {0: 1.0} and engine.version == 0
    assert {"reward/mean"} <= set(payload.metrics)

    policy = family.policy(cfg)
    model, _tokenizer = policy.load(model_dir)
    batch = policy.batch(payload)
    n = B * G
    assert batch.size == n and batch.group_size == G and batch.rewards.shape == (n,)
    assert batch.mask.shape == batch.behavior_logp.shape == batch.behavior_versions.shape
    assert batch.mask.shape[0] == n and batch.truncated.shape == (n,)
    with torch.no_grad():
        logp, _entropy, _basis = policy.forward(model, batch)
    on = batch.mask.bool()
    assert (logp[on] - batch.behavior_logp[on]).abs().mean() <= 1e-5
    assert policy.fast_forward(model, False) is None
    layers = policy.layers(model)  # the FSDP2 units, and what train.activation_checkpointing recomputes
    assert isinstance(layers, list) and all(isinstance(layer, torch.nn.Module) for layer in layers)

    weights = {k: v + 0.01 for k, v in unique_parameters(model).items()}
    engine.load_weights(weights, 3)
    again = sampler.generate(item_of(cfg, data, index=1, version=3))
    assert engine.version == 3 and again.version_shares() == {3: 1.0}
    with pytest.raises(ConfigError):
        engine.watch(lambda: None, inflight_mode("drain"))  # drain is not a mid-generation mode


def test_a_familys_model_saves_loads_and_evaluates(family_run, tmp_path):
    cfg, model_dir = family_run
    family = cfg.family()
    policy = family.policy(cfg)
    model, tokenizer = policy.load(model_dir)
    policy.save(model, tokenizer, tmp_path / "copy")
    again, _ = policy.load(tmp_path / "copy")
    for name, t in unique_parameters(model).items():
        assert torch.equal(t, unique_parameters(again)[name]), name
    data = family.data(cfg, model_dir)
    metrics = family.evaluator(cfg, model, tokenizer, data, family.scorer(cfg), num_samples=1)(0)
    assert 0.0 <= metrics["eval/pass_at_1"] <= 1.0 and metrics["eval/examples"] == len(data.eval)
    assert all(isinstance(line, str) for line in family.eval_summary(cfg, metrics, 1))


# -- token engines --------------------------------------------------------------------------------


def check_token_engine(engine, prompts, params, model=None):
    """What every ``TokenEngine`` guarantees (tests/vllm_cpu runs it on vLLM); with ``model`` (at
    the engine's weights), each token's log-prob is the model's at ``params.temperature``."""
    a = engine.generate(prompts, samples_per_prompt=3, params=params, seed=7)
    b = engine.generate(prompts, samples_per_prompt=3, params=params, seed=7)
    assert len(a) == len(prompts) and all(len(group) == 3 for group in a)
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]
    for prompt, group in zip(prompts, a, strict=True):
        for c in group:
            assert len(c.token_ids) == len(c.logprobs) == len(c.versions) <= params.max_new_tokens
            assert all(v == engine.version for v in c.versions) and all(lp <= 0 for lp in c.logprobs)
            assert c.finish_reason in ("stop", "length")
            if model is not None and c.token_ids:
                with torch.no_grad():
                    logits = model(torch.tensor([[*prompt, *c.token_ids]])).logits[0, len(prompt) - 1:-1]
                logp = torch.log_softmax(logits.float() / params.temperature, -1)
                mine = logp.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
                assert torch.allclose(mine, torch.tensor(c.logprobs), atol=1e-4), (mine, c.logprobs)
    assert engine.take_counts() == (0, 0)  # nothing wasted, no switch: no publication meanwhile
    assert all(isinstance(v, float) for v in engine.report().values())


@pytest.mark.parametrize("name", ["torch", "hf"])  # Tether's own, and a plug-in's (vLLM: tests/vllm_cpu)
def test_a_token_engine_keeps_the_token_engine_contract(tiny_model_dir, runner_plugins, name):
    from tether.decoding.sampling import stop_ids_for
    from tether.modeling import load_causal_lm, load_tokenizer

    cfg = load_config(None, [runner_plugins, f"model.path={tiny_model_dir}", f"rollout.engine={name}",
                             "rollout.max_new_tokens=6", "rollout.temperature=0.7"])
    plugin = registry.engines.get(name)
    assert "token" in plugin.kinds and "drain" in plugin.inflight_updates
    tokenizer = load_tokenizer(tiny_model_dir)
    engine = plugin.build(cfg, str(tiny_model_dir), tokenizer, stop_ids_for(tokenizer, "\n"),
                          device=torch.device("cpu"), threads=1, seed=0)
    try:
        prompts = [tokenizer(p, add_special_tokens=False).input_ids for p in ("1+2=", "33+4=")]
        model, _ = load_causal_lm(tiny_model_dir)
        check_token_engine(engine, prompts, cfg.sampling(), model)
        weights = {k: v + 0.01 for k, v in unique_parameters(model).items()}
        engine.load_weights(weights, 1)  # a publication: the next samples carry it
        assert engine.version == 1
        (group,) = engine.generate(prompts[:1], samples_per_prompt=2, params=cfg.sampling(), seed=1)
        assert all(v == 1 for c in group for v in c.versions)
    finally:
        engine.close()


# -- rollout pools --------------------------------------------------------------------------------


def _fake(tiny_model_dir, tmp_path):
    from tether.loop.fakes import FakePool

    return FakePool(num_groups=B, group_size=G, gen_time=0.05), lambda v: {"version": v}


def _backend(name, *overrides):
    """A backend's pool, built as a run builds it: through its plug-in, inside its session."""
    def make(tiny_model_dir, tmp_path, stack, plugins):
        from configs import pool_settings
        from tether.modeling import load_causal_lm

        model, _ = load_causal_lm(tiny_model_dir)
        settings = pool_settings(tiny_model_dir, plugins, f"rollout.backend={name}",
                                 f"rollout.group_size={G}", "rollout.max_new_tokens=4", *overrides)
        plugin = registry.backends.get(name)
        session = stack.enter_context(plugin.session(settings.cfg, tmp_path / "run"))
        pool = plugin.pool(settings, STREAM.batch, unique_parameters(model), session, initial_version=0,
                           extras=None)
        return pool, lambda v: unique_parameters(model)
    return make


def _ray(tiny_model_dir, tmp_path, stack, plugins):
    pytest.importorskip("ray")
    return _backend("ray", "ray.local_cpus=2")(tiny_model_dir, tmp_path, stack, plugins)


@pytest.mark.parametrize("make", [lambda d, t, s, p: _fake(d, t), _backend("local"), _ray,
                                  _backend("threads")], ids=["fake", "local", "ray", "threads"])
def test_a_rollout_pool_keeps_the_pool_contract(tiny_model_dir, tmp_path, runner_plugins, make):
    import contextlib

    with contextlib.ExitStack() as stack:
        pool, weights = make(tiny_model_dir, tmp_path, stack, runner_plugins)
        stack.callback(pool.close)
        check_pool(pool, weights)


def check_pool(pool, weights):
    with pytest.raises(TetherError):
        pool.launch(GenerationRequest(index=0, version=5))  # the engines hold version 0
    assert pool.inflight == 0 and pool.reap() == []
    for i in range(3):
        pool.launch(GenerationRequest(index=i, version=0))
    assert pool.inflight == 3
    with pytest.raises(TetherError, match="in flight"):  # a draining pool publishes when quiesced
        pool.publish(weights(1), 1)
    got = pool.wait(120)
    assert got and pool.inflight == 3 - len(got)
    got += pool.quiesce(120)
    assert pool.inflight == 0 and sorted(b.index for b in got) == [0, 1, 2]
    assert all(b.behavior_version == 0 and b.num_groups == B and b.group_size == G for b in got)
    pool.publish(weights(1), 1)
    pool.launch(GenerationRequest(index=3, version=1))
    (fresh,) = pool.quiesce(120)
    assert (fresh.index, fresh.behavior_version) == (3, 1)


# -- learner layouts ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["process", "ranks", "actor"])
def test_a_learner_layout_keeps_the_learner_contract(tiny_model_dir, tmp_path, layout):
    import contextlib

    from test_learner import sampled_batch

    from tether.runtime.assemble import assemble

    extra = {"process": [], "ranks": ["train.world_size=2"],
             "actor": ["rollout.backend=ray", "ray.learner=actor", "ray.local_cpus=2"]}[layout]
    if layout == "actor":
        pytest.importorskip("ray")
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "data.task=arithmetic", "data.num_eval=8",
                             "train.lr=1e-3", *extra])
    parts = assemble(cfg)
    assert parts.layout == layout
    batch, _ = sampled_batch(tiny_model_dir)
    with contextlib.ExitStack() as stack:
        session = stack.enter_context(parts.session(tmp_path / "run"))
        prepared = parts.prepare()
        learner, evaluate = parts.learner(prepared, session, stack, tmp_path / "run")
        before = {k: v.clone() for k, v in learner.export_weights().items()}
        result = learner.train(batch, train_version=0)
        assert result.attempted_updates == 1 and result.committed_updates in (0, 1)
        assert {"loss/policy", "ratio/mean", "train/grad_norm"} <= set(result.metrics)
        assert 0.0 <= evaluate(1)["eval/pass_at_1"] <= 1.0
        learner.save(tmp_path / "ckpt")
        learner.train(batch, train_version=1)
        learner.load(tmp_path / "ckpt")  # back to the weights after the first update
        after = {k: v.clone() for k, v in learner.export_weights().items()}
        assert set(after) == set(before)
        assert any(not torch.equal(after[k], before[k]) for k in before)  # the update moved them
        saved = load_weights(tmp_path / "ckpt")
        for name, t in after.items():
            assert torch.equal(t, saved[name]), name


def load_weights(ckpt: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model" / "model.safetensors"))
