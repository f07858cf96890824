"""Engines and backends are plug-ins that declare themselves: ``tether.register_engine`` and
``tether.register_backend`` add them through ``run.plugins``; their sections are theirs; every
refusal of an engine or backend at config load comes from what it declares (vLLM's included)."""

import pickle
import textwrap

import pytest

import tether
from tether import registry
from tether.config import load_config
from tether.errors import ConfigError, PluginError

ENGINES = '''
from dataclasses import dataclass

import tether
from tether.config.fields import knob


@dataclass(frozen=True)
class EchoSection:
    """The echo engine's own knobs."""

    beams: int = knob(1, "Beams.", min=1)


class Echo(tether.EnginePlugin):
    def check(self, cfg):
        if cfg.section("echo_{tag}").beams == 7:
            raise tether.ConfigError("echo_{tag}.beams=7: seven beams are too many; choose fewer")


tether.register_engine(Echo("echo_{tag}", section=("echo_{tag}", EchoSection), keys=("rollout.top_k",)))
tether.register_engine(tether.EnginePlugin("stepper_{tag}", kinds=frozenset({{"step"}})))
tether.register_engine(tether.EnginePlugin("cpu_only_{tag}", inflight_updates=("drain", "keep"),
                                           dtype_key="rollout.dtype", notes={{"lora": "it has no adapters",
                                                                             "dtypes": "no bf16 kernels"}}))
tether.register_backend(tether.BackendPlugin("threads_{tag}"))
'''


@pytest.fixture
def plugin(tmp_path, request):
    """Write the plug-in file; what it registers is removed afterwards."""
    tag = request.node.name.split("[")[0][-12:].replace("-", "_")
    path = tmp_path / "engines.py"
    path.write_text(textwrap.dedent(ENGINES.format(tag=tag)))
    before = {kind: set(getattr(registry, kind).names()) for kind in ("engines", "backends")}
    yield f"run.plugins=[{path}]", tag
    for kind, names in before.items():
        reg = getattr(registry, kind)
        for name in set(reg.names()) - names:
            reg.unregister(name)


def test_the_registrations_are_public():
    for name in ("register_engine", "register_backend", "EnginePlugin", "BackendPlugin"):
        assert name in tether.__all__ and getattr(tether, name) is not None


def test_a_registered_engine_and_backend_are_chosen_by_kind_not_by_name(plugin):
    plugins, tag = plugin
    cfg = load_config(None, [plugins, f"rollout.engine=echo_{tag}", f"rollout.backend=threads_{tag}",
                             f"echo_{tag}.beams=3", "rollout.top_k=5"])
    assert (cfg.rollout.engine, cfg.rollout.backend, cfg.section(f"echo_{tag}").beams) == (
        f"echo_{tag}", f"threads_{tag}", 3)
    assert cfg.to_dict()[f"echo_{tag}"] == {"beams": 3}
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # rebuilt from its recipe, plug-ins first
    with pytest.raises(ConfigError, match="seven beams are too many"):  # its own check
        load_config(None, [plugins, f"rollout.engine=echo_{tag}", f"echo_{tag}.beams=7"])
    # what is its own is refused with another engine
    with pytest.raises(ConfigError, match=f"the echo_{tag} section is set, but it is read only with "
                                          f"rollout.engine=echo_{tag}"):
        load_config(None, [plugins, f"echo_{tag}.beams=3"])
    with pytest.raises(ConfigError, match=f"rollout.top_k=5 is read only with rollout.engine=echo_{tag}"):
        load_config(None, [plugins, f"rollout.engine=cpu_only_{tag}", "rollout.top_k=5"])


def test_what_an_engine_does_not_declare_is_refused_at_load(plugin):
    plugins, tag = plugin
    with pytest.raises(ConfigError, match=f"rollout.engine=stepper_{tag}: model.family=text needs a token "
                                          f"engine, and stepper_{tag} is a step engine; use rollout.engine "
                                          "torch or vllm or echo_"):
        load_config(None, [plugins, f"rollout.engine=stepper_{tag}"])
    with pytest.raises(ConfigError, match=f"async.inflight_update=abort: rollout.engine=echo_{tag} runs with "
                                          "async.inflight_update drain only; set one of them, or "
                                          "rollout.engine torch or vllm"):
        load_config(None, [plugins, f"rollout.engine=echo_{tag}", "async.inflight_update=abort"])
    with pytest.raises(ConfigError, match=rf"train.lora_rank=4: rollout.engine=cpu_only_{tag} does not "
                                          r"sample from LoRA adapters \(it has no adapters\); set "
                                          "train.lora_rank=0, or rollout.engine torch or vllm"):
        load_config(None, [plugins, f"rollout.engine=cpu_only_{tag}", "train.lora_rank=4"])
    with pytest.raises(ConfigError, match=f"rollout.backend=ray puts its workers on cuda, and "
                                          f"rollout.engine=echo_{tag} samples on cpu only"):
        load_config(None, [plugins, f"rollout.engine=echo_{tag}", "rollout.backend=ray",
                           "ray.gpus_per_worker=1"])
    load_config(None, [plugins, f"rollout.engine=cpu_only_{tag}", "async.inflight_update=keep"])


def test_the_collective_weight_channel_is_what_an_engine_declares(plugin):
    plugins, tag = plugin
    with pytest.raises(ConfigError, match=rf"rollout.backend=local publishes weights through collective, "
                                          rf"which rollout.engine=echo_{tag} cannot take; it takes shared "
                                          r"memory or object store or in process; set rollout.weight_sync="
                                          r"auto, or rollout.engine torch or vllm$"):
        load_config(None, [plugins, f"rollout.engine=echo_{tag}", "rollout.weight_sync=collective"])
    load_config(None, [plugins, f"rollout.engine=echo_{tag}", "rollout.weight_sync=shm"])
    assert all("collective" in registry.engines.get(e).weight_channels for e in ("torch", "vllm"))


def test_an_engines_dtypes_are_its_declaration_checked_at_load(plugin):
    plugins, tag = plugin
    with pytest.raises(ConfigError, match=rf"rollout.dtype=bfloat16: rollout.engine=cpu_only_{tag} samples "
                                          r"in float32 only \(no bf16 kernels\); set rollout.dtype=float32, "
                                          r"or rollout.engine torch or vllm$"):
        load_config(None, [plugins, f"rollout.engine=cpu_only_{tag}", "rollout.dtype=bfloat16"])
    assert registry.engines.get(f"cpu_only_{tag}").keys == ("rollout.dtype",)  # its dtype key is its own
    with pytest.raises(ConfigError, match=rf"rollout.dtype=bfloat16 is read only with rollout.engine=torch "
                                          rf"\(rollout.engine is 'echo_{tag}'\)"):  # it has no dtype key
        load_config(None, [plugins, f"rollout.engine=echo_{tag}", "rollout.dtype=bfloat16"])
    with pytest.raises(ConfigError, match="rollout.dtype=bfloat16 is read only with rollout.engine=torch "
                                          r"\(rollout.engine is 'vllm'\)"):  # vLLM's is vllm.dtype
        load_config(None, ["rollout.engine=vllm", "rollout.dtype=bfloat16"])
    with pytest.raises(ConfigError, match=r"rollout.decoder=native runs float32 only .* set "
                                          "rollout.decoder=auto or python"):
        load_config(None, ["rollout.decoder=native", "rollout.dtype=bfloat16"])
    assert registry.engines.get("torch").dtype(load_config(None, ["rollout.dtype=bfloat16"])) == "bfloat16"
    assert registry.engines.get("vllm").dtype(load_config(None, ["rollout.engine=vllm",
                                                                 "vllm.dtype=float16"])) == "float16"
    assert registry.engines.get(f"echo_{tag}").dtype(load_config(None, [plugins])) == "float32"


def test_the_flow_family_asks_for_a_step_engine():
    with pytest.raises(ConfigError, match="model.family=flow needs a step engine .* vllm is a token engine "
                                          r"\(vLLM serves language models\); use rollout.engine torch"):
        load_config(None, ["model.family=flow", "data.task=shapes", "rollout.engine=vllm"])


def test_vllms_limits_are_its_declarations_checked_at_load():
    with pytest.raises(ConfigError, match=r"train.lora_rank=1024 is above the largest rank vLLM serves "
                                          r"\(512\)"):
        load_config(None, ["rollout.engine=vllm", "train.lora_rank=1024"])
    cfg = load_config(None, ["rollout.engine=vllm", "train.lora_rank=64", "vllm.dtype=bfloat16"])
    assert cfg.vllm.dtype == "bfloat16" and "vllm" in cfg.to_dict() and "ray" not in cfg.to_dict()
    with pytest.raises(ConfigError, match=r"the vllm section is set, but it is read only with "
                                          r"rollout\.engine=vllm"):
        load_config(None, ["vllm.dtype=bfloat16"])
    with pytest.raises(ConfigError, match=r"the ray section is set, but it is read only with "
                                          r"rollout\.backend=ray"):
        load_config(None, ["ray.local_cpus=2"])
    assert load_config(None, []).ray.learner == "driver"  # an engine's or backend's section at its defaults


def test_a_plugin_that_is_not_declared_as_one_is_refused(plugin):
    with pytest.raises(PluginError, match=r"is not a tether engine: declare it as a tether\.EnginePlugin"):
        tether.register_engine(object())
    # what a plug-in declares is checked when it is made, registered or not (its __post_init__)
    with pytest.raises(PluginError, match="declares kinds"):
        tether.EnginePlugin("odd_kind", kinds=frozenset({"image"}))
    with pytest.raises(PluginError, match="declares weight_channel='carrier_pigeon'"):
        tether.BackendPlugin("birds", weight_channel="carrier_pigeon")
    with pytest.raises(PluginError, match=r"'odd_section' declares section=\('odd', <class 'dict'>\)"):
        tether.BackendPlugin("odd_section", section=("odd", dict))
    with pytest.raises(PluginError, match="engine named 'vllm' is already registered"):
        tether.register_engine(tether.EnginePlugin("vllm"))


def test_a_section_name_taken_twice_is_refused(plugin):
    _, tag = plugin
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Other:
        pass

    tether.register_backend(tether.BackendPlugin(f"clash_{tag}", section=("vllm", Other)))
    with pytest.raises(PluginError, match=f"declares a section 'vllm', which (rollout.engine=vllm|"
                                          f"rollout.backend=clash_{tag}) has too; rename one of them"):
        load_config(None, [])


def test_a_family_must_declare_its_keys_and_section_too():
    class Bare:  # no section, no keys (nor other members: the refusal names every one missing)
        name, description, capabilities, warmstart_fields = "bare", "", tether.Capabilities(), ()

        def check(self, cfg): ...
        def norm_constant(self, cfg): ...
        def sampler(self, *a, **k): ...
        def policy(self, cfg): ...
        def evaluator(self, *a, **k): ...
        def data(self, *a): ...
        def scorer(self, cfg): ...

    with pytest.raises(PluginError, match=r"is not a tether Family \(missing: [^)]*\bkeys\b[^)]*\bsection\b"):
        tether.register_family(Bare())


def test_a_family_declares_its_section_as_an_engine_does():
    class Sectioned(tether.FamilyBase):
        name, section = "sectioned", ("sectioned", dict)  # not a dataclass of knobs

    with pytest.raises(PluginError, match=r"'sectioned' declares section=\('sectioned', <class 'dict'>\); "
                                          r"give \(name, a frozen dataclass"):
        tether.register_family(Sectioned())
    assert "sectioned" not in tether.registry.families


def test_what_is_read_from_the_plugins_is_computed_once_until_one_registers(monkeypatch):
    """The key table and the plug-in sections are built again only when a plug-in registers or
    is removed (``registry.generation``), not on every config check or section lookup."""
    from dataclasses import dataclass

    from tether.config import config as config_module
    from tether.config import keys as keys_module

    builds = {"table": 0, "sections": 0}

    def counting(name, real):
        def wrapped(*a, **k):
            builds[name] += 1
            return real(*a, **k)
        return wrapped

    monkeypatch.setattr(keys_module, "_build", counting("table", keys_module._build))
    monkeypatch.setattr(config_module, "_find_section_classes",
                        counting("sections", config_module._find_section_classes))
    cfg = load_config(None, [])
    keys_module.table(), config_module.plugin_section_classes()  # built once here, at most
    before = dict(builds)
    for _ in range(3):
        cfg.check()
        cfg.section("vllm"), cfg.has_section("ray"), keys_module.table()
    assert builds == before

    @dataclass(frozen=True)
    class Counted:
        n: int = 1

    counted = tether.register_backend(tether.BackendPlugin("counted", section=("counted", Counted)))
    try:
        assert "counted.n" in keys_module.table() and "counted" in config_module.plugin_section_classes()
        assert builds == {"table": before["table"] + 1, "sections": before["sections"] + 1}
    finally:
        registry.backends.unregister(counted.name)
    assert "counted.n" not in keys_module.table() and "counted" not in config_module.plugin_section_classes()


def test_the_other_engines_precision_key_points_to_the_chosen_engines_own():
    """rollout.dtype is the built-in engine's; with vLLM chosen the refusal names vllm.dtype."""
    with pytest.raises(ConfigError, match=r"rollout.dtype=bfloat16 is read only with rollout.engine=torch "
                                          r".*; vllm's precision is vllm.dtype$"):
        load_config(None, ["rollout.engine=vllm", "rollout.dtype=bfloat16"])
