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
    it; no rank process is left, and the run resumes from its newest checkpoint."""
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
    resumed = Run(["--resume", run_dir], run_dir=run_dir)
    _, err = resumed.finish(timeout=240)
    assert resumed.proc.returncode == 0, err[-3000:]
    assert [m["step"] for m in rows(run_dir / "metrics.jsonl")] == [1, 2, 3]
