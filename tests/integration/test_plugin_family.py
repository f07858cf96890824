"""A third family, defined entirely in the test suite (``tests/plugins/bandit.py``: one module, one
``register_family`` call), trains through ``tether train`` end to end, follows ``tether plan``,
checkpoints, and resumes exactly — with nothing of Tether's own code knowing it exists."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
PLUGIN = Path(__file__).resolve().parents[1] / "plugins" / "bandit.py"
KEYS = ("step", "batch_index", "async/behavior_version", "staleness/updates", "reward/mean", "loss/policy",
        "train/grad_norm")


def tether(*args, check=True):
    out = subprocess.run([sys.executable, "-m", "tether.cli.main", *map(str, args)], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    if check:
        assert out.returncode == 0, out.stderr[-3000:]
    return out


def write_recipe(tmp_path, *extra: str) -> Path:
    recipe = tmp_path / "bandit.yaml"
    recipe.write_text("\n".join([
        "run:", f"  plugins: [{PLUGIN}]",
        "model:", "  family: bandit", f"  path: {tmp_path / 'model'}", "  create_if_missing: true",
        "data:", "  task: arms", "  num_train: 400", "  num_eval: 32",
        "rollout:", "  batch_size: 4", "  group_size: 8",
        "async:", "  max_staleness: 1", "  max_inflight: 2",
        "train:", "  num_batches: 12", "  lr: 0.1", "  algorithm: grpo", "  kl_coef: 0.0",
        "eval:", "  interval: 6", "checkpoint:", "  interval: 4", *extra]) + "\n")
    return recipe


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_a_family_from_a_plugin_trains_follows_the_plan_and_resumes_exactly(tmp_path):
    recipe = write_recipe(tmp_path)
    whole = tmp_path / "whole"
    out = tether("train", recipe, "--run-dir", whole, "--plain", "--no-report")
    assert "built a bandit of 8 arms" in out.stderr
    metrics = rows(whole / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 13))
    evals = rows(whole / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 6, 12]
    assert evals[-1]["eval/pass_at_1"] > evals[0]["eval/pass_at_1"]  # it learned which arm to pull
    assert sorted(p.name for p in (whole / "checkpoints").iterdir())[-1] == "step-000012"

    # `tether plan` on the same recipe (told which updates committed: a batch whose groups all
    # scored alike has nothing to learn from): the run's staleness per batch, and its publications
    commits = ",".join(str(int(m["async/optimizer_updates"])) for m in metrics)
    plan = json.loads(tether("plan", recipe, f"plan.commits=[{commits}]", "--json").stdout)
    assert [m["staleness/updates"] for m in metrics] == [b["staleness_updates"] for b in plan["batches"]]
    assert json.loads((whole / "summary.json").read_text())["syncs_after"] == plan["syncs_after"]

    # stopped after 4 batches, resumed: the same run, row for row
    parts = tmp_path / "parts"
    tether("train", recipe, "train.num_batches=4", "--run-dir", parts, "--plain", "--no-report")
    tether("train", "--resume", parts, "train.num_batches=12", "--plain", "--no-report")
    assert [{k: m[k] for k in KEYS} for m in rows(parts / "metrics.jsonl")] == [
        {k: m[k] for k in KEYS} for m in metrics]
    resumed = {e["step"]: e["eval/pass_at_1"] for e in rows(parts / "eval.jsonl")}  # and one at its stop, 4
    assert [resumed[e["step"]] for e in evals] == [e["eval/pass_at_1"] for e in evals]

    # `tether eval` reads the checkpoint with the family's own loader and evaluator
    scored = json.loads(tether("eval", whole, "--json").stdout)
    assert scored["eval/pass_at_1"] == evals[-1]["eval/pass_at_1"]


def test_a_plugin_familys_limits_are_refused_from_what_it_declares(tmp_path):
    recipe = write_recipe(tmp_path)
    out = tether("train", recipe, "rollout.temperature=0.5", check=False)
    assert out.returncode == 2
    assert ("rollout.temperature=0.5 asks for sampling tokens, which model.family=bandit does not have"
            in out.stderr)
    out = tether("train", recipe, "rollout.backend=ray", check=False)
    assert "rollout.backend=ray: model.family=bandit runs with rollout.backend local only" in out.stderr
    out = tether("train", recipe, "data.task=arithmetic", check=False)
    assert "data.task=arithmetic is a task of model.family=text; model.family=bandit has: arms" in out.stderr
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no')\n")
    out = tether("train", recipe, f"run.plugins=[{broken}]", check=False)
    assert out.returncode == 2 and "failed to import: RuntimeError: no" in out.stderr
