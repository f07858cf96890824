"""A run whose learner runs out of memory (a ``MemoryError`` provoked at a given loss call by the
plug-in tests/faults/oom_loss.py) fails saying in which phase and what lowers it, leaves no
process behind, and resumes from its newest checkpoint."""

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from runs import Run, recipe, rows

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
PLUGIN = Path(__file__).parent / "oom_loss.py"


def test_a_run_out_of_memory_says_where_and_resumes_from_its_newest_checkpoint(tiny_model_dir, tmp_path,
                                                                              monkeypatch):
    run_dir = tmp_path / "run"
    keys = recipe(tiny_model_dir, f"run.plugins=[{PLUGIN}]", "train.loss=oom_at", "train.num_batches=4",
                  "checkpoint.interval=1")
    monkeypatch.setenv("OOM_AT_CALL", "3")  # one loss call a batch (one update, one micro-batch)
    failed = Run([*keys, "--run-dir", run_dir], run_dir=run_dir)
    _, err = failed.finish(timeout=240)
    assert failed.proc.returncode == 2, err[-3000:]
    assert ("tether train: error: the learner ran out of memory in an update's forward and backward. "
            "what lowers it: train.micro_batch_size") in err
    assert "train.activation_checkpointing=true" in err
    assert f"resume with `tether train --resume {run_dir}`" in err
    assert "Traceback" not in err
    assert failed.left() == ""
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000001", "step-000002"]
    assert [m["step"] for m in rows(run_dir / "metrics.jsonl")] == [1, 2]

    monkeypatch.delenv("OOM_AT_CALL")
    resumed = Run(["--resume", run_dir], run_dir=run_dir)
    _, err = resumed.finish(timeout=240)
    assert resumed.proc.returncode == 0, err[-3000:]
    assert [m["step"] for m in rows(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]


def test_a_learner_rank_out_of_memory_is_named_and_the_run_resumes(tiny_model_dir, tmp_path, monkeypatch):
    """On two learner ranks the rank that ran out of memory is named with the phase and what lowers
    it; a rank killed by SIGKILL (as the kernel's out-of-memory killer ends one) is named with the
    phase it was in; no rank process is left, and the run resumes from its newest checkpoint."""
    run_dir = tmp_path / "ranks"
    keys = recipe(tiny_model_dir, f"run.plugins=[{PLUGIN}]", "train.loss=oom_at", "train.num_batches=3",
                  "checkpoint.interval=1", "train.world_size=2")
    # each rank calls the loss twice a batch (its micro-batch, then the whole micro-batch's figures)
    monkeypatch.setenv("OOM_AT_CALL", "5")
    failed = Run([*keys, "--run-dir", run_dir], run_dir=run_dir)
    _, err = failed.finish(timeout=240)
    assert failed.proc.returncode == 2, err[-3000:]
    assert "learner rank" in err
    assert "the learner ran out of memory in an update's forward and backward" in err
    assert "train.activation_checkpointing=true" in err
    assert f"resume with `tether train --resume {run_dir}`" in err
    assert failed.left() == ""
    assert [m["step"] for m in rows(run_dir / "metrics.jsonl")] == [1, 2]

    monkeypatch.delenv("OOM_AT_CALL")
    monkeypatch.setenv("KILL_RANK_AT_CALL", "1")  # rank 1, in the resumed run's first update
    killed = Run(["--resume", run_dir], run_dir=run_dir)
    _, err = killed.finish(timeout=240)
    assert killed.proc.returncode == 2, err[-3000:]
    # batch index 2 (step 3), and the phase the rank had marked
    assert "learner rank 1 (pid" in err
    assert "died from signal SIGKILL while training batch 2, in an update's forward and backward" in err
    assert killed.left() == ""
    assert [m["step"] for m in rows(run_dir / "metrics.jsonl")] == [1, 2]

    monkeypatch.delenv("KILL_RANK_AT_CALL")
    resumed = Run(["--resume", run_dir], run_dir=run_dir)
    _, err = resumed.finish(timeout=240)
    assert resumed.proc.returncode == 0, err[-3000:]
    assert [m["step"] for m in rows(run_dir / "metrics.jsonl")] == [1, 2, 3]


def test_a_supervised_run_killed_in_a_learner_phase_is_told_where(tiny_model_dir, tmp_path, monkeypatch,
                                                                  capsys):
    """The parent that supervises a run (rollout.backend=ray's) names the learner phase its child
    was in when it was killed by SIGKILL, and leaves no phase marks behind."""
    import tempfile

    from tether.runtime.supervise import supervise

    run_dir = tmp_path / "supervised"
    keys = recipe(tiny_model_dir, f"run.plugins=[{PLUGIN}]", "train.loss=oom_at", "train.num_batches=2")
    monkeypatch.setenv("KILL_AT_CALL", "1")
    marks_before = set(Path(tempfile.gettempdir()).glob("tether-phases-*"))
    assert supervise(["train", "--plain", "--no-report", *keys, "--run-dir", str(run_dir)], run_dir) == 2
    err = capsys.readouterr().err
    assert "was killed by SIGKILL without a Tether error, in an update's forward and backward." in err, err
    assert f"start the run again with --run-dir {run_dir}" in err, err  # it trained no batch
    assert set(Path(tempfile.gettempdir()).glob("tether-phases-*")) == marks_before
