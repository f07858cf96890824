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
    with pytest.raises(ConfigError, match=r"holds no config\.json"):
        ensure_model(cfg)
