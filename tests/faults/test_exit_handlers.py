"""A finished run's rollout workers and learner ranks exit through their own exit handlers, so a
library's named semaphores are unlinked there: nothing is left to multiprocessing's resource
tracker, which would unlink it and warn the user of a leak. A worker ended mid-batch, when a stop
closes its lifeline, unlinks them before it exits."""

import signal
import time

import pytest

pytest.importorskip("torch")

from runs import HANG, ROOT, Run, recipe

from procs import shm_left

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PLUGIN = ROOT / "tests" / "faults" / "named_semaphore.py"


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_finished_run_leaves_nothing_to_the_resource_tracker(tiny_model_dir, tmp_path, world_size):
    run_dir = tmp_path / "run"
    keys = recipe(tiny_model_dir, f"run.plugins=[{PLUGIN}]", "train.num_batches=2", "checkpoint.interval=0",
                  f"train.world_size={world_size}")
    run = Run([*keys, "--run-dir", str(run_dir)], run_dir=run_dir)
    out, err = run.proc.communicate(timeout=240)
    assert run.proc.returncode == 0, err[-3000:]
    assert "trained 2 batches" in out + err
    assert "resource_tracker" not in err, err[-3000:]


def test_a_worker_stopped_mid_batch_leaves_nothing_to_the_resource_tracker(tiny_model_dir, tmp_path,
                                                                           monkeypatch):
    """The reward makes a lock (a named semaphore) and never returns, so the worker is inside a
    batch when SIGTERM stops the driver: the closed lifeline ends it at once, not through its exit
    handlers, and it unlinks the semaphore first."""
    run_dir, made = tmp_path / "run", tmp_path / "lock-made"
    monkeypatch.setenv("HANG_LOCK_MADE", str(made))
    keys = recipe(tiny_model_dir, f"reward.function={HANG}:holding_a_lock")
    run = Run([*keys, "--run-dir", str(run_dir)], run_dir=run_dir)
    deadline = time.monotonic() + 120
    while not made.exists() and time.monotonic() < deadline:
        run.look()
        time.sleep(0.05)
    assert made.exists(), run.finish()[1][-3000:]  # the worker made its lock and sleeps in the reward
    run.proc.send_signal(signal.SIGTERM)
    _out, err = run.finish(timeout=60)
    assert run.proc.returncode == 143, err[-3000:]
    assert "stopped by SIGTERM" in err
    assert "resource_tracker" not in err and "leaked" not in err, err[-3000:]
    assert run.left() == ""
    assert shm_left(run.shm) == []
