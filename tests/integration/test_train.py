"""`tether train` end to end: real tiny model, real worker processes, real run directory."""

import importlib.util
import itertools
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from procs import children, descendants, running, wait_gone
from tether.config import load_config
from tether.errors import ConfigError
from tether.loop import Timings, simulate, summarize
from tether.runtime.run import train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]


REWARD = Path(__file__).parent / "varied_reward.py"


def recipe(model_dir, *extra):
    """A fast recipe on the tiny model; its reward varies within groups so every loss path runs."""
    return [f"model.path={model_dir}", f"reward.function={REWARD}:reward", "data.task=reverse",
            "data.difficulty=3", "data.num_train=300",
            "data.num_eval=20", "rollout.batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
            "train.lr=1e-3", "train.num_batches=6", "eval.interval=3", "checkpoint.interval=3", *extra]


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def assert_follows_plan(cfg, run_dir, summary):
    """The run's per-batch staleness and its publications are `tether plan`'s for the updates it
    actually committed (a group with nothing to learn from commits nothing); returns (metrics,
    plan)."""
    metrics = rows(Path(run_dir) / "metrics.jsonl")
    plan = simulate(cfg.budget(), Timings(commits=tuple(int(m["async/optimizer_updates"]) for m in metrics)))
    assert [m["staleness/updates"] for m in metrics] == [r.staleness_updates for r in plan.trace.records]
    assert summary["syncs_after"] == summarize(plan)["syncs_after"]
    return metrics, plan


@pytest.mark.parametrize(("s", "u"), [(0, 1), (1, 1), (2, 2)])
def test_staleness_and_publications_match_tether_plan(tiny_model_dir, tmp_path, s, u):
    cfg = load_config(None, recipe(tiny_model_dir, f"async.max_staleness={s}", f"async.max_inflight={s + 1}",
                                   f"train.updates_per_batch={u}", "train.num_batches=8",
                                   "eval.interval=0", "checkpoint.interval=0"))
    summary = train(cfg, tmp_path / "run", progress_plain=True)
    metrics, plan = assert_follows_plan(cfg, tmp_path / "run", summary)
    for m in metrics:  # where it accrued, from the real completion times: the parts add up
        parts = [m[f"staleness/{p}_updates"] for p in ("at_launch", "generating", "queued")]
        assert min(parts) >= 0 and sum(parts) == m["staleness/updates"]
    if s == 0:
        assert all(m["staleness/updates"] == 0 for m in metrics)
    # the notes are the plan's, and each is recorded in events.jsonl
    noted = [e["code"] for e in rows(tmp_path / "run" / "events.jsonl") if e["kind"] == "note"]
    assert noted == [code for code, _ in plan.trace.notes] == (["no_overlap"] if s == 0 else [])
    assert max(m["staleness/batches"] for m in metrics) == s
    # `tether report`'s three figures: measured, simulated from the run's timings, and the lazy
    # rule's closed form, which is exact
    from tether.runtime.report import staleness_forms

    forms = staleness_forms(tmp_path / "run")
    assert forms["batches"] == 8 and forms["closed_form"]["rule"] == "lazy"
    measured = sum(m["staleness/batches"] for m in metrics) / len(metrics)
    assert forms["measured_batches"] == pytest.approx(measured)
    assert forms["closed_form"]["mean_staleness_batches"] == pytest.approx(measured)
    assert forms["simulated_batches"] == pytest.approx(measured)


def test_run_directory_evals_at_boundaries_and_checkpoints(tiny_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    cfg = load_config(None, recipe(tiny_model_dir, "eval.num_samples=2", "train.lr_schedule=cosine",
                                   "train.min_lr_ratio=0.1", "reward.overlong_buffer=2"))
    summary = train(cfg, run_dir, progress_plain=True)
    for name in ("config.yaml", "metrics.jsonl", "eval.jsonl", "events.jsonl", "summary.json"):
        assert (run_dir / name).is_file(), name
    assert any((run_dir / "tensorboard").iterdir())
    assert load_config(run_dir / "config.yaml").train.loss == "ppo_clip"  # resolved preset recorded
    metrics = rows(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    for key in ("async/train_version", "async/rollout_version", "async/publish_lag", "async/behavior_version",
                "staleness/updates", "staleness/batches", "reward/mean", "ratio/mean", "mismatch/k3",
                "loss/policy", "time/generate_wait", "time/train", "time/sync", "time/step",
                "throughput/samples_per_s"):
        assert key in metrics[0], key
    from tether.decoding import native

    # rollout.decoder=auto: the workers sampled through the native decoder wherever it builds
    assert {m["rollout/native_decoder"] for m in metrics} == {1.0 if native.library("auto") else 0.0}
    assert [e["step"] for e in rows(run_dir / "eval.jsonl")] == [0, 3, 6]
    assert all(0.0 <= e["eval/pass_at_1"] <= 1.0 for e in rows(run_dir / "eval.jsonl"))
    assert all(e["eval/sampled_pass_at_1"] <= e["eval/pass_at_k"] for e in rows(run_dir / "eval.jsonl"))
    # cosine from 1e-3 to 1e-4 over the 6 planned updates; overlong shaping reported per batch
    assert metrics[-1]["train/lr"] == pytest.approx(1e-4)
    assert all(a["train/lr"] > b["train/lr"] for a, b in itertools.pairwise(metrics))
    assert all(m["reward/overlong_penalty_mean"] <= 0.0 for m in metrics)
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step-000003", "step-000006"]
    assert summary["trained_batches"] == 6 and summary["eval_pass_at_1_first"] is not None
    assert 50 < summary["memory_peak_mb"]["trainer"] < 20_000
    assert 50 < summary["memory_peak_mb"]["rollout_worker"] < 20_000
    assert "memory/rollout_peak_mb" in metrics[0] and "memory/trainer_peak_mb" in metrics[0]
    # how off-policy the run was: the largest log-prob differences over the run, overall and on
    # the tokens sampled with the trained weights (numerics alone, tiny in float32)
    overall = max(m["mismatch/logprob_abs_diff_max"] for m in metrics
                  if m["mismatch/logprob_abs_diff_max"] is not None)  # None: no token in the loss
    assert summary["logprob_abs_diff_max"] == pytest.approx(overall)
    numeric = [m["mismatch/numeric_logprob_abs_diff_max"] for m in metrics
               if m["mismatch/numeric_logprob_abs_diff_max"] is not None]
    assert numeric, "some batch was sampled with the weights it trained on"
    assert summary["numeric_logprob_abs_diff_max"] == pytest.approx(max(numeric))
    assert summary["numeric_logprob_abs_diff_max"] < 1e-4
    # `tether eval RUN` evaluates the newest checkpoint on the run's own held-out split: its greedy
    # figures are the run's last evaluation's
    from tether.cli.main import main

    assert main(["eval", str(run_dir), "--json", "--samples", "3"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    last = rows(run_dir / "eval.jsonl")[-1]
    assert evaluated["model"].endswith("step-000006/learner/model")
    for key in ("eval/pass_at_1", "eval/greedy_reward_mean", "eval/examples"):
        assert evaluated[key] == last[key], key
    assert 0.0 <= evaluated["eval/sampled_pass_at_1"] <= evaluated["eval/pass_at_k"] <= 1.0
    from tether.runtime.report import write_report

    plots = write_report(run_dir)
    names = ["reward.png", "staleness.png", "ratios.png", "timeline.png", "study.json", "study.png",
             "lengths.png"]
    assert [p.name for p in plots] == names
    assert all(p.stat().st_size > 1000 for p in plots)
    study = json.loads((run_dir / "plots" / "study.json").read_text())
    assert sum(level["batches"] for level in study["by_staleness"].values()) == len(metrics)


def test_resume_matches_an_uninterrupted_run_batch_for_batch(tiny_model_dir, tmp_path, capsys):
    whole = tmp_path / "whole"
    train(load_config(None, recipe(tiny_model_dir)), whole, progress_plain=True)
    parts = tmp_path / "parts"
    train(load_config(None, recipe(tiny_model_dir, "train.num_batches=3")), parts, progress_plain=True)
    resumed_cfg = load_config(parts / "config.yaml", ["train.num_batches=6"])
    train(resumed_cfg, parts, resume=True, progress_plain=True)
    keys = ("step", "batch_index", "async/behavior_version", "async/train_version", "staleness/updates",
            "reward/mean", "loss/policy")
    a = [{k: m[k] for k in keys} for m in rows(whole / "metrics.jsonl")]
    b = [{k: m[k] for k in keys} for m in rows(parts / "metrics.jsonl")]
    assert a == b  # same prompts, same versions, same samples, same losses
    # `tether compare` puts the two side by side: one table row each, one figure
    from tether.cli.main import main

    assert main(["compare", str(whole), str(parts), "--out", str(tmp_path / "c.png")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].split()[:4] == ["whole", "(S=1,", "U=1)", "6"]
    assert table[2].split()[:4] == ["parts", "(S=1,", "U=1)", "6"]
    assert (tmp_path / "c.png").stat().st_size > 10_000


def test_a_damaged_checkpoint_is_refused_and_the_previous_good_one_used(tiny_model_dir, tmp_path, caplog):
    run_dir = tmp_path / "run"
    train(load_config(None, recipe(tiny_model_dir)), run_dir, progress_plain=True)
    weights = run_dir / "checkpoints" / "step-000006" / "learner" / "model" / "model.safetensors"
    with weights.open("r+b") as f:
        f.seek(1000)
        f.write(b"\x00" * 64)
    from tether.cli.eval_cmd import newest_checkpoint_model

    assert newest_checkpoint_model(run_dir) == run_dir / "checkpoints" / "step-000003" / "learner" / "model"
    train(load_config(run_dir / "config.yaml", ["train.num_batches=7"]), run_dir, resume=True,
          progress_plain=True)
    assert "does not match its checksum (corrupted)" in caplog.text
    assert [m["step"] for m in rows(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6, 7]
    assert (run_dir / "checkpoints" / "step-000006").is_dir()  # refused, not deleted


def test_recipe_errors_fail_before_any_process_starts(tiny_model_dir, tmp_path):
    cases = [
        (["train.lrr=1"], "did you mean train.lr"),
        (["async.max_staleness=-2"], "async.max_staleness must be >= 0"),
        ([f"model.path={tmp_path / 'missing'}"], "does not exist; point it at a local model directory"),
        (["data.task=", f"data.dataset={tmp_path / 'none.jsonl'}", "reward.function=exact_match"],
         "none.jsonl' does not exist"),
    ]
    if importlib.util.find_spec("vllm") is None:  # this environment lacks it; .venv-vllm has it
        cases.append((["rollout.engine=vllm"], "vLLM is not installed in this Python"))
    for overrides, message in cases:
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "tether.cli.main", "train", "--run-dir",
                              str(tmp_path / "never"), *recipe(tiny_model_dir, *overrides)],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr
        assert message in out.stderr
        assert "Traceback" not in out.stderr
        assert time.monotonic() - t0 < 60
    assert not (tmp_path / "never" / "metrics.jsonl").exists()


def _start(tiny_model_dir, run_dir, *extra):
    return subprocess.Popen(
        [sys.executable, "-m", "tether.cli.main", "train", "--run-dir", str(run_dir), "--plain",
         "--no-report",
         *recipe(tiny_model_dir, "train.num_batches=400", "eval.interval=0", "checkpoint.interval=50",
                 *extra)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_training(run_dir, proc, batches=2, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = run_dir / "metrics.jsonl"
        if path.is_file() and len(path.read_text().splitlines()) >= batches:
            return
        if proc.poll() is not None:
            raise AssertionError(f"train exited early: {proc.communicate()[1][-2000:]}")
        time.sleep(0.1)
    raise AssertionError("training did not start in time")


def _descendants(pid):
    return descendants(pid)


def test_ctrl_c_stops_checkpoints_and_leaves_no_process(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(tiny_model_dir, run_dir)
    try:
        _wait_for_training(run_dir, proc)
        family = _descendants(proc.pid)
        assert family  # the forkserver and the rollout worker
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "resume with `tether train --resume" in err
    assert wait_gone(family) == []
    ckpts = sorted((run_dir / "checkpoints").iterdir())
    assert ckpts, "Ctrl-C with checkpoints on writes a final checkpoint"
    state = json.loads((ckpts[-1] / "state.json").read_text())
    trained = len((run_dir / "metrics.jsonl").read_text().splitlines())
    assert state["trained_batches"] == trained


def test_a_worker_killed_mid_run_fails_the_run_with_a_clear_error(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(tiny_model_dir, run_dir, "rollout.on_worker_loss=stop")
    try:
        _wait_for_training(run_dir, proc)
        family = _descendants(proc.pid)
        workers = [p for p in family if p not in children(proc.pid)]  # the forkserver's children
        assert workers and all(running(p) for p in workers)
        for p in workers:
            import os

            os.kill(p, signal.SIGKILL)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err[-2000:]
    assert "worker rollout-0" in err and "died from signal SIGKILL" in err
    assert err.count("died from signal SIGKILL") == 1, err[-3000:]  # reported once, not again at teardown
    assert f"tether train: the run directory is {run_dir}" in err, err[-3000:]  # and what is left of it
    assert wait_gone(family) == []


def test_a_new_run_refuses_to_overwrite_an_existing_run_directory(tiny_model_dir, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="already exists and is not empty"):
        train(load_config(None, recipe(tiny_model_dir)), tmp_path / "run")


def test_wandb_when_asked_for(tiny_model_dir, tmp_path, monkeypatch):
    import importlib.util
    import types

    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(ConfigError, match="wandb is not installed: pip install wandb"):
            train(load_config(None, recipe(tiny_model_dir, "run.wandb_project=p")), tmp_path / "no")
        assert not (tmp_path / "no").exists()  # refused before anything was written
    logged = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: (logged.append(("init", kw["project"])), types.SimpleNamespace(
        finish=lambda: logged.append(("finish", None))))[1]
    fake.log = lambda data, step: logged.append((step, data))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    train(load_config(None, recipe(tiny_model_dir, "run.wandb_project=p", "train.num_batches=3")),
          tmp_path / "run", progress_plain=True)
    assert logged[0] == ("init", "p") and logged[-1] == ("finish", None)
    steps = [entry[0] for entry in logged[1:-1]]
    assert {1, 2, 3} <= set(steps)
    assert any("staleness/batches" in data for step, data in logged[1:-1] if step == 1)


def test_the_command_prints_what_the_run_reached(tiny_model_dir, tmp_path, capsys):
    from tether.cli.main import main

    run_dir = tmp_path / "run"
    assert main(["train", *recipe(tiny_model_dir, "eval.num_samples=2"), "--run-dir", str(run_dir), "--plain",
                 "--no-report"]) == 0
    out = capsys.readouterr().out
    summary = json.loads((run_dir / "summary.json").read_text())
    first, last = summary["eval_pass_at_1_first"], summary["eval_pass_at_1_last"]
    assert f"held-out pass@1: {first:.1%} → {last:.1%}" in out
    assert "held-out pass@2 (sampled): " in out
    assert "trained 6 batches" in out and f"run directory: {run_dir}" in out


def test_the_own_data_example_recipe_runs_with_its_dataset_and_reward_file(tiny_model_dir, tmp_path,
                                                                            monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipe's paths are relative to the repository root, as in the docs
    cfg = load_config(ROOT / "recipes" / "upper.yaml", [
        f"model.path={tiny_model_dir}", "train.num_batches=3", "eval.interval=3", "checkpoint.interval=0",
        "rollout.group_size=8", "rollout.max_new_tokens=6", "data.num_eval=10"])
    # groups of 8: the untrained model's letters land in place often enough that some group's
    # rewards vary, so updates commit (a run that learns nothing fails: NothingLearnedError)
    summary = train(cfg, tmp_path / "run", progress_plain=True)
    assert summary["trained_batches"] == 3
    # the file's reward ran (on the rows' own `word` column); what it gives, by hand:
    metrics = rows(tmp_path / "run" / "metrics.jsonl")
    assert all(0.0 <= m["reward/mean"] <= 1.0 for m in metrics)
    import importlib.util

    spec = importlib.util.spec_from_file_location("upper_reward", ROOT / "examples" / "upper" / "reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.reward("upper abc=", "ABC", "ABC", {"word": "abc"}) == 1.0
    assert module.reward("upper abc=", "ABX", "ABC", {"word": "abc"}) == pytest.approx(0.5 * 2 / 3)


def test_a_run_where_nothing_is_ever_right_fails_saying_why_and_keeps_its_report(tiny_model_dir, tmp_path,
                                                                                 capsys):
    """The untrained tiny model never answers right: every group has zero variance and is dropped,
    so no update commits and no batch has a mismatch figure. The run fails (exit 2) saying why,
    its run directory complete and its plots written (a log axis over no positive value used to
    fail the report)."""
    from tether.cli.main import main

    short = recipe(tiny_model_dir, "train.num_batches=3", "eval.interval=0", "checkpoint.interval=0")
    args = [a for a in short if not a.startswith("reward.function=")]
    assert main(["train", *args, "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "3 batches trained and no update committed: 3 had nothing to learn from" in err
    metrics = rows(tmp_path / "run" / "metrics.jsonl")
    assert all(m["reward/mean"] == 0.0 for m in metrics)
    assert (tmp_path / "run" / "summary.json").is_file()
    assert (tmp_path / "run" / "plots" / "ratios.png").stat().st_size > 1000


def test_a_run_with_an_ema_evaluates_it_and_eval_and_export_read_it(tiny_model_dir, tmp_path, capsys):
    """train.ema_decay: the run's evaluations are the average's, its checkpoints hold it as
    learner/ema, and `tether eval` / `tether export` read that folder (the trained weights with
    --trained)."""
    import torch
    from safetensors.torch import load_file

    from tether.cli.main import main

    run_dir = tmp_path / "run"
    train(load_config(None, recipe(tiny_model_dir, "train.ema_decay=0.9", "train.ema_every=2",
                                   "train.lr=1e-2")), run_dir, progress_plain=True)
    learner = run_dir / "checkpoints" / "step-000006" / "learner"
    ema, trained = (load_file(learner / name / "model.safetensors") for name in ("ema", "model"))
    assert set(ema) == set(trained) and any(not torch.equal(ema[n], trained[n]) for n in ema)
    assert main(["eval", str(run_dir), "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    last = rows(run_dir / "eval.jsonl")[-1]
    assert evaluated["model"].endswith("step-000006/learner/ema")
    for key in ("eval/pass_at_1", "eval/greedy_reward_mean", "eval/examples"):
        assert evaluated[key] == last[key], key
    assert main(["eval", str(run_dir), "--json", "--trained"]) == 0
    assert json.loads(capsys.readouterr().out)["model"].endswith("step-000006/learner/model")
    for flag, expected in (([], ema), (["--trained"], trained)):
        out = tmp_path / f"exported{len(flag)}"
        assert main(["export", str(run_dir), "--out", str(out), *flag]) == 0
        written = load_file(out / "model.safetensors")
        assert all(torch.equal(written[n], expected[n]) for n in expected)
