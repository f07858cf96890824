"""Plug-ins: a recipe's ``run.plugins`` add names its keys then accept; a plug-in family's own
section is read, checked and pickled like Tether's own; bad plug-ins are clear errors."""

import pickle
import textwrap

import pytest

from tether import registry
from tether.config import load_config
from tether.errors import ConfigError, PluginError

ESTIMATORS = '''
import tether

@tether.register_loss("reinforce_{tag}")
def reinforce(x, s):
    return -x.advantages[:, None] * x.logp, {{}}

@tether.register_advantage("mean_baseline_{tag}", min_group_size=1)
def mean_baseline(r, *, std_norm, scope, eps):
    return r - r.mean()

@tether.register_kl("abs_{tag}")
def abs_kl(logp, ref_logp):
    return (logp - ref_logp).abs()

@tether.register_reward("first_char_{tag}")
def first_char(prompt, completion, answer, fields):
    return float(completion[:1] == answer[:1])
'''

FAMILY = '''
from dataclasses import dataclass

import tether
from tether.config.fields import knob


@dataclass(frozen=True)
class DiceSection:
    """The dice family's own knobs."""

    faces: int = knob(6, "Faces of each die.", min=2)


class Dice(tether.FamilyBase):
    name = "dice_{tag}"
    section = ("dice_{tag}", DiceSection)
    capabilities = tether.Capabilities(features=frozenset({{"token_sampling"}}))

    def check(self, cfg):
        if cfg.section("dice_{tag}").faces == 13:
            raise tether.ConfigError("dice_{tag}.faces=13 is unlucky; choose another")


@dataclass(frozen=True)
class Roll:
    name: str = "roll_{tag}"
    description: str = "roll the dice"
    family: str = "dice_{tag}"


tether.register_family(Dice())
tether.register_task(Roll())
'''


@pytest.fixture
def plugin(tmp_path, request):
    """Write a plug-in file; what it registers is removed afterwards."""
    tag = request.node.name.split("[")[0][-12:].replace("-", "_")
    made = []

    def write(source: str, name: str = "plugin.py"):
        path = tmp_path / name
        path.write_text(textwrap.dedent(source.format(tag=tag)))
        made.append(path)
        return path, tag

    before = {kind: set(getattr(registry, kind).names()) for kind in
              ("families", "losses", "advantages", "kl_estimators", "rewards", "tasks")}
    yield write
    for kind, names in before.items():
        reg = getattr(registry, kind)
        for name in set(reg.names()) - names:
            reg.unregister(name)


def test_registered_losses_estimators_and_rewards_are_valid_recipe_values(plugin):
    path, tag = plugin(ESTIMATORS)
    cfg = load_config(None, [f"run.plugins=[{path}]", f"train.loss=reinforce_{tag}",
                             f"train.advantage=mean_baseline_{tag}", f"train.kl_estimator=abs_{tag}",
                             "train.kl_coef=0.1", f"reward.function=first_char_{tag}",
                             "rollout.group_size=1"])
    assert (cfg.train.loss, cfg.train.advantage, cfg.train.kl_estimator) == (
        f"reinforce_{tag}", f"mean_baseline_{tag}", f"abs_{tag}")
    assert registry.rewards.get(f"first_char_{tag}")("p", "42", "4", {}) == 1.0
    # a one-sample group is refused for an estimator that needs two, accepted for this one
    with pytest.raises(ConfigError, match=r"rollout\.group_size=1 trains nothing"):
        load_config(None, [f"run.plugins=[{path}]", "rollout.group_size=1"])
    # an estimator that did not say it reads the std keys refuses them
    with pytest.raises(ConfigError, match=f"train.adv_scope=batch has no effect with train.advantage="
                                          f"mean_baseline_{tag}"):
        load_config(None, [f"run.plugins=[{path}]", f"train.advantage=mean_baseline_{tag}",
                           "train.adv_scope=batch"])


def test_a_plugin_familys_section_is_read_checked_and_pickled(plugin):
    path, tag = plugin(FAMILY)
    cfg = load_config(None, [f"run.plugins=[{path}]", f"model.family=dice_{tag}", f"data.task=roll_{tag}",
                             f"dice_{tag}.faces=20", "rollout.temperature=0.5"])
    assert cfg.section(f"dice_{tag}").faces == 20 and getattr(cfg, f"dice_{tag}").faces == 20
    assert cfg.to_dict()[f"dice_{tag}"] == {"faces": 20}
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # rebuilt from its recipe, plug-ins first
    with pytest.raises(ConfigError, match="is unlucky"):  # the family's own check
        load_config(None, [f"run.plugins=[{path}]", f"model.family=dice_{tag}", f"data.task=roll_{tag}",
                           f"dice_{tag}.faces=13"])
    with pytest.raises(ConfigError, match=f"dice_{tag}.faces must be >= 2"):
        load_config(None, [f"run.plugins=[{path}]", f"model.family=dice_{tag}", f"data.task=roll_{tag}",
                           f"dice_{tag}.faces=1"])
    # its section is another family's to refuse; what it does not declare, it refuses
    with pytest.raises(ConfigError, match=f"the dice_{tag} section is set, but it is read only with "
                                          f"model.family=dice_{tag}"):
        load_config(None, [f"run.plugins=[{path}]", f"dice_{tag}.faces=8"])
    with pytest.raises(ConfigError, match=f"train.world_size=2 asks for learner ranks .* which "
                                          f"model.family=dice_{tag} does not have"):
        load_config(None, [f"run.plugins=[{path}]", f"model.family=dice_{tag}", f"data.task=roll_{tag}",
                           "train.world_size=2"])


def test_bad_plugins_are_clear_errors(plugin, tmp_path):
    with pytest.raises(ConfigError, match=r"run\.plugins: 'nope\.py' does not exist"):
        load_config(None, ["run.plugins=[nope.py]"])
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module'"):
        load_config(None, ["run.plugins=[no_such_module]"])
    broken, _ = plugin("import tether\nraise KeyError('x')\n", "broken.py")
    with pytest.raises(PluginError, match=r"broken\.py failed to import: KeyError"):
        load_config(None, [f"run.plugins=[{broken}]"])
    twice, _ = plugin("import tether\ntether.register_loss('ppo_clip')(lambda x, s: (x.logp, {{}}))\n",
                      "twice.py")
    with pytest.raises(PluginError, match="a loss named 'ppo_clip' is already registered"):
        load_config(None, [f"run.plugins=[{twice}]"])
    junk, _ = plugin("import tether\ntether.register_family(object())\n", "junk.py")
    with pytest.raises(PluginError, match="is not a tether Family"):
        load_config(None, [f"run.plugins=[{junk}]"])


def test_user_code_that_exits_or_raises_at_import_is_a_clear_error(plugin, tmp_path, monkeypatch):
    """Every import of a user's code — a plug-in file or module, a reward, dataset or environment
    file — that raises, sys.exit() included (which would end the run with its status and no word),
    is a ConfigError naming the file or module, what it raised and where."""
    from tether.pyload import load_python_object

    exits, _ = plugin("import sys\n\nsys.exit(5)\n", "exits.py")
    with pytest.raises(PluginError, match=r"run\.plugins: .*exits\.py failed to import: SystemExit: 5 at "
                                          r".*exits\.py:3 \(it calls sys\.exit\(5\) when imported"):
        load_config(None, [f"run.plugins=[{exits}]"])
    for what in ("reward function", "env.env_class", "dataset loader"):  # as their loaders name them
        with pytest.raises(ConfigError, match=rf"{what} file '.*exits\.py' failed to import: SystemExit: 5 "):
            load_python_object(f"{exits}:make", what=what)
    package = tmp_path / "site"
    package.mkdir()
    (package / "raises_at_import.py").write_text("x = 1\nraise RuntimeError('no network here')\n")
    (package / "exits_at_import.py").write_text("raise SystemExit('usage: exits_at_import.py ARG')\n")
    (package / "lacks_a_dependency.py").write_text("import not_installed_anywhere_xyz\n")
    monkeypatch.syspath_prepend(str(package))
    with pytest.raises(PluginError, match=r"run\.plugins: module 'raises_at_import' failed to import: "
                                          r"RuntimeError: no network here at .*raises_at_import\.py:2"):
        load_config(None, ["run.plugins=[raises_at_import]"])
    with pytest.raises(PluginError, match=r"module 'exits_at_import' failed to import: SystemExit: usage: "):
        load_config(None, ["run.plugins=[exits_at_import]"])
    missing = r"ModuleNotFoundError: No module named 'not_installed_anywhere_xyz' at "
    with pytest.raises(PluginError, match=r"module 'lacks_a_dependency' failed to import: " + missing):
        load_config(None, ["run.plugins=[lacks_a_dependency]"])


def test_the_same_plugin_file_is_one_module_in_every_process(tmp_path):
    path = tmp_path / "p.py"
    path.write_text("")
    name = registry.plugin_module_name(path)
    assert name == registry.plugin_module_name(tmp_path / "." / "p.py")  # the resolved path, not the spelling
    other = tmp_path / "q" / "p.py"
    assert registry.plugin_module_name(other) != name

