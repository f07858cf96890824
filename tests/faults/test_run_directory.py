"""Fault injection on the run directory, in process: checkpoint writes that fail, resumes that
would change the run, damaged manifests, a stop with nothing to resume, a second stop signal
during the final save."""

import errno
import json
import logging
import os
import shutil
import signal

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from runs import ROOT, leftovers, recipe, rows, stop_after

from procs import descendants, shm_left, wait_gone
from tether.cli.main import main
from tether.config import load_config
from tether.runtime.checkpoint import Checkpointer
from tether.vocabulary import LoopState

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def leaves_no_process_and_no_shared_memory(monkeypatch):
    """These runs are in this process: afterwards none of the processes they started (rollout
    workers: children of this process's forkserver) may be left, nor their weight channels."""
    import multiprocessing.forkserver as forkserver
    import multiprocessing.resource_tracker as tracker

    from tether.rollout.channel import WeightChannel

    channels, real_init = [], WeightChannel.__init__

    def init(self, layout):
        real_init(self, layout)
        channels.append(self.name)

    monkeypatch.setattr(WeightChannel, "__init__", init)
    before = set(descendants(os.getpid()))
    yield
    # this process's own forkserver and resource tracker live on for later tests
    infrastructure = {forkserver._forkserver._forkserver_pid, tracker._resource_tracker._pid}
    started = [p for p in descendants(os.getpid()) if p not in before and p not in infrastructure]
    assert wait_gone(started, timeout=5) == []
    assert shm_left(channels, timeout=5) == []


def short(model_dir, *extra):
    return [*recipe(model_dir, "train.num_batches=4", "checkpoint.interval=2"), *extra]


def train_cli(*args) -> int:
    return main(["train", "--plain", "--no-report", *[str(a) for a in args]])


@pytest.mark.parametrize(("error", "says"), [
    (OSError(errno.ENOSPC, "No space left on device"), "the disk is full"),
    (PermissionError(errno.EACCES, "Permission denied"), "permission denied"),
])
def test_a_checkpoint_that_cannot_be_written_stops_the_run_clearly_and_keeps_the_last_good_one(
        tiny_model_dir, tmp_path, monkeypatch, capsys, error, says):
    from tether.train.learner import TorchLearner

    real_save = TorchLearner.save
    calls = []

    def failing_save(self, path):
        calls.append(path)
        real_save(self, path)  # write something, then fail, as a full disk does midway
        if len(calls) == 2:
            raise error

    monkeypatch.setattr(TorchLearner, "save", failing_save)
    run_dir = tmp_path / "run"
    assert train_cli("--run-dir", run_dir, *short(tiny_model_dir)) == 2
    err = capsys.readouterr().err
    assert f"could not write checkpoint {run_dir / 'checkpoints' / 'step-000004'} ({says}" in err
    assert "the last good checkpoint, step-000002, is kept" in err
    assert "Traceback" not in err
    assert leftovers(run_dir) == []
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-000002"]
    Checkpointer(run_dir / "checkpoints").verify(run_dir / "checkpoints" / "step-000002")
    assert [m["step"] for m in rows(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]  # rows kept


def test_resume_keeps_safe_changes_refuses_the_rest_unless_forced_and_checks_the_data(
        tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    shutil.copy(ROOT / "examples" / "upper" / "train.jsonl", data)
    own = ["data.task=", f"data.dataset={data}", f"data.eval_dataset={ROOT / 'examples/upper/eval.jsonl'}",
           "data.max_prompt_tokens=32"]
    run_dir = tmp_path / "run"
    assert train_cli("--run-dir", run_dir, *short(tiny_model_dir, *own)) == 0
    # a resume past the end says how to extend the run
    assert train_cli("--resume", run_dir) == 2
    assert "nothing to resume: 4 batches already trained of train.num_batches=4; extend it" in \
        capsys.readouterr().err
    # extending is safe, and recorded: the run's config.yaml says what it now runs to
    assert train_cli("--resume", run_dir, "train.num_batches=5") == 0
    assert load_config(run_dir / "config.yaml").train.num_batches == 5
    # changes to the prompt stream or the schedule are refused, naming each and why
    for override, why in [("rollout.batch_size=3", "changes the prompt stream"),
                          ("run.seed=7", "changes the prompt stream"),
                          ("async.max_staleness=2", "changes the staleness schedule"),
                          ("train.lr=5e-4", "changes how training continues")]:
        capsys.readouterr()
        assert train_cli("--resume", run_dir, "train.num_batches=6", override) == 2, override
        err = capsys.readouterr().err
        assert f"resuming {run_dir} would change the run" in err and why in err, err
        assert "--force" in err
    assert [m["step"] for m in rows(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5]  # nothing ran
    # a replaced dataset file is refused too: the same rows in another order are another stream
    lines = data.read_text().splitlines()
    data.write_text("\n".join(reversed(lines)) + "\n")
    assert train_cli("--resume", run_dir, "train.num_batches=6") == 2
    assert "the training data differ from the data the run started with" in capsys.readouterr().err
    # --force accepts, and says so in starts.jsonl
    assert train_cli("--force", "--resume", run_dir, "train.num_batches=6", "rollout.batch_size=3") == 0
    starts = rows(run_dir / "starts.jsonl")
    assert [s["resumed_from"] for s in starts] == [None, "step-000004", "step-000005"]
    assert any("rollout.batch_size" in c for c in starts[-1]["forced_changes"])
    assert any("training data differ" in c for c in starts[-1]["forced_changes"])
    assert [m["step"] for m in rows(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("manifest", ["{}", "[]", '{"state.json": 3}', "not json"])
def test_a_checkpoint_with_an_empty_or_malformed_manifest_is_refused_as_damaged(tmp_path, manifest, caplog):
    ckpts = Checkpointer(tmp_path / "checkpoints")

    class Learner:
        def save(self, path):
            path.mkdir(parents=True)
            (path / "weights.bin").write_bytes(b"w" * 100)

    for step in (2, 4):
        state = LoopState(trained_batches=step, launched_batches=step + 1, train_version=step,
                          rollout_version=step)
        ckpts.save(step, state, Learner())
    (tmp_path / "checkpoints" / "step-000004" / "manifest.json").write_text(manifest)
    with caplog.at_level(logging.ERROR):
        state, path = ckpts.newest_good()
    assert path.name == "step-000002" and state.trained_batches == 2
    assert "refusing damaged checkpoint" in caplog.text and "step-000004" in caplog.text


def test_a_rank_lost_while_a_checkpoint_is_written_is_said_as_that_and_leaves_nothing(tmp_path):
    """A learner rank killed mid-save is the run's failure as it is — a rank lost, not a write
    that failed for want of space or permissions — and no part of the checkpoint is left."""
    from tether.errors import LearnerLostError

    class Learner:
        def save(self, path):
            path.mkdir(parents=True)
            (path / "half.bin").write_bytes(b"w" * 100)
            raise LearnerLostError("learner rank 1 (pid 123) died from signal SIGKILL while saving it")

    with pytest.raises(LearnerLostError, match="died from signal SIGKILL") as info:
        Checkpointer(tmp_path / "checkpoints").save(4, LoopState(trained_batches=4, rollout_version=4),
                                                    Learner())
    assert "Free space" not in str(info.value)
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_group_size_one_is_refused_before_anything_starts(tiny_model_dir, tmp_path, capsys):
    assert train_cli("--run-dir", tmp_path / "run", *short(tiny_model_dir, "rollout.group_size=1")) == 2
    err = capsys.readouterr().err
    assert "rollout.group_size=1 trains nothing" in err and "set rollout.group_size to 2 or more" in err
    assert not (tmp_path / "run").exists()


def test_a_stop_with_checkpoints_off_says_there_is_nothing_to_resume(tiny_model_dir, tmp_path, monkeypatch,
                                                                       capsys):
    stop_after(monkeypatch, 2, signal.SIGTERM)
    run_dir = tmp_path / "run"
    assert train_cli("--run-dir", run_dir, *short(tiny_model_dir, "checkpoint.interval=0")) == 143
    err = capsys.readouterr().err
    assert "stopped by SIGTERM" in err and "holds no checkpoint to resume from" in err
    assert "resume with" not in err
    assert [m["step"] for m in rows(run_dir / "metrics.jsonl")] == [1, 2]


def test_a_second_stop_during_the_final_save_abandons_it_and_says_so(tiny_model_dir, tmp_path, monkeypatch,
                                                                       caplog):
    stop_after(monkeypatch, 1, during_save=True)
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        assert train_cli("--run-dir", run_dir, *short(tiny_model_dir, "checkpoint.interval=3")) == 130
    assert "saving a final checkpoint" in caplog.text
    assert "the final checkpoint was abandoned by a second stop signal" in caplog.text
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["kind"] == "save"]


def test_a_start_that_failed_before_its_first_batch_is_no_dead_end(tiny_model_dir, tmp_path, capsys, caplog):
    """A run directory whose start failed before any batch trained (no metrics row, no checkpoint) is
    not a run to resume: `--resume` says so, and starting the run again in it reuses it, keeping
    its starts.jsonl (and the lock rules: it is cleared only under the lock)."""
    broken = tmp_path / "broken_reward.py"
    broken.write_text("def reward(prompt, completion, answer, fields):\n"
                      "    raise ValueError('service down')\n")
    run_dir = tmp_path / "run"
    assert train_cli("--run-dir", run_dir, *short(tiny_model_dir, f"reward.function={broken}:reward")) == 2
    err = capsys.readouterr().err
    assert "service down" in err
    assert ("it trained no batch, so there is nothing to resume: start the run again with "
            f"--run-dir {run_dir} to reuse it") in err
    assert rows(run_dir / "metrics.jsonl") == []
    assert train_cli("--resume", run_dir) == 2
    assert f"nothing to resume: {run_dir} never trained a batch" in capsys.readouterr().err
    from tether.runtime.rundir import RunLock

    with RunLock(run_dir):  # a start in it that still holds it is refused at once, as ever
        assert train_cli("--run-dir", run_dir, *short(tiny_model_dir)) == 2
    assert "is in use by another process" in capsys.readouterr().err
    with caplog.at_level(logging.INFO, logger="tether.run"):
        assert train_cli("--run-dir", run_dir, *short(tiny_model_dir)) == 0
    assert f"reusing run directory {run_dir}: its earlier start trained no batch" in caplog.text
    assert [m["step"] for m in rows(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [s["resumed_from"] for s in rows(run_dir / "starts.jsonl")] == [None, None]
    assert load_config(run_dir / "config.yaml").reward.function.endswith("varied_reward.py:reward")
    # once it has trained, it is a run: a new start in it is refused as before
    assert train_cli("--run-dir", run_dir, *short(tiny_model_dir)) == 2
    assert "already exists and is not empty; pass --resume" in capsys.readouterr().err
