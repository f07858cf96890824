"""`tether tasks`, `tether init-model` and `tether warmstart` as a user runs them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
TETHER = [sys.executable, "-m", "tether.cli.main"]
ROOT = Path(__file__).resolve().parents[2]


def run(*args, check=True):
    return subprocess.run([*TETHER, *args], capture_output=True, text=True, check=check, cwd=ROOT)


def test_tasks_lists_every_task_with_a_sample():
    rows = json.loads(run("tasks", "--json").stdout)
    assert [(r["name"], r["family"]) for r in rows] == [
        ("arithmetic", "text"), ("countdown", "text"), ("reverse", "text"), ("sort", "text"),
        ("repeat", "text"), ("question", "text"), ("chat_sum", "text"), ("shapes", "flow"),
        ("kv_lookup", "agent"), ("guess_number", "agent"), ("tool_calc", "agent")]
    for r in rows:
        assert r["sample_prompt"] and r["sample_answer"]
    text = run("tasks").stdout
    assert "countdown  (model.family=text" in text and "shapes  (model.family=flow" in text and "e.g." in text
    assert "kv_lookup  (model.family=agent" in text


def test_init_model_then_warmstart_from_a_recipe(tmp_path):
    pytest.importorskip("transformers")
    out = run("init-model", str(tmp_path / "m"), "--size", "tiny")
    assert "parameters" in out.stdout
    again = run("init-model", str(tmp_path / "m"), "--size", "tiny", check=False)
    assert again.returncode == 2 and "already exists" in again.stderr
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  task: reverse\n  difficulty: 3\n  num_train: 800\n  num_eval: 30\n"
                      "warmstart:\n  max_steps: 40\n  eval_every: 20\n  batch_size: 32\n")
    res = run("warmstart", str(recipe), "--model", str(tmp_path / "m"), "--out", str(tmp_path / "w"))
    assert "held-out pass@1" in res.stdout
    summary = json.loads((tmp_path / "w" / "warmstart.json").read_text())
    assert summary["steps"] == 40 or summary["stopped_because"] == "target_pass_rate"
    assert "warmstart:" in res.stderr  # plain progress lines when not on a terminal
    bad = run("warmstart", str(recipe), "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "x"),
              check=False)
    assert bad.returncode == 2 and "not a model directory" in bad.stderr
    # a family that builds and warm-starts its own models says so (FamilyBase.warmstart)
    flow = run("warmstart", "model.family=flow", "data.task=shapes", "--model", str(tmp_path / "m"), "--out",
               str(tmp_path / "f"), check=False)
    assert flow.returncode == 2
    assert "model.family=flow builds and warm-starts its models itself" in flow.stderr
