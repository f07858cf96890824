"""`tether train` with rollout.backend=ray on a local Ray instance: same schedule, resume, faults."""

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

from procs import wait_gone
from test_train import ROOT, _descendants, _wait_for_training, recipe, rows

from tether.config import load_config
from tether.loop import Timings, simulate, summarize
from tether.runtime.run import train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
RAY = ["rollout.backend=ray", "ray.local_cpus=2"]
KEYS = ("step", "batch_index", "async/behavior_version", "async/train_version", "staleness/updates",
        "staleness/batches", "reward/mean", "loss/policy")


def test_ray_backend_trains_batch_for_batch_like_local_and_resumes(tiny_model_dir, tmp_path):
    base = ["async.max_staleness=1", "async.max_inflight=2"]
    local = train(load_config(None, recipe(tiny_model_dir, *base)), tmp_path / "local", progress_plain=True)
    parts = tmp_path / "ray"
    train(load_config(None, recipe(tiny_model_dir, *base, *RAY, "train.num_batches=3")), parts,
          progress_plain=True)
    assert (parts / "ray").exists()  # the local instance kept its logs with the run
    resumed = train(load_config(parts / "config.yaml", ["train.num_batches=6"]), parts, resume=True,
                    progress_plain=True)
    a = [{k: m[k] for k in KEYS} for m in rows(tmp_path / "local" / "metrics.jsonl")]
    b = [{k: m[k] for k in KEYS} for m in rows(parts / "metrics.jsonl")]
    assert a == b  # same prompts, versions, samples and losses across backends and a resume
    cfg = load_config(None, recipe(tiny_model_dir, *base))
    plan = simulate(cfg.budget(), Timings())
    assert [m["staleness/updates"] for m in rows(parts / "metrics.jsonl")] == \
        [r.staleness_updates for r in plan.trace.records]
    assert local["syncs_after"] == summarize(plan)["syncs_after"]
    assert resumed["trained_batches"] == 6
    assert [e["step"] for e in rows(parts / "eval.jsonl")] == [0, 3, 6]
    assert {"sync/put_s", "sync/load_s"} <= set(rows(parts / "metrics.jsonl")[-1])


def _actor_pids(pids):
    out = []
    for p in pids:
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue
        if b"_RolloutActor" in cmd:
            out.append(p)
    return out


def test_a_killed_actor_fails_the_run_clearly_and_leaves_nothing_running(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tether.cli.main", "train", "--run-dir", str(run_dir), "--plain",
         "--no-report",
         *recipe(tiny_model_dir, "train.num_batches=400", "eval.interval=0", "checkpoint.interval=50", *RAY)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_training(run_dir, proc, timeout=180)
        family = _descendants(proc.pid)
        deadline = time.monotonic() + 30
        while not (actors := _actor_pids(family)) and time.monotonic() < deadline:
            time.sleep(0.2)
            family = _descendants(proc.pid)
        assert actors, "no rollout actor among the run's processes"
        for p in actors:
            os.kill(p, signal.SIGKILL)
        _out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err[-3000:]
    assert "worker rollout-0" in err and "Ray actor" in err and "died" in err, err[-3000:]
    assert wait_gone(family, timeout=30) == []
    assert not (run_dir / "summary.json").exists()  # a failed run writes no summary
