"""``tether.train``'s Python side without a run: how objects become names every process loads, a
script Tether imports that calls ``tether.train``, and the recipe checks the API leans on
(estimators that declare ``std_norm``, unknown reward names refused at load)."""

import functools
import json
import sys
import textwrap

import pytest

import tether
from tether import registry
from tether.api import reference
from tether.config import Config, load_config
from tether.errors import ConfigError
from tether.pyload import load_python_object

SCRIPT = textwrap.dedent("""
    import tether

    @tether.register_reward("{name}")
    def score(prompt, completion, answer, fields):
        return 1.0

    class Env:
        def reset(self, task, seed):
            return "go"

        def step(self, action):
            return None

    summary = tether.train({{}}, reward=score, env=Env, run_dir="never")
    raise SystemExit("the script went on past tether.train")
""")


def _script(tmp_path, name):
    path = tmp_path / f"{name}.py"
    path.write_text(SCRIPT.format(name=name))
    return path


def test_a_script_that_calls_tether_train_is_imported_up_to_the_call(tmp_path):
    # a worker loading the script's reward (or environment): the import ends at tether.train,
    # with what the script defined above it, and no run starts
    path = _script(tmp_path, "api_reward_script")
    try:
        fn = load_python_object(f"{path}:score", what="reward.function")
        assert fn("p", "c", "a", {}) == 1.0 and "api_reward_script" in registry.rewards
        assert load_python_object(f"{path}:Env", what="env.env_class").__name__ == "Env"
        assert not (tmp_path / "never").exists()
    finally:
        registry.rewards.unregister("api_reward_script")


def test_a_script_that_names_itself_in_run_plugins_registers_once_per_process(tmp_path):
    path = _script(tmp_path, "api_plugin_script")
    try:
        # the script run once (as the driver's __main__ is; here: for its reward), then as its own
        # plug-in: its registrations are made again, from the same file, and accepted
        load_python_object(f"{path}:score", what="reward.function")
        cfg = load_config(None, [f"run.plugins=[{path}]", "reward.function=api_plugin_script",
                                 "data.task=reverse"])
        assert cfg.reward.function == "api_plugin_script"
    finally:
        registry.rewards.unregister("api_plugin_script")


def test_a_name_taken_by_another_file_or_by_tether_is_still_refused(tmp_path):
    def first(prompt, completion, answer, fields):
        return 0.0

    registry.rewards.register("api_taken", first)
    other = tmp_path / "other.py"
    other.write_text("import tether\n\n@tether.register_reward('api_taken')\n"
                     "def second(prompt, completion, answer, fields):\n    return 1.0\n")
    try:
        with pytest.raises(tether.PluginError, match="'api_taken' is already registered"):
            load_config(None, [f"run.plugins=[{other}]"])
        with pytest.raises(tether.PluginError, match="'exact_match' is already registered"):
            registry.rewards.register("exact_match", first)
    finally:
        registry.rewards.unregister("api_taken")


def test_objects_become_names_every_process_can_load(tmp_path):
    assert reference("exact_match", what="reward") == "exact_match"  # a name is a name
    assert reference(json.dumps, what="reward") == "json:dumps"  # an importable module's
    path = _script(tmp_path, "api_file_script")
    try:
        fn = load_python_object(f"{path}:score", what="reward.function")
        assert reference(fn, what="reward") == f"{path.resolve()}:score"  # a file's: by its file
    finally:
        registry.rewards.unregister("api_file_script")
    # by value: what pickles and refers to nothing in __main__
    spec = reference(functools.partial(json.dumps, indent=2), what="reward")
    assert spec.endswith(":obj")
    assert load_python_object(spec, what="reward.function")({"a": 1}) == json.dumps({"a": 1}, indent=2)


def test_an_object_no_worker_can_load_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"reward <function .*<lambda>.* cannot reach Tether's worker "
                                          r"processes.*define it at the top level of a file"):
        reference(lambda prompt, completion, answer, fields: 1.0, what="reward")

    def nested(prompt, completion, answer, fields):
        return 1.0

    with pytest.raises(ConfigError, match=r"reward .*nested.* cannot reach"):
        reference(nested, what="reward")


def test_the_api_refuses_what_it_cannot_run_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match=r"recipe 'missing\.yaml' does not exist"):
        tether.train("missing.yaml")
    with pytest.raises(ConfigError, match="needs run_dir: the run to continue"):
        tether.train(resume=True)
    with pytest.raises(ConfigError, match="cfg must be a Config, a mapping"):
        tether.train(3)
    with pytest.raises(ConfigError, match="unknown reward 'exact_mtch'"):
        tether.train({"data": {"task": "reverse"}}, reward="exact_mtch", run_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_an_estimator_registered_with_std_norm_reads_train_adv_std_norm():
    @tether.register_advantage("api_scaled", std_norm=True)
    def scaled(rewards, *, std_norm, scope, eps):
        return rewards

    @tether.register_advantage("api_plain")
    def plain(rewards, *, std_norm, scope, eps):
        return rewards

    try:
        cfg = load_config(None, ["train.advantage=api_scaled", "train.adv_std_norm=false",
                                 "train.adv_scope=batch"])
        assert (cfg.train.adv_std_norm, cfg.train.adv_scope) == (False, "batch")
        assert load_config(None, ["train.advantage=api_scaled"]).train.adv_std_norm is True  # the preset's
        assert Config.from_dict(cfg.to_dict()) == cfg  # a resolved config loads again as itself
        refused = r"train\.adv_std_norm has no effect with train\.advantage=api_plain .*=grpo or api_scaled"
        with pytest.raises(ConfigError, match=refused):
            load_config(None, ["train.advantage=api_plain", "train.adv_std_norm=true"])
        plain_cfg = load_config(None, ["train.advantage=api_plain"])
        assert plain_cfg.train.adv_std_norm is False and Config.from_dict(plain_cfg.to_dict()) == plain_cfg
    finally:
        registry.advantages.unregister("api_scaled")
        registry.advantages.unregister("api_plain")


@pytest.mark.parametrize(("given", "message"), [
    (["reward.function=exact_mtch"], r"unknown reward 'exact_mtch' for reward\.function \(did you mean "
                                     r"'exact_match'\?\); valid: task, exact_match"),
    (["reward.functions=[exact_match, numeric_mtch]"],
     r"unknown reward 'numeric_mtch' for reward\.functions \(did you mean 'numeric_match'\?\)"),
    (["reward.function=missing.py:reward"], r"reward\.function file 'missing\.py' does not exist"),
    (["reward.function={reward}:rewrd"], r"defines no 'rewrd'; its functions are: reward \(did you mean "
                                         r"'reward'\?\)"),
    (["reward.function=json:dumsp"], r"module 'json' defines no 'dumsp'.*\(did you mean 'dump'\?\)"),
])
def test_an_unknown_reward_is_refused_at_load_with_the_closest_name(tmp_path, given, message):
    reward = tmp_path / "reward.py"
    reward.write_text("def reward(prompt, completion, answer, fields):\n    return 1.0\n")
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["data.task=reverse", *(g.format(reward=reward) for g in given)])


def test_known_rewards_load(tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text("def reward(prompt, completion, answer, fields):\n    return 1.0\n")
    for spec in ("task", "exact_match", f"{reward}:reward", "tether.data.rewards:exact_match"):
        assert load_config(None, ["data.task=reverse", f"reward.function={spec}"]).reward.function == spec


@pytest.mark.timeout(60)
def test_importing_tether_api_loads_no_torch():
    import subprocess

    out = subprocess.run([sys.executable, "-c", "import sys, tether.api; print('torch' in sys.modules)"],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_the_docs_show_the_example_scripts_as_they_are():
    # docs/api.md's examples are the scripts tests/integration/test_api_scripts.py runs, verbatim
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    blocks = re.findall(r"```python\n# (examples/api/\S+\.py)\n(.*?)```", (root / "docs/api.md").read_text(),
                        re.DOTALL)
    assert sorted(name for name, _ in blocks) == sorted(
        f"examples/api/{p.name}" for p in (root / "examples/api").glob("*.py"))
    for name, text in blocks:
        assert text == (root / name).read_text(), f"docs/api.md's copy of {name} differs from the file"
