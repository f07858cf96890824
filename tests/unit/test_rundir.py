"""The run directory's guards without a model: the lock, leftovers, and what a resume may change."""

import json

import pytest

from tether.config import load_config
from tether.errors import ConfigError, RunBusyError
from tether.runtime.rundir import RunLock, check_resume, clean_leftovers, record_start, resume_changes


def test_a_locked_run_directory_is_refused_naming_the_holder_and_freed_on_release(tmp_path):
    busy = pytest.raises(RunBusyError, match=r"in use by another process \(pid \d+ on .* since ")
    with RunLock(tmp_path / "run"), busy:
        RunLock(tmp_path / "run").acquire()
    with RunLock(tmp_path / "run") as again:  # released: free again
        assert json.loads(again.path.read_text())["pid"] > 0


def test_leftovers_of_interrupted_saves_are_removed(tmp_path):
    (tmp_path / "checkpoints" / ".tmp-step-000004-77").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-000002").mkdir()
    (tmp_path / "metrics.tmp").write_text("{")  # what checkpoint.trim_jsonl writes before its rename
    removed = clean_leftovers(tmp_path)
    assert sorted(p.name for p in removed) == [".tmp-step-000004-77", "metrics.tmp"]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-000002"]


def _cfg(*overrides):
    return load_config(None, ["data.task=arithmetic", *overrides]).to_dict()


def test_resume_changes_are_sorted_into_safe_and_refused_with_the_reason():
    changes = resume_changes(_cfg(), _cfg("train.num_batches=900", "eval.interval=7", "rollout.batch_size=3",
                                          "async.max_staleness=4", "train.lr=1e-5", "data.num_eval=50"))
    assert [c.split(":")[0] for c in changes.safe] == ["eval.interval", "train.num_batches"]
    refused = {c.split(":")[0]: why for c, why in changes.refused}
    assert refused == {
        "rollout.batch_size": "changes the prompt stream (which prompts each batch holds)",
        "async.max_staleness": "changes the staleness schedule and version clock already trained",
        "train.lr": "changes how training continues from the checkpoint",
        "data.num_eval": "changes the held-out set the run's evaluations are measured on",
    }


def test_check_resume_refuses_unless_forced_and_compares_the_data_fingerprint(tmp_path):
    record_start(tmp_path, overrides=[], resumed_from=None, fingerprint="a" * 64)
    assert check_resume(tmp_path, _cfg(), _cfg("eval.interval=5"), "a" * 64, force=False) == []
    with pytest.raises(ConfigError, match=r"(?s)run\.seed: 0 → 3 .*--force"):
        check_resume(tmp_path, _cfg(), _cfg("run.seed=3"), "a" * 64, force=False)
    with pytest.raises(ConfigError, match="training data differ"):
        check_resume(tmp_path, _cfg(), _cfg(), "b" * 64, force=False)
    forced = check_resume(tmp_path, _cfg(), _cfg("run.seed=3"), "b" * 64, force=True)
    assert len(forced) == 2


def test_a_model_build_left_by_a_dead_process_is_removed_and_a_live_one_kept(tmp_path):
    import os

    from tether.data.prepare import _clean_stale_builds

    dead, live = tmp_path / ".model.building-999999999", tmp_path / f".model.building-{os.getpid()}"
    for folder in (dead, live):
        (folder / "init").mkdir(parents=True)
    _clean_stale_builds(tmp_path / "model")
    assert not dead.exists() and live.exists()
