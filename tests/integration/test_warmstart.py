"""Warm start measurably raises held-out pass rate, and ensure_model builds a model atomically."""

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tether.config import load_config
from tether.config.schema import WarmstartSection
from tether.data.prepare import ensure_model
from tether.data.rewards import scorer
from tether.data.tasks import get_task
from tether.errors import ConfigError
from tether.families.text.warmstart import warmstart

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_short_warm_start_raises_held_out_pass_rate(tiny_model_dir, tmp_path):
    task = get_task("reverse")
    train = task.examples("train", 2000, seed=0, difficulty=3)
    held_out = task.examples("eval", 60, seed=0, difficulty=3)
    result = warmstart(tiny_model_dir, train, held_out, scorer("task", task="reverse"),
                       out_dir=tmp_path / "warm", description="reverse-3",
                       settings=WarmstartSection(max_steps=150, eval_every=25, batch_size=32,
                                                 target_pass_rate=0.8))
    assert result.pass_at_1_before < 0.1
    assert result.pass_at_1_after >= result.pass_at_1_before + 0.5
    saved = json.loads((tmp_path / "warm" / "warmstart.json").read_text())
    assert saved["pass_at_1_after"] == result.pass_at_1_after
    assert (tmp_path / "warm" / "model.safetensors").is_file()
    assert (tmp_path / "warm" / "tokenizer.json").is_file()


def test_ensure_model_builds_and_warm_starts_when_allowed(tmp_path):
    target = tmp_path / "models" / "built"
    cfg = load_config(None, [f"model.path={target}", "model.create_if_missing=true",
                             "model.init_size=tiny", "data.task=reverse", "data.difficulty=3",
                             "data.num_train=1000", "data.num_eval=40", "warmstart.max_steps=60",
                             "warmstart.eval_every=20", "warmstart.batch_size=32"])
    assert ensure_model(cfg) == target
    assert (target / "config.json").is_file() and (target / "warmstart.json").is_file()
    assert json.loads((target / "tether_model.json").read_text())["size"] == "tiny"
    assert [p.name for p in target.parent.iterdir()] == ["built"]  # no staging folder left
    assert ensure_model(cfg) == target  # present: used as is


def test_ensure_model_refuses_a_missing_path_unless_asked(tmp_path):
    cfg = load_config(None, [f"model.path={tmp_path / 'nope'}"])
    with pytest.raises(ConfigError, match="does not exist; point it at a local model directory"):
        ensure_model(cfg)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file.txt").write_text("x")
    cfg = load_config(None, [f"model.path={tmp_path / 'junk'}", "model.create_if_missing=true"])
    with pytest.raises(ConfigError, match=r"holds neither config\.json nor model_index\.json"):
        ensure_model(cfg)


def test_the_warm_start_is_decided_by_steps_so_one_core_builds_the_model_two_do(tiny_model_dir, tmp_path):
    """The same recipe warm-starts the same model, byte for byte, on one core (taskset) as on
    this machine's cores: steps and the target decide where it stops, and its thread count is
    the recipe's (train.threads), not the machine's."""
    import shutil
    import subprocess
    import sys

    if shutil.which("taskset") is None:
        pytest.skip("taskset is not installed")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  task: reverse\n  difficulty: 3\n  num_train: 400\n  num_eval: 20\n"
                      "warmstart:\n  max_steps: 30\n  eval_every: 10\n  batch_size: 16\n"
                      "  target_pass_rate: 1.0\n")
    outs = {}
    for name, prefix in (("two", []), ("one", ["taskset", "-c", "0"])):
        outs[name] = tmp_path / name
        subprocess.run([*prefix, sys.executable, "-m", "tether.cli.main", "warmstart", str(recipe), "--model",
                        str(tiny_model_dir), "--out", str(outs[name])], check=True, capture_output=True,
                       timeout=240)
    a, b = ((outs[n] / "model.safetensors").read_bytes() for n in ("two", "one"))
    assert a == b
    steps = [json.loads((outs[n] / "warmstart.json").read_text())["steps"] for n in ("two", "one")]
    assert steps == [30, 30]


def test_the_time_ceiling_says_when_it_fires(tiny_model_dir, tmp_path, caplog):
    import logging

    task = get_task("reverse")
    caplog.set_level(logging.WARNING, logger="tether")
    result = warmstart(tiny_model_dir, task.examples("train", 200, seed=0, difficulty=3),
                       task.examples("eval", 10, seed=0, difficulty=3), scorer("task", task="reverse"),
                       out_dir=tmp_path / "warm", settings=WarmstartSection(max_steps=50, max_seconds=1e-3))
    assert result.stopped_because == "max_seconds" and result.steps == 1
    said = [r.getMessage() for r in caplog.records if "safety ceiling" in r.getMessage()]
    assert len(said) == 1 and "warmstart.max_seconds=0.001 after 1 of at most 50 steps" in said[0]


def test_a_warm_start_that_ends_short_of_its_target_says_so(tiny_model_dir, tmp_path, caplog):
    import logging

    task = get_task("reverse")
    caplog.set_level(logging.WARNING, logger="tether")
    examples = (task.examples("train", 200, seed=0, difficulty=3),
                task.examples("eval", 10, seed=0, difficulty=3))
    for target, warned in ((0.9, True), (1.0, False)):  # 1: stop by steps, on purpose
        caplog.clear()
        result = warmstart(tiny_model_dir, *examples, scorer("task", task="reverse"),
                           out_dir=tmp_path / f"warm-{target}",
                           settings=WarmstartSection(max_steps=2, eval_every=1, target_pass_rate=target))
        assert result.stopped_because == "max_steps" and result.pass_at_1_after < 0.9
        said = [r.getMessage() for r in caplog.records
                if "short of warmstart.target_pass_rate" in r.getMessage()]
        assert len(said) == int(warned), target
        if warned:
            assert "all warmstart.max_steps=2 steps" in said[0] and "raise warmstart.max_steps" in said[0]
