"""Fault injection on real `tether train` processes: signals, a killed driver, a second process on
the same run directory, a generation that never ends. Each test checks the exit status and the
message, that no process of the run is left (found by the run's environment mark, not by name),
that no shared-memory segment is left, and what the run directory holds."""

import json
import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from runs import HANG, Run, leftovers, newest_state, recipe, rows

from procs import describe, environ_value, kernel_name, shm_left

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_sigterm_stops_like_ctrl_c_and_a_second_process_is_refused_the_run_directory(tiny_model_dir,
                                                                                     tmp_path):
    run_dir = tmp_path / "run"
    run = Run(["--run-dir", str(run_dir), *recipe(tiny_model_dir)], run_dir=run_dir)
    run.wait_for_rows(3)
    assert run.shm, "the weight channel is a shared-memory segment mapped by the run"
    # a resume of the same directory while it trains is refused, naming the holder, and harms nothing
    second = Run(["--resume", str(run_dir)])
    _out, err = second.finish(timeout=120)
    assert second.proc.returncode == 2, err[-2000:]
    assert f"is in use by another process (pid {run.proc.pid}" in err
    assert second.left() == ""
    before = len(rows(run_dir / "metrics.jsonl"))
    run.proc.send_signal(signal.SIGTERM)
    _out, err = run.finish(timeout=60)
    assert run.proc.returncode == 143, err[-3000:]
    assert "stopped by SIGTERM" in err and f"resume with `tether train --resume {run_dir}`" in err
    for noise in ("Traceback", "BrokenPipeError", "leaked"):
        assert noise not in err, err[-3000:]
    assert run.left() == ""
    assert shm_left(run.shm) == []
    # nothing lost: every trained batch has its row, and the final checkpoint counts exactly them
    metrics = rows(run_dir / "metrics.jsonl")
    assert len(metrics) >= before and [m["step"] for m in metrics] == list(range(1, len(metrics) + 1))
    ckpt, state = newest_state(run_dir)
    assert state["trained_batches"] == len(metrics)
    lagging = state["rollout_version"] != state["train_version"]
    assert (ckpt / "published.safetensors").is_file() == lagging
    assert leftovers(run_dir) == []
    assert any(e["kind"] == "save" and e.get("final") for e in rows(run_dir / "events.jsonl"))
    starts = rows(run_dir / "starts.jsonl")
    assert len(starts) == 1 and starts[0]["resumed_from"] is None  # the refused resume recorded nothing


def test_a_killed_driver_takes_its_workers_with_it_and_the_run_resumes(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    run = Run(["--run-dir", str(run_dir), *recipe(tiny_model_dir, "checkpoint.interval=2")], run_dir=run_dir)
    run.wait_for_rows(5)
    pids = run.look()
    assert len(pids) >= 3  # the driver, the forkserver, the worker (and the resource tracker)
    os.kill(run.proc.pid, signal.SIGKILL)
    run.finish()
    t0 = time.monotonic()
    assert run.left() == ""
    assert time.monotonic() - t0 < 10  # not after the worker's batch or a timeout: at once
    assert shm_left(run.shm) == []
    # the lock died with the process; a leftover of an interrupted save is cleaned on the next start
    _ckpt, state = newest_state(run_dir)
    (run_dir / "checkpoints" / ".tmp-step-000099-1").mkdir()
    ((run_dir / "checkpoints" / ".tmp-step-000099-1") / "partial").write_bytes(b"\0" * 1000)
    resumed = Run(["--resume", str(run_dir), f"train.num_batches={state['trained_batches'] + 2}"])
    _out, err = resumed.finish(timeout=180)
    assert resumed.proc.returncode == 0, err[-3000:]
    assert leftovers(run_dir) == []
    trained = state["trained_batches"]
    assert [m["step"] for m in rows(run_dir / "metrics.jsonl")] == list(range(1, trained + 3))
    assert resumed.left() == ""


def test_a_stop_during_worker_start_up_leaves_no_process_and_no_stray_error(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    run = Run(["--run-dir", str(run_dir), *recipe(tiny_model_dir)], run_dir=run_dir)
    deadline = time.monotonic() + 120
    while len(run.look()) < 2 and time.monotonic() < deadline:  # the forkserver is starting workers
        time.sleep(0.02)
    assert run.proc.poll() is None, run.finish()[1][-3000:]
    run.proc.send_signal(signal.SIGINT)
    _out, err = run.finish(timeout=60)
    end = time.monotonic() + 3
    while time.monotonic() < end:  # a worker forked after the driver left must not appear and linger
        run.look()
        time.sleep(0.05)
    assert run.proc.returncode == 130, err[-3000:]
    assert "stopped by SIGINT" in err
    assert "Traceback" not in err and "FileNotFoundError" not in err, err[-3000:]
    assert run.left() == ""
    assert shm_left(run.shm) == []
    assert not (run_dir / "checkpoints").exists() or leftovers(run_dir) == []


def test_wait_timeout_fires_on_time_naming_the_worker_and_the_setting(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    run = Run(["--run-dir", str(run_dir), *recipe(tiny_model_dir, f"reward.function={HANG}:reward",
                                                   "async.wait_timeout_s=3")], run_dir=run_dir)
    deadline = time.monotonic() + 120
    while not (run_dir / "events.jsonl").is_file() and time.monotonic() < deadline:
        run.look()
        time.sleep(0.05)
    t0 = time.monotonic()  # the run is set up: from here it should wait 3 s, not 60 more
    _out, err = run.finish(timeout=120)
    waited = time.monotonic() - t0
    assert run.proc.returncode == 2, err[-3000:]
    assert "no rollout batch completed within async.wait_timeout_s=3s" in err
    assert "worker rollout-0" in err and "batch 0" in err
    # what this guards against: a drain after the timeout used to add a fixed 60 s. The bound is
    # that, not a measure of speed, so a loaded machine (setting up, tearing down) cannot fail it
    assert waited < 60, waited
    assert err.count("no rollout batch completed within") == 1, err[-3000:]
    assert run.left() == ""
    assert shm_left(run.shm) == []
    assert rows(run_dir / "metrics.jsonl") == [] and not (run_dir / "summary.json").exists()
    assert json.loads((run_dir / "starts.jsonl").read_text().splitlines()[0])["resumed_from"] is None


@pytest.mark.parametrize(("signum", "code"),
                         [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGKILL, -9)])
def test_a_ray_run_stops_on_a_signal_and_its_ray_instance_goes_with_it(tiny_model_dir, tmp_path, signum,
                                                                          code):
    """Ray installs its own SIGTERM handler (a stack dump, exit 134) and its agents outlive a
    killed driver by a minute; the run takes both back."""
    pytest.importorskip("ray")
    run_dir = tmp_path / "run"
    run = Run(["--run-dir", str(run_dir), *recipe(tiny_model_dir, "rollout.backend=ray", "ray.local_cpus=2")],
              run_dir=run_dir)
    run.wait_for_rows(3, timeout=180)
    # the driver, Ray's GCS and raylet, its agents (whose environment /proc cannot show), the actor
    assert "ray::DashboardAgent" in describe(run.look())
    from tether.procinfo import MARKS_ENV

    marks = environ_value(run.look(), MARKS_ENV)  # the folder the supervisor made for its child
    assert marks is not None and os.path.isdir(marks)
    run.proc.send_signal(signum)
    _out, err = run.finish(timeout=90)
    assert run.proc.returncode == code, err[-3000:]
    assert run.left() == ""  # after a SIGKILL too: the reaper kills the instance at once
    assert shm_left(run.shm) == []
    assert not os.path.exists(marks)  # after a SIGKILL of the supervisor too: its child removes it
    # the instance ran under /tmp (the run directory's path is too long for Ray's sockets); its
    # logs come home to the run's `ray` folder, after a SIGKILL too (the reaper moves them)
    from tether.rollout.backends.ray.cluster import ray_temp_dir

    temp_dir, link = ray_temp_dir(run_dir)
    assert link is not None, "the test's run directory should be too long for Ray's sockets"
    deadline = time.monotonic() + 30
    while Path(temp_dir).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(temp_dir).exists()
    assert not (run_dir / "ray").is_symlink() and list((run_dir / "ray").glob("session_*/logs/raylet.out"))
    if signum == signal.SIGKILL:
        return
    assert f"stopped by {signal.Signals(signum).name}" in err and "SIGTERM received" not in err, err[-3000:]
    assert "could not be written" not in err, err[-3000:]
    ckpt, state = newest_state(run_dir)
    assert state["trained_batches"] == len(rows(run_dir / "metrics.jsonl"))
    # the engines' weights come back from the actors' snapshot when they were behind the learner
    lagging = state["rollout_version"] != state["train_version"]
    assert (ckpt / "published.safetensors").is_file() == lagging


def test_a_killed_raylet_is_reported_as_a_tether_error_and_leaves_nothing(tiny_model_dir, tmp_path):
    """Ray ends its driver at once, silently, when the raylet dies; `tether train` supervises a
    Ray run from a parent process that says what happened and how to continue."""
    pytest.importorskip("ray")
    run_dir = tmp_path / "run"
    run = Run(["--run-dir", str(run_dir), *recipe(tiny_model_dir, "rollout.backend=ray", "ray.local_cpus=2",
                                                   "checkpoint.interval=2")], run_dir=run_dir)
    run.wait_for_rows(3, timeout=180)
    assert "ray::RuntimeEnvAgent" in describe(run.look())
    raylets = []
    for pid in run.look():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[0].endswith(b"/raylet"):
                    raylets.append(pid)
        except OSError:
            continue
    assert len(raylets) == 1
    os.kill(raylets[0], signal.SIGKILL)
    _out, err = run.finish(timeout=90)
    assert run.proc.returncode == 2, err[-3000:]
    # Ray either ends the driver at once (the supervisor reports it) or first tells it that the
    # rollout actor died (a Tether error naming the actor): either way the error says how to go on
    assert ("without a Tether error" in err and "raylet died" in err) or (
        "Ray actor" in err and "died" in err), err[-3000:]
    assert f"tether train --resume {run_dir}`" in err, err[-3000:]
    assert run.left() == ""
    assert shm_left(run.shm) == []
    _ckpt, state = newest_state(run_dir)
    assert state["trained_batches"] <= len(rows(run_dir / "metrics.jsonl"))


@pytest.mark.parametrize("signum", [signal.SIGINT, None], ids=["ctrl-c", "rank-killed"])
def test_learner_ranks_stop_with_the_run_and_a_killed_rank_is_named(tiny_model_dir, tmp_path, signum):
    """train.world_size=2: Ctrl-C stops the ranks in order after the final checkpoint; a rank
    killed mid-run fails the run naming it, and every rank and worker is gone."""
    run_dir = tmp_path / "run"
    args = recipe(tiny_model_dir, "train.world_size=2", "checkpoint.interval=2")
    run = Run(["--run-dir", str(run_dir), *args], run_dir=run_dir)
    run.wait_for_rows(3, timeout=180)
    ranks = [str(pid) for name in ("tether-rank-0", "tether-rank-1") for pid in run.look()
             if kernel_name(pid) == name]
    assert len(ranks) == 2, describe(run.look())
    if signum is None:
        os.kill(int(ranks[1]), signal.SIGKILL)
    else:
        run.proc.send_signal(signum)
    _out, err = run.finish(timeout=120)
    if signum is None:
        assert run.proc.returncode == 2, err[-3000:]
        assert f"learner rank 1 (pid {ranks[1]}) died from signal SIGKILL" in err, err[-3000:]
        assert f"(resume with `tether train --resume {run_dir}`)" in err or "holds no checkpoint" in err
    else:
        assert run.proc.returncode == 130, err[-3000:]
        _ckpt, state = newest_state(run_dir)
        assert state["trained_batches"] == len(rows(run_dir / "metrics.jsonl"))
    assert run.left() == ""
    assert shm_left(run.shm) == []
    assert leftovers(run_dir) == []


def test_a_killed_rank_actor_fails_the_run_naming_its_rank_and_the_run_resumes(tiny_model_dir, tmp_path):
    """train.world_size=2 with ray.learner=actor: one actor per rank; killing one stops the other
    (it waits for it in a collective), names the rank, and the run resumes from its checkpoint."""
    pytest.importorskip("ray")
    run_dir = tmp_path / "run"
    args = recipe(tiny_model_dir, "train.world_size=2", "rollout.backend=ray", "ray.local_cpus=3",
                  "ray.learner=actor", "checkpoint.interval=2")
    run = Run(["--run-dir", str(run_dir), *args], run_dir=run_dir)
    run.wait_for_rows(3, timeout=240)
    ranks = [int(line.split(" ", 1)[0]) for line in describe(run.look()).splitlines()
             if "ray::_LearnerActor" in line]
    assert len(ranks) == 2, describe(run.look())
    os.kill(ranks[-1], signal.SIGKILL)
    _out, err = run.finish(timeout=120)
    assert run.proc.returncode == 2, err[-3000:]
    assert "the learner's Ray actor of rank" in err and "died" in err, err[-3000:]
    assert f"tether train --resume {run_dir}`" in err, err[-3000:]
    assert run.left() == ""
    _ckpt, state = newest_state(run_dir)
    resumed = Run(["--resume", str(run_dir), f"train.num_batches={state['trained_batches'] + 2}"])
    _out, err = resumed.finish(timeout=240)
    assert resumed.proc.returncode == 0, err[-3000:]
    assert len(rows(run_dir / "metrics.jsonl")) >= state["trained_batches"] + 2
    assert resumed.left() == ""
