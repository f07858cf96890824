"""Losing a rollout worker process mid-run (`rollout.on_worker_loss`): `tether train` as a real
process; the worker is held inside its reward (a gate file), found in the run's process tree and
SIGKILLed, so it always dies while generating a batch."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_train import ROOT, recipe, rows  # noqa: E402

from configs import pool_settings  # noqa: E402
from procs import children, descendants, running, wait_gone  # noqa: E402
from tether.data.stream import PromptStream  # noqa: E402
from tether.data.tasks import get_task  # noqa: E402
from tether.modeling import load_causal_lm, unique_parameters  # noqa: E402
from tether.rollout.backends.local.pool import ProcessPool  # noqa: E402
from tether.vocabulary import GenerationRequest  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
BASE = ("async.max_staleness=1", "async.max_inflight=2", "eval.interval=0")
SAMPLES_PER_BATCH = 4  # recipe()'s rollout.batch_size=2 x rollout.group_size=2


class Gate:
    """A reward that, while ``gate`` exists and its process has already scored ``after`` samples,
    writes that process's pid to ``held`` and waits: the worker holding it is then mid-batch until
    the test kills it. Closing the gate before the run starts, with ``after`` a whole number of
    batches, holds the worker on a known batch however fast the run goes."""

    def __init__(self, tmp: Path, after: int = 0) -> None:
        self.gate, self.held = tmp / "gate", tmp / "held"
        self.reward = tmp / "gated_reward.py"
        self.reward.write_text(textwrap.dedent(f"""\
            import hashlib, os, time

            scored = 0

            def reward(prompt, completion, answer, fields):
                global scored
                scored += 1
                if scored > {after} and os.path.exists({str(self.gate)!r}):
                    with open({str(self.held)!r} + ".tmp", "w") as f:
                        f.write(str(os.getpid()))
                    os.replace({str(self.held)!r} + ".tmp", {str(self.held)!r})
                    while os.path.exists({str(self.gate)!r}):
                        time.sleep(0.02)
                return int(hashlib.sha256(completion.encode()).hexdigest()[:8], 16) % 1000 / 1000
            """))

    def close(self) -> None:
        """Close the gate (a no-op when closed already: a worker may be held there now)."""
        if not self.gate.exists():
            self.held.unlink(missing_ok=True)
            self.gate.touch()

    def kill_the_held_worker(self, proc: subprocess.Popen, timeout: float = 120) -> int:
        """Close the gate, wait for a worker to be held, SIGKILL it, open the gate; its pid."""
        self.close()
        deadline = time.monotonic() + timeout
        while not self.held.exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no worker reached the reward"
            time.sleep(0.05)
        pid = int(self.held.read_text())
        workers = [p for p in descendants(proc.pid) if p not in children(proc.pid)]  # the forkserver's
        assert pid in workers and running(pid)  # a rollout worker of this run, found in its tree
        os.kill(pid, signal.SIGKILL)
        self.gate.unlink()
        return pid


def start(model_dir, run_dir, gate: Gate, *extra) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tether.cli.main", "train", "--run-dir", str(run_dir), "--plain",
         "--no-report", *recipe(model_dir, *BASE, f"reward.function={gate.reward}:reward", *extra)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_rows(run_dir: Path, proc: subprocess.Popen, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    path = run_dir / "metrics.jsonl"
    while not (path.is_file() and len(path.read_text().splitlines()) >= n):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"fewer than {n} batches trained in {timeout:.0f}s"
        time.sleep(0.05)

def kill_twice_past_the_cap(model_dir, run_dir: Path, gate: Gate, *extra: str, timeout: float = 120):
    """A run allowed one replacement: its held worker killed once, the replacement left to train
    three more batches, then killed too. (first pid, second pid, the run's process family before
    the second kill, the ended process, its stderr)."""
    proc = start(model_dir, run_dir, gate, *extra, "train.num_batches=400", "checkpoint.interval=2",
                 "rollout.max_worker_restarts=1")
    try:
        wait_rows(run_dir, proc, 2, timeout=timeout)
        first = gate.kill_the_held_worker(proc)
        wait_rows(run_dir, proc, 5, timeout=timeout)  # the replacement trains on
        family = descendants(proc.pid)
        second = gate.kill_the_held_worker(proc)
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return first, second, family, proc, err


def resume_three_more(run_dir: Path, timeout: float) -> tuple[int, subprocess.CompletedProcess]:
    """``tether train --resume`` to three batches past the newest checkpoint: (that total, the run)."""
    newest = sorted((run_dir / "checkpoints").iterdir())[-1]
    total = json.loads((newest / "state.json").read_text())["trained_batches"] + 3
    return total, subprocess.run(
        [sys.executable, "-m", "tether.cli.main", "train", "--resume", str(run_dir), "--plain", "--no-report",
         f"train.num_batches={total}"], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def assert_staleness_follows_the_launches(run_dir: Path) -> list[dict]:
    """Each trained batch was sampled under the version of its *last* launch (a lost batch's new
    request), and its staleness is the train version at its consumption minus that version, within
    the budget: read from events.jsonl, apart from the loop's own arithmetic."""
    launched: dict[int, int] = {}
    train_version, expected = 0, {}
    for e in rows(run_dir / "events.jsonl"):
        if e["kind"] == "launch":
            launched[e["batch"]] = e["version"]
        elif e["kind"] == "train":
            train_version = e["version"]
        elif e["kind"] == "consume":
            expected[e["batch"]] = (launched[e["batch"]], train_version - launched[e["batch"]])
    metrics = rows(run_dir / "metrics.jsonl")
    got = {m["batch_index"]: (m["async/behavior_version"], m["staleness/updates"]) for m in metrics}
    assert got == expected
    assert all(0 <= m["staleness/updates"] <= 1 for m in metrics)
    return metrics


@pytest.fixture(scope="module")
def replaced_run(tiny_model_dir, tmp_path_factory):
    """A run of 10 batches whose worker is killed once, mid-batch, on batch 3 (its gate closed from
    the start, so a fast run cannot finish before the worker is held)."""
    tmp = tmp_path_factory.mktemp("replaced")
    gate, run_dir = Gate(tmp, after=3 * SAMPLES_PER_BATCH), tmp / "run"
    gate.close()
    proc = start(tiny_model_dir, run_dir, gate, "train.num_batches=10", "checkpoint.interval=0")
    try:
        wait_rows(run_dir, proc, 3)
        killed = gate.kill_the_held_worker(proc)
        _out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    return run_dir, killed, err


def test_a_killed_worker_is_replaced_and_the_run_trains_every_batch_once(replaced_run):
    run_dir, killed, err = replaced_run
    metrics = assert_staleness_follows_the_launches(run_dir)
    assert sorted(m["batch_index"] for m in metrics) == list(range(10))  # none dropped, none twice
    restarts = [m["rollout/worker_restarts"] for m in metrics]
    assert restarts[0] == 0 and restarts[-1] == 1 and restarts == sorted(restarts)
    (lost,) = [e for e in rows(run_dir / "events.jsonl") if e["kind"] == "worker_lost"]
    assert lost["worker"] == "rollout-0" and lost["restarts"] == 1
    assert f"pid {killed}" in lost["cause"] and "SIGKILL" in lost["cause"]
    relaunches = [e for e in rows(run_dir / "events.jsonl")
                  if e["kind"] == "launch" and e["batch"] == lost["batch"]]
    assert len(relaunches) == 2  # launched again as a new request
    assert "replacing it (1 of rollout.max_worker_restarts=3)" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trained_batches"] == 10


def test_past_the_cap_the_run_stops_naming_the_key_leaves_no_process_and_resumes(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    first, second, family, proc, err = kill_twice_past_the_cap(tiny_model_dir, run_dir, Gate(tmp_path))
    assert second != first
    assert proc.returncode == 2, err[-3000:]
    assert "WorkerRestartLimitError" in err or "worker rollout-0" in err, err[-3000:]
    assert (f"worker process (pid {second}) died from signal SIGKILL" in err
            and "1 worker(s) already replaced in this run, the most rollout.max_worker_restarts=1 allows: "
                "raise rollout.max_worker_restarts" in err), err[-3000:]
    assert wait_gone(family) == []  # the replacement, the forkserver: nothing outlives the run
    total, resume = resume_three_more(run_dir, timeout=180)
    assert resume.returncode == 0, resume.stderr[-3000:]
    metrics = rows(run_dir / "metrics.jsonl")
    assert sorted(m["batch_index"] for m in metrics) == list(range(total))  # every batch once
    assert [m["step"] for m in metrics] == list(range(1, total + 1))
    assert all(0 <= m["staleness/updates"] <= 1 for m in metrics)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("inflight", ["drain", "keep"])
def test_a_worker_that_dies_idle_is_replaced_by_the_next_publication(tiny_model_dir, inflight):
    """The local pool itself: a worker killed between batches is met by the next publication, whose
    version its replacement takes from the channel (loading it between batches, or, without
    draining, switching to it before its next decode step); both workers then sample under it."""
    stream = PromptStream(get_task("arithmetic").examples("train", 300, seed=0), batch_size=2)
    model, _ = load_causal_lm(tiny_model_dir)
    weights = unique_parameters(model)
    settings = pool_settings(tiny_model_dir, "rollout.group_size=2", "rollout.max_new_tokens=4",
                             "rollout.num_workers=2", f"async.inflight_update={inflight}")
    with ProcessPool(settings, stream.batch, weights) as pool:
        old = pool.pids
        os.kill(old[1], signal.SIGKILL)
        assert wait_gone([old[1]]) == []
        with torch.no_grad():
            for p in weights.values():
                p.add_(0.01)
        pool.publish(weights, 1)
        deadline = time.monotonic() + 30
        while not (losses := pool.lost()):  # without draining, publishing asks nothing of the workers
            assert time.monotonic() < deadline, "the death was never reported"
            time.sleep(0.05)
        (loss,) = losses
        assert (loss.worker, loss.batch_index, loss.restarts) == ("rollout-1", None, 1)
        assert pool.pids[0] == old[0] and pool.pids[1] != old[1]
        for index in (0, 1):
            pool.launch(GenerationRequest(index=index, version=1))
        got = []
        while len(got) < 2:
            got += pool.wait(60)
        assert sorted(b.behavior_version for b in got) == [1, 1]
        assert pool.served == {"rollout-0": 1, "rollout-1": 1}  # the replacement sampled one
        held = pool.published_weights()
        assert all(held[name].equal(t) for name, t in weights.items())
        family = pool.pids
    assert wait_gone(family) == []
