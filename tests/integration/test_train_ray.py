"""`tether train` with rollout.backend=ray on a local Ray instance: same schedule, resume, faults."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("ray")

from test_train import ROOT, _descendants, _wait_for_training, recipe, rows

from procs import wait_gone
from tether.config import load_config
from tether.loop import Timings, simulate, summarize
from tether.runtime.run import train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
RAY = ["rollout.backend=ray", "ray.local_cpus=2"]
KEYS = ("step", "batch_index", "async/behavior_version", "async/train_version", "staleness/updates",
        "staleness/batches", "reward/mean", "loss/policy")


BASE = ["async.max_staleness=1", "async.max_inflight=2"]


@pytest.fixture(scope="module")
def local_run(tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("local") / "run"
    summary = train(load_config(None, recipe(tiny_model_dir, *BASE)), run_dir, progress_plain=True)
    return run_dir, summary


@pytest.mark.parametrize("learner", ["driver", "actor"])
def test_ray_backend_trains_batch_for_batch_like_local_and_resumes(tiny_model_dir, tmp_path, local_run,
                                                                   learner):
    local_dir, local = local_run
    parts = tmp_path / "ray"
    train(load_config(None, recipe(tiny_model_dir, *BASE, *RAY, f"ray.learner={learner}",
                                   "train.num_batches=3")), parts, progress_plain=True)
    assert (parts / "ray").exists()  # the local instance kept its logs with the run
    resumed = train(load_config(parts / "config.yaml", ["train.num_batches=6"]), parts, resume=True,
                    progress_plain=True)
    a = [{k: m[k] for k in KEYS} for m in rows(local_dir / "metrics.jsonl")]
    b = [{k: m[k] for k in KEYS} for m in rows(parts / "metrics.jsonl")]
    assert a == b  # same prompts, versions, samples and losses across backends and a resume
    plan = simulate(load_config(None, recipe(tiny_model_dir, *BASE)).budget(), Timings())
    assert [m["staleness/updates"] for m in b] == [r.staleness_updates for r in plan.trace.records]
    assert local["syncs_after"] == summarize(plan)["syncs_after"]
    assert resumed["trained_batches"] == 6
    evals = rows(parts / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 3, 6]
    local_evals = rows(local_dir / "eval.jsonl")
    assert [e["eval/pass_at_1"] for e in evals] == [e["eval/pass_at_1"] for e in local_evals]
    assert {"sync/put_s", "sync/load_s"} <= set(rows(parts / "metrics.jsonl")[-1])
    assert sorted(p.name for p in (parts / "checkpoints").iterdir()) == ["step-000003", "step-000006"]


def _actor_pids(pids, kind: bytes):
    out = []
    for p in pids:
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue
        if kind in cmd:
            out.append(p)
    return out


@pytest.mark.parametrize(("kind", "message"), [
    ("_RolloutActor", "worker rollout-0"),
    ("_LearnerActor", "the learner's Ray actor"),
])
def test_a_killed_actor_fails_the_run_clearly_and_leaves_nothing_running(tiny_model_dir, tmp_path, kind,
                                                                         message):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tether.cli.main", "train", "--run-dir", str(run_dir), "--plain",
         "--no-report",
         *recipe(tiny_model_dir, "train.num_batches=400", "eval.interval=0", "checkpoint.interval=1", *RAY,
                 "ray.learner=actor", "rollout.on_worker_loss=stop")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_training(run_dir, proc, timeout=180)
        family = _descendants(proc.pid)
        deadline = time.monotonic() + 30
        while not (actors := _actor_pids(family, kind.encode())) and time.monotonic() < deadline:
            time.sleep(0.2)
            family = _descendants(proc.pid)
        assert actors, f"no {kind} among the run's processes"
        for p in actors:
            os.kill(p, signal.SIGKILL)
        _out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err[-3000:]
    assert message in err and "Ray actor" in err and "died" in err, err[-3000:]
    assert wait_gone(family, timeout=30) == []
    assert not (run_dir / "summary.json").exists()  # a failed run writes no summary
    # the run resumes from its last checkpoint, on a fresh local instance
    newest = sorted((run_dir / "checkpoints").iterdir())[-1]
    trained = json.loads((newest / "state.json").read_text())["trained_batches"]
    summary = train(load_config(run_dir / "config.yaml", [f"train.num_batches={trained + 2}"]), run_dir,
                    resume=True, progress_plain=True)
    assert summary["trained_batches"] == trained + 2
    assert [m["step"] for m in rows(run_dir / "metrics.jsonl")] == list(range(1, trained + 3))


def test_a_learner_actor_on_cuda_without_a_gpu_in_the_cluster_is_refused_at_start(tiny_model_dir, tmp_path):
    import ray

    from tether.errors import ConfigError

    cfg = load_config(None, recipe(tiny_model_dir, *RAY, "ray.learner=actor", "train.device=cuda"))
    with pytest.raises(ConfigError, match="asks the Ray cluster for a GPU, and it has 0") as info:
        train(cfg, tmp_path / "run", progress_plain=True)
    assert "set train.device=cpu" in str(info.value)
    assert not ray.is_initialized()  # the instance the run started is shut down
