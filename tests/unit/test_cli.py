"""`tether plan`, `tether config` and `tether --version`, called in-process."""

import json

import pytest

from tether import __version__
from tether.cli.main import main


def plan_json(capsys, *args):
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_plan_json_has_schedule_and_batches(capsys):
    doc = plan_json(capsys, "--max-staleness", "3", "--updates-per-batch", "2",
                    "--num-batches", "12", "--max-inflight", "4")
    assert doc["staleness_budget"] == 6
    assert doc["admission_depth"] == 4
    assert doc["sync_period_batches"] == 4
    assert doc["syncs_after"] == [4, 8]
    assert [b["staleness_batches"] for b in doc["batches"]] == [0, 1, 2, 3] * 3
    assert [b["index"] for b in doc["batches"]] == list(range(12))


def test_flags_win_over_recipe_and_overrides(capsys, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("async:\n  max_staleness: 5\ntrain:\n  num_batches: 6\n")
    doc = plan_json(capsys, str(recipe), "async.max_staleness=4", "--max-staleness", "1")
    assert doc["settings"]["max_staleness"] == 1
    doc = plan_json(capsys, str(recipe), "async.max_staleness=2")
    assert doc["settings"]["max_staleness"] == 2
    assert doc["settings"]["num_batches"] == 6


def test_commits_flag_models_partial_steps(capsys):
    doc = plan_json(capsys, "--max-staleness", "1", "--updates-per-batch", "2",
                    "--num-batches", "6", "--commits", "1")
    assert doc["syncs_after"] == [3]
    assert all(b["committed_updates"] == 1 for b in doc["batches"])


def test_eval_clamp_is_reported(capsys):
    doc = plan_json(capsys, "--max-staleness", "11", "--max-inflight", "12", "--eval-interval", "10",
                    "--num-batches", "30")
    assert doc["syncs_after"] == [10, 20, 30]
    assert doc["summary"]["max_staleness_batches"] == 9
    # 9 batches of staleness are reachable: beyond AReaL's recommended 8, so cautioned too
    assert [n["code"] for n in doc["notes"]] == ["boundary_clamp", "deep_budget"]


def test_a_long_plan_shows_each_distinct_period_once_and_all_with_the_flag(capsys):
    args = ["plan", "--max-staleness", "3", "--eval-interval", "6", "--num-batches", "600"]
    assert main(args) == 0
    short = capsys.readouterr().out
    assert main([*args, "--all"]) == 0
    full = capsys.readouterr().out
    assert len(full.splitlines()) > 600 > 8 * len(short.splitlines())
    # the irregular pattern (gaps 4, 2) is shown as its two kinds of period, then the repeats folded
    assert "weights published on an irregular schedule: after batches 4, 6, 10, 12, 16, 18, …" in short
    rows = [line for line in short.splitlines() if line[:5].strip().isdigit()]
    assert [int(r.split()[0]) for r in rows][:6] == [1, 2, 3, 4, 5, 6]
    assert int(rows[-1].split()[0]) == 600  # the last steps are always shown
    assert "more sync period(s) like those above (--all lists every step)" in short
    assert "(200 in all; --all lists them)" in short and "the first " in short  # timeline window
    assert "… steps" not in full and "the first " not in full


def test_the_plan_splits_staleness_by_where_it_accrued(capsys):
    """Two engines generate a batch in 0.2 s; training takes 1 s: batches wait finished in the
    queue while the trainer works through the ones before them (S = 2: staleness 0, 1, 2 accrued
    entirely in the queue). One engine at 3 s a batch against 1 s of training: the third batch of
    a period was admitted at launch and trained on while it was still being generated."""
    doc = plan_json(capsys, "--max-staleness", "2", "--max-inflight", "3", "--num-batches", "6",
                    "--workers", "2", "--gen-time", "0.2", "--train-time", "1")
    split = [(b["staleness_at_launch_updates"], b["staleness_generating_updates"],
              b["staleness_queued_updates"]) for b in doc["batches"]]
    assert split == [(0, 0, 0), (0, 0, 1), (0, 0, 2)] * 2
    assert doc["summary"]["mean_staleness_queued_updates"] == 1.0
    doc = plan_json(capsys, "--max-staleness", "2", "--max-inflight", "3", "--num-batches", "6",
                    "--workers", "2", "--gen-time", "3", "--train-time", "1")
    split = [(b["staleness_at_launch_updates"], b["staleness_generating_updates"],
              b["staleness_queued_updates"]) for b in doc["batches"]]
    assert split == [(0, 0, 0), (0, 0, 1), (0, 2, 0)] * 2
    # one generation at a time at S = 3: later batches of a period launch while the engines are
    # already behind the trainer (the publish lag at launch is part of their staleness)
    doc = plan_json(capsys, "--max-staleness", "3", "--max-inflight", "1", "--num-batches", "8",
                    "--gen-time", "0.1", "--train-time", "1")
    for b in doc["batches"]:
        parts = (b["staleness_at_launch_updates"], b["staleness_generating_updates"],
                 b["staleness_queued_updates"])
        assert sum(parts) == b["staleness_updates"]
    assert [b["staleness_at_launch_updates"] for b in doc["batches"]] == [0, 0, 1, 2] * 2
    assert [b["staleness_queued_updates"] for b in doc["batches"]] == [0, 1, 1, 1] * 2


def test_text_output_shows_table_timeline_and_notes(capsys):
    assert main(["plan", "--max-staleness", "0", "--num-batches", "3", "--sync-time", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "[no_overlap]" in out
    assert "publish v1 (budget)" in out
    assert "timeline" in out and "train |" in out and "gen0" in out


def test_bad_input_exits_2_with_the_fix(capsys):
    assert main(["plan", "async.max_stalness=2"]) == 2
    err = capsys.readouterr().err
    assert "did you mean async.max_staleness" in err
    assert main(["plan", "--max-staleness", "-1"]) == 2
    assert "async.max_staleness must be >= 0" in capsys.readouterr().err
    assert main(["plan", "nope.yaml"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_config_show_and_reference(capsys):
    assert main(["config", "show", "async.max_staleness=3"]) == 0
    assert "max_staleness: 3" in capsys.readouterr().out
    assert main(["config", "reference"]) == 0
    assert "`async.max_staleness`" in capsys.readouterr().out


def test_overrides_may_follow_flags(capsys, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  num_batches: 6\n")
    doc = plan_json(capsys, str(recipe), "--max-inflight", "3", "async.max_staleness=2",
                    "train.num_batches=9")
    assert doc["settings"]["max_staleness"] == 2 and doc["settings"]["num_batches"] == 9
    assert doc["settings"]["max_inflight"] == 3
    with pytest.raises(SystemExit) as info:
        main(["plan", str(recipe), "--json", "--no-such-flag"])
    assert info.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tasks", "x=1"])  # a command without overrides refuses them


def test_sync_when_idle_flag_adds_idle_publications(capsys):
    common = ["--max-staleness", "1", "--num-batches", "8", "--gen-time", "0.3", "--train-time", "0.3"]
    lazy = plan_json(capsys, *common)
    idle = plan_json(capsys, *common, "--sync-when-idle")
    assert lazy["syncs_after"] == [2, 4, 6]
    assert idle["syncs_after"] == [1, 2, 3, 4, 5, 6, 7]
    assert {r for reasons in idle["summary"]["sync_reasons"] for r in reasons} == {"idle"}
    assert idle["summary"]["mean_step_time_s"] < lazy["summary"]["mean_step_time_s"]
    assert max(b["staleness_batches"] for b in idle["batches"]) == 1


def test_eval_refuses_targets_it_cannot_evaluate(tmp_path, capsys):
    from tether.cli.main import main

    assert main(["eval", "model.path=" + str(tmp_path / "none")]) == 2
    assert "is not a model directory (no config.json, model_index.json or" in capsys.readouterr().err
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("train:\n  num_batches: 3\n")
    assert main(["eval", str(tmp_path / "run")]) == 2
    assert "nothing to evaluate (pass --model DIR)" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "run"), "--model", str(tmp_path / "nowhere")]) == 2
    assert "is not a model directory (no config.json, model_index.json or" in capsys.readouterr().err


def test_export_of_a_run_without_checkpoints_says_there_is_nothing_to_export(tmp_path, capsys):
    from tether.cli.main import main

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("train:\n  num_batches: 3\n")
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "tether export: error: nothing to export: " in err and "holds no checkpoint" in err
    assert "evaluate" not in err and "--model" not in err and not (tmp_path / "out").exists()


def test_compare_needs_two_run_directories(tmp_path, capsys):
    from tether.cli.main import main
    from tether.runtime.compare import _moving_mean, format_table

    assert main(["compare", str(tmp_path)]) == 2
    assert "at least two run directories" in capsys.readouterr().err
    assert main(["compare", str(tmp_path), str(tmp_path)]) == 2
    assert "is not a run directory (it has no config.yaml)" in capsys.readouterr().err
    # a mean over the last n values, fewer at the start: [1, 3, 5, 7] with n = 2 → 1, 2, 4, 6
    assert _moving_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    text = format_table([{"run": "a (S=0, U=1)", "batches": 6, "wall_s": 12.0, "samples_per_s": 8.0,
                          "staleness_mean": 0.0, "staleness_max": 0, "pass_at_1_first": 0.25,
                          "pass_at_1_last": 0.5}])
    assert text.splitlines()[1].split() == ["a", "(S=0,", "U=1)", "6", "12", "8", "0.00", "/", "0",
                                            "25.0%", "→", "50.0%"]


def _run_dir(path, batches: int):
    """A run directory as `tether train` leaves it: its config, and one metrics row per trained
    batch (none: started, or stopped or failed before its first batch)."""
    import json

    path.mkdir()
    (path / "config.yaml").write_text("async:\n  max_staleness: 1\ntrain:\n  updates_per_batch: 1\n"
                                      "rollout:\n  batch_size: 2\n  group_size: 4\n")
    (path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "wall_s": 2.0 * i, "staleness/batches": i % 2, "reward/mean": 0.1 * i}) + "\n"
        for i in range(1, batches + 1)))
    return path


@pytest.mark.filterwarnings("error::UserWarning")  # runs without evaluations still get a legend
def test_compare_leaves_out_a_run_that_has_trained_no_batch_yet_and_says_so(tmp_path, capsys):
    from tether.cli.main import main

    a, b, empty = _run_dir(tmp_path / "a", 3), _run_dir(tmp_path / "b", 2), _run_dir(tmp_path / "killed", 0)
    out = tmp_path / "c.png"
    assert main(["compare", str(a), str(empty), str(b), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"{empty} is left out: it has trained no batch yet (no row in its metrics.jsonl)" in captured.err
    assert [line.split()[0] for line in captured.out.splitlines()[1:3]] == ["a", "b"] and out.is_file()
    # with fewer than two runs left there is nothing to compare: refused, naming the run and why
    assert main(["compare", str(a), str(empty), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"fewer than two runs to compare: {empty} has trained no batch yet" in err
    assert "not a run directory" not in err and "Traceback" not in err


def test_the_plan_says_where_dynamic_sampling_draws_from(capsys):
    doc = plan_json(capsys, "rollout.dynamic_sampling=true", "rollout.batch_size=8", "--num-batches", "4")
    assert doc["dynamic_sampling"]["max_prompts_per_batch"] == 24
    where = doc["dynamic_sampling"]["extra_prompts_of_batch_k"]
    assert where == "positions 16·k … 16·k + 15 of the extra stream"


def test_the_plan_models_publishing_without_draining(capsys):
    """keep: a publication after every step, batches generated under more than one version, and
    per-token staleness below the batch's own (its oldest token's) — never above the budget."""
    args = ["--max-staleness", "2", "--max-inflight", "2", "--workers", "2", "--gen-time", "1",
            "--gen-jitter", "1.0", "--train-time", "0.5", "--num-batches", "60"]
    drain = plan_json(capsys, *args)
    keep = plan_json(capsys, *args, "--inflight-update", "keep")
    assert keep["settings"]["inflight_update"] == "keep"
    assert keep["syncs_after"] == list(range(1, 60))
    assert drain["syncs_after"] != keep["syncs_after"]
    sm = keep["summary"]
    assert sm["max_staleness_batches"] <= 2
    assert sm["multi_version_batch_frac"] > 0.3 and drain["summary"]["multi_version_batch_frac"] == 0
    assert sm["mean_token_staleness_updates"] < sm["mean_staleness_batches"]
    assert drain["summary"]["mean_token_staleness_updates"] == drain["summary"]["mean_staleness_batches"]
    assert main(["plan", *args, "--inflight-update", "keep"]) == 0
    assert "per token (inflight_update=keep): mean staleness" in capsys.readouterr().out


def test_the_plan_prices_recompute_and_abort_from_sequence_lengths(capsys):
    """Without a length model recompute and abort are refused, saying which key to set; with one
    they are planned: abort wastes tokens and leaves no sequence under two versions."""
    assert main(["plan", "async.inflight_update=abort"]) == 2
    assert "set plan.mean_length (--mean-length" in capsys.readouterr().err
    assert main(["plan", "--mean-length", "8", "--gen-jitter", "0.5"]) == 2
    assert "set plan.gen_jitter=0" in capsys.readouterr().err
    args = ["--max-staleness", "1", "--max-inflight", "2", "--gen-time", "1", "--train-time", "0.7",
            "--num-batches", "60", "--mean-length", "20", "--prefill-cost", "0.3",
            "rollout.max_new_tokens=128"]
    abort = plan_json(capsys, *args, "--inflight-update", "abort")
    timings = abort["settings"]["timings"]
    assert (timings["mean_length"], timings["max_length"]) == (20, 128)
    sm = abort["summary"]
    assert sm["wasted_tokens_per_batch"] > 0 and sm["multi_version_seq_frac"] == 0
    assert sm["max_staleness_batches"] <= 1
    recompute = plan_json(capsys, *args, "--inflight-update", "recompute")["summary"]
    keep = plan_json(capsys, *args, "--inflight-update", "keep")["summary"]
    assert recompute["mean_step_time_s"] > keep["mean_step_time_s"]
    assert recompute["multi_version_seq_frac"] > 0 and keep["multi_version_seq_frac"] > 0
    assert main(["plan", *args, "--inflight-update", "abort"]) == 0
    assert "tokens wasted per batch" in capsys.readouterr().out
