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


WORKERS_ONLY = """
import os
import sys

# the driver imports this first and marks itself; the processes it starts import it again
if os.environ.setdefault("TETHER_TEST_DRIVER_PID", str(os.getpid())) != str(os.getpid()):
    sys.exit(5)
"""

LOSSES = """
import tether


@tether.register_loss("mean_only")
def mean_only(x, s):  # reduced: it would train, on a scalar broadcast over every column
    return (-x.advantages[:, None] * x.logp * x.mask).mean(), {}


@tether.register_loss("nan_loss")
def nan_loss(x, s):
    return -x.advantages[:, None] * x.logp * float("nan"), {}
"""


def test_a_plugin_failing_in_a_worker_or_a_loss_breaking_its_contract_stops_the_run_naming_it(tmp_path):
    """A plug-in that imports in the driver and exits in the rollout worker is the worker's failure
    to start, named (not a silent exit); a plug-in's loss that returns one number, or NaN, stops
    the run at its first call, naming the loss and what to change."""
    recipe = write_recipe(tmp_path)
    (tmp_path / "workers_only.py").write_text(WORKERS_ONLY)
    (tmp_path / "losses.py").write_text(LOSSES)
    out = tether("train", recipe, f"run.plugins=[{PLUGIN}, {tmp_path / 'workers_only.py'}]", "--run-dir",
                 tmp_path / "exits", "--plain", "--no-report", check=False)
    assert out.returncode == 2, out.stderr[-3000:]
    assert (f"worker rollout-0: failed to start: PluginError: run.plugins: {tmp_path / 'workers_only.py'} "
            "failed to import: SystemExit: 5 at ") in out.stderr
    assert "Traceback" not in out.stderr
    plugins = f"run.plugins=[{PLUGIN}, {tmp_path / 'losses.py'}]"
    out = tether("train", recipe, plugins, "train.loss=mean_only", "--run-dir", tmp_path / "mean",
                 "--plain", "--no-report", check=False)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "train.loss=mean_only (a plug-in's loss, " in out.stderr
    assert "returned a tensor of shape () as its losses; it must return one loss per column" in out.stderr
    out = tether("train", recipe, plugins, "train.loss=nan_loss", "--run-dir", tmp_path / "nan",
                 "--plain", "--no-report", check=False)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "train.loss=nan_loss (a plug-in's loss, " in out.stderr
    assert "returned non-finite losses: NaN or infinite in 32 of its 32 values" in out.stderr
    assert rows(tmp_path / "nan" / "metrics.jsonl") == []  # stopped in its first batch, not after all 12
    assert "Traceback" not in out.stderr
