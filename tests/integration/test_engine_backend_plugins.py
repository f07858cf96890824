"""A third engine and a second kind of backend, each one file of the test suite registered from
outside (``tests/plugins/hf_engine.py``: transformers' ``generate`` with its own log-probs;
``tests/plugins/thread_backend.py``: rollout workers as threads of the driver), train through
``tether train``, follow ``tether plan`` and resume exactly — nothing of Tether's own code knowing
they exist — and what they do not declare is refused when the recipe is read."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
HF, THREADS = PLUGINS / "hf_engine.py", PLUGINS / "thread_backend.py"
REWARD = Path(__file__).parent / "varied_reward.py"
KEYS = ("step", "batch_index", "async/behavior_version", "staleness/updates", "reward/mean", "loss/policy",
        "train/grad_norm")


def tether(*args, check=True):
    out = subprocess.run([sys.executable, "-m", "tether.cli.main", *map(str, args)], cwd=ROOT,
                         capture_output=True, text=True, timeout=500)
    if check:
        assert out.returncode == 0, out.stderr[-3000:]
    return out


def recipe(model_dir, *extra):
    """The fast text recipe of tests/integration/test_train.py, 6 batches at staleness 1."""
    return [f"model.path={model_dir}", f"reward.function={REWARD}:reward", "data.task=reverse",
            "data.difficulty=3", "data.num_train=300", "data.num_eval=20", "rollout.batch_size=2",
            "rollout.group_size=2", "rollout.max_new_tokens=4", "train.lr=1e-3", "train.num_batches=6",
            "async.max_staleness=1", "async.max_inflight=2", "eval.interval=3", "checkpoint.interval=2",
            *extra]


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def trains_follows_the_plan_and_resumes_exactly(tmp_path, args):
    whole = tmp_path / "whole"
    tether("train", *args, "--run-dir", whole, "--plain", "--no-report")
    metrics = rows(whole / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 7))
    assert [e["step"] for e in rows(whole / "eval.jsonl")] == [0, 3, 6]

    commits = ",".join(str(int(m["async/optimizer_updates"])) for m in metrics)
    plan = json.loads(tether("plan", *args, f"plan.commits=[{commits}]", "--json").stdout)
    assert [m["staleness/updates"] for m in metrics] == [b["staleness_updates"] for b in plan["batches"]]
    assert json.loads((whole / "summary.json").read_text())["syncs_after"] == plan["syncs_after"]

    parts = tmp_path / "parts"
    tether("train", *args, "train.num_batches=2", "--run-dir", parts, "--plain", "--no-report")
    tether("train", "--resume", parts, "train.num_batches=6", "--plain", "--no-report")
    assert [{k: m[k] for k in KEYS} for m in rows(parts / "metrics.jsonl")] == [
        {k: m[k] for k in KEYS} for m in metrics]
    return whole


def test_an_engine_from_a_plugin_trains_follows_the_plan_and_resumes_exactly(tiny_model_dir, tmp_path):
    args = recipe(tiny_model_dir, f"run.plugins=[{HF}]", "rollout.engine=hf")
    whole = trains_follows_the_plan_and_resumes_exactly(tmp_path, args)
    recorded = (whole / "config.yaml").read_text()
    assert "engine: hf" in recorded and "hf:\n  use_cache: true" in recorded  # its own section, recorded


def test_a_backend_from_a_plugin_trains_follows_the_plan_and_resumes_exactly(tiny_model_dir, tmp_path):
    args = recipe(tiny_model_dir, f"run.plugins=[{THREADS}]", "rollout.backend=threads")
    whole = trains_follows_the_plan_and_resumes_exactly(tmp_path, args)
    assert "backend: threads" in (whole / "config.yaml").read_text()


def test_what_a_plugin_engine_or_backend_does_not_declare_is_refused_at_load(tiny_model_dir, tmp_path):
    engine = recipe(tiny_model_dir, f"run.plugins=[{HF}]", "rollout.engine=hf")
    out = tether("train", *engine, "async.inflight_update=keep", check=False)
    assert out.returncode == 2
    assert ("async.inflight_update=keep: rollout.engine=hf runs with async.inflight_update drain only "
            "(transformers' generate runs a whole generation at once); set one of them, or rollout.engine "
            "torch or vllm") in out.stderr
    out = tether("train", *engine, "train.lora_rank=4", check=False)
    assert "train.lora_rank=4: rollout.engine=hf does not sample from LoRA adapters" in out.stderr
    out = tether("train", *engine, "rollout.top_k=5", check=False)  # its own check
    assert "rollout.engine=hf samples at rollout.temperature alone" in out.stderr
    out = tether("train", *recipe(tiny_model_dir, f"run.plugins=[{HF}]"), "hf.use_cache=false", check=False)
    assert "the hf section is set, but it is read only with rollout.engine=hf" in out.stderr
    backend = recipe(tiny_model_dir, f"run.plugins=[{THREADS}]", "rollout.backend=threads")
    out = tether("train", *backend, "async.inflight_update=abort", check=False)
    assert ("async.inflight_update=abort: rollout.backend=threads runs with async.inflight_update drain only "
            "(its workers take weights only between batches)") in out.stderr
    out = tether("train", *backend, "train.threads=2", check=False)
    assert "set rollout.threads_per_worker=2 (train.threads)" in out.stderr
