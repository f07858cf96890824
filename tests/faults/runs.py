"""Starting `tether train` as a process for fault tests, and reading what it left behind.

Every process a run starts inherits ``TETHER_TEST_RUN=<mark>`` in its environment, so a test
finds the run's whole tree by that mark (``procs.marked``, which adds what runs below a marked
process and remembers what it saw), also after the driver died and its children were
re-parented; shared memory is found from what those processes mapped.
"""

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from procs import MARK, describe, marked, shm_segments

ROOT = Path(__file__).resolve().parents[2]
REWARD = ROOT / "tests" / "integration" / "varied_reward.py"
HANG = ROOT / "tests" / "faults" / "hang_reward.py"


def recipe(model_dir, *extra):
    """A fast recipe on the tiny model that runs until stopped (400 batches)."""
    return [f"model.path={model_dir}", f"reward.function={REWARD}:reward", "data.task=reverse",
            "data.difficulty=3", "data.num_train=300", "data.num_eval=20", "rollout.batch_size=2",
            "rollout.group_size=2", "rollout.max_new_tokens=4", "train.lr=1e-3", "train.num_batches=400",
            "eval.interval=0", "checkpoint.interval=50", *extra]


class Run:
    """One `tether train` process and its marked tree."""

    def __init__(self, args, *, run_dir: Path | None = None) -> None:
        self.mark = uuid.uuid4().hex
        self.run_dir = run_dir
        env = {**os.environ, MARK: self.mark, "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, "-m", "tether.cli.main", "train", "--plain", "--no-report", *args]
        self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.seen: dict[int, int] = {}  # pid -> start time
        self.shm: set[str] = set()
        self.out = self.err = ""

    def look(self) -> list[int]:
        """The run's processes now (remembered, with the shared memory they map)."""
        pids = marked(self.mark, self.seen)
        self.shm |= shm_segments(pids)
        return pids

    def wait_for_rows(self, rows: int = 2, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        path = self.run_dir / "metrics.jsonl"
        while time.monotonic() < deadline:
            self.look()
            if path.is_file() and len(path.read_text().splitlines()) >= rows:
                self.look()
                return
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise AssertionError(f"train exited early ({code}): {self.finish()[1][-3000:]}")
            time.sleep(0.1)
        raise AssertionError("training did not start in time")

    def finish(self, timeout: float = 90) -> tuple[str, str]:
        try:
            self.out, self.err = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.communicate()
        return self.out, self.err

    def left(self, timeout: float = 5) -> str:
        """The run's processes still alive after waiting up to ``timeout`` seconds, one
        ``pid: command line`` each (empty when none is)."""
        deadline = time.monotonic() + timeout
        while (alive := marked(self.mark, self.seen)) and time.monotonic() < deadline:
            time.sleep(0.1)
        return describe(alive)


def rows(path) -> list[dict]:
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def newest_state(run_dir: Path) -> tuple[Path, dict]:
    ckpts = sorted(p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    return ckpts[-1], json.loads((ckpts[-1] / "state.json").read_text())


def leftovers(run_dir: Path) -> list[str]:
    """Temporary folders of interrupted saves."""
    ckpts = run_dir / "checkpoints"
    return sorted(p.name for p in ckpts.iterdir() if p.name.startswith(".tmp")) if ckpts.is_dir() else []


def stop_after(monkeypatch, step, signum=None, times=1, during_save=False):
    """Send ``signum`` to this process after the metrics row of ``step`` is written (or, with
    ``during_save``, a second one while the final checkpoint is being written)."""
    import signal as signals

    from tether.runtime.sinks import JsonlSink
    from tether.train.learner import TorchLearner

    signum = signals.SIGINT if signum is None else signum
    real_on_batch, real_save = JsonlSink.on_batch, TorchLearner.save
    state = {"stopped": False}

    def on_batch(self, record):
        real_on_batch(self, record)
        if record.step == step:
            state["stopped"] = True
            for _ in range(times):
                os.kill(os.getpid(), signum)

    def save(self, path):
        if during_save and state["stopped"]:
            os.kill(os.getpid(), signum)
        real_save(self, path)

    monkeypatch.setattr(JsonlSink, "on_batch", on_batch)
    monkeypatch.setattr(TorchLearner, "save", save)


def stop_and_resume(monkeypatch, cfg, run_dir: Path, after: int) -> None:
    """Train ``cfg`` in ``run_dir`` in this process, interrupted (SIGINT) after batch ``after``,
    then resumed from the checkpoint it saved to the end."""
    import pytest

    from tether.config import load_config
    from tether.errors import StopRequested
    from tether.runtime.run import train

    with monkeypatch.context() as m:
        stop_after(m, after)
        with pytest.raises(StopRequested):
            train(cfg, run_dir, progress_plain=True)
    train(load_config(run_dir / "config.yaml"), run_dir, resume=True, progress_plain=True)


def whole_and_resumed(monkeypatch, cfg, tmp_path: Path, trace, after: int = 2):
    """``trace(run_dir)`` of ``cfg`` trained whole in ``tmp_path/whole``, and of the same run
    stopped after batch ``after`` and resumed in ``tmp_path/stopped``."""
    from tether.runtime.run import train

    train(cfg, tmp_path / "whole", progress_plain=True)
    stop_and_resume(monkeypatch, cfg, tmp_path / "stopped", after=after)
    return trace(tmp_path / "whole"), trace(tmp_path / "stopped")
