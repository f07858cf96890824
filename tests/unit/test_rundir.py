"""The run directory's guards without a model: the lock, leftovers, and what a resume may change."""

import json

import pytest

from tether.config import load_config
from tether.errors import ConfigError, RunBusyError
from tether.runtime.rundir import (
    RunLock,
    check_resume,
    clean_leftovers,
    first_fingerprint,
    never_trained,
    record_start,
    resume_changes,
    reuse_untrained,
)


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


def _failed_start(run_dir):
    """What a start that failed before its first batch leaves: its record, config, events, an
    evaluation at step 0, an empty metrics file, TensorBoard's folder, an empty checkpoints folder."""
    run_dir.mkdir()
    record_start(run_dir, overrides=[], resumed_from=None, fingerprint="a" * 64)
    for name, text in [("config.yaml", "run:\n  seed: 0\n"), ("events.jsonl", '{"kind": "launch"}\n'),
                       ("eval.jsonl", '{"step": 0}\n'), ("metrics.jsonl", ""), (".lock", "")]:
        (run_dir / name).write_text(text)
    (run_dir / "tensorboard").mkdir()
    (run_dir / "checkpoints").mkdir()
    (run_dir / "ray").mkdir()  # a local Ray instance's logs
    return run_dir


def test_a_run_directory_that_never_trained_is_reused_keeping_its_starts_and_rays_logs(tmp_path):
    run_dir = _failed_start(tmp_path / "run")
    assert never_trained(run_dir)
    removed = reuse_untrained(run_dir)
    assert removed == ["checkpoints", "config.yaml", "eval.jsonl", "events.jsonl", "metrics.jsonl",
                       "tensorboard"]
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "ray", "starts.jsonl"]
    # the run's data are those of its latest new start: the data the reused start trains on
    record_start(run_dir, overrides=[], resumed_from=None, fingerprint="b" * 64)
    assert first_fingerprint(run_dir) == "b" * 64
    record_start(run_dir, overrides=[], resumed_from="step-000002", fingerprint="c" * 64)
    assert first_fingerprint(run_dir) == "b" * 64


@pytest.mark.parametrize("case", ["a metrics row", "a checkpoint", "a file of someone else's", "no record"])
def test_a_run_directory_that_trained_or_is_not_a_runs_is_not_reused(tmp_path, case):
    run_dir = _failed_start(tmp_path / "run")
    if case == "a metrics row":
        (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    elif case == "a checkpoint":
        (run_dir / "checkpoints" / "step-000002").mkdir()
    elif case == "a file of someone else's":
        (run_dir / "notes.txt").write_text("mine")
    else:
        (run_dir / "starts.jsonl").unlink()
    assert not never_trained(run_dir)


def test_a_section_one_config_leaves_out_at_its_defaults_is_no_change():
    # A run recorded with every plug-in's section (ray, vllm at their defaults) resumed by a
    # config that holds only the chosen engine's and backend's: nothing to log. A key set away
    # from its default in the section the other leaves out is still a change.
    recorded = _cfg()
    recorded["ray"] = {"address": "", "local_cpus": 0}
    assert resume_changes(recorded, _cfg()) == resume_changes(_cfg(), _cfg())
    recorded["ray"]["address"] = "auto"
    assert [c.split(":")[0] for c in resume_changes(recorded, _cfg()).safe] == ["ray.address"]


def test_a_stopped_run_is_told_how_to_go_on_from_what_its_directory_holds(tmp_path):
    # after a stop, an error, or Ray ending the training process: resume only where a checkpoint is
    from tether.runtime.rundir import where_to_resume

    (tmp_path / "starts.jsonl").write_text('{"command": "tether train"}\n')
    assert f"start the run again with --run-dir {tmp_path}" in where_to_resume(tmp_path)  # reused
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert "no checkpoint to resume from" in where_to_resume(tmp_path)
    assert "--resume" not in where_to_resume(tmp_path)
    (tmp_path / "checkpoints" / "step-000001").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-000001" / "manifest.json").write_text("{}")
    assert f"tether train --resume {tmp_path}`" in where_to_resume(tmp_path)
