"""``tether sweep``: a grid of key values × seeds, each a real ``tether train`` of the tiny model,
resumable (finished runs kept, a stopped one resumed from its checkpoint, one stopped before any
checkpoint started afresh), with sweep.json and sweep.png; bad grids refused before any run."""

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tether.cli.main import main
from tether.runtime.sweep import parse_grid, run_sweep

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
REWARD = Path(__file__).parent / "varied_reward.py"


def overrides(model_dir):
    return [f"model.path={model_dir}", f"reward.function={REWARD}:reward", "data.task=reverse",
            "data.difficulty=3", "data.num_train=200",
            "data.num_eval=8", "rollout.batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
            "train.num_batches=4", "eval.interval=2", "checkpoint.interval=2", "train.drop_zero_std=false"]


@pytest.fixture(scope="module")
def swept(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    args = ["sweep", *overrides(tiny_model_dir), "--set", "async.max_staleness=0,1", "--seeds", "2",
            "--out", str(out)]
    assert main(args) == 0
    return out, args


def test_every_point_and_seed_trains_and_is_tabulated_and_plotted(swept, capsys):
    out, _ = swept
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["keys"] == ["async.max_staleness"]
    rows = doc["rows"]
    grid = [(r["values"]["async.max_staleness"], r["seed"]) for r in rows]
    assert grid == [("0", 0), ("0", 1), ("1", 0), ("1", 1)]
    for r in rows:
        assert r["done"] and r["held_out_key"] == "eval/pass_at_1" and 0 <= r["held_out"] <= 1
        assert r["samples_per_s"] > 0
        stale = [json.loads(line)["staleness/batches"] for line in (Path(r["run"]) / "metrics.jsonl").open()]
        assert r["staleness_max"] == max(stale) == float(r["values"]["async.max_staleness"])
        assert r["staleness_mean"] == pytest.approx(sum(stale) / len(stale))
        # the figure plotted is the run's last held-out evaluation, not its first or its best
        evals = [json.loads(line) for line in (Path(r["run"]) / "eval.jsonl").open()]
        assert len(evals) >= 2 and r["held_out"] == evals[-1]["eval/pass_at_1"]
        config = (Path(r["run"]) / "config.yaml").read_text()
        assert f"seed: {r['seed']}" in config
    assert (out / "sweep.png").stat().st_size > 5000


def test_a_second_call_runs_only_what_is_not_finished(swept, capsys):
    out, args = swept
    stopped = out / "async.max_staleness=1" / "seed1"
    (stopped / "summary.json").unlink()  # stopped after its first checkpoint
    shutil.rmtree(stopped / "checkpoints" / "step-000004")
    fresh = out / "async.max_staleness=0" / "seed0"
    shutil.rmtree(fresh / "checkpoints")
    (fresh / "summary.json").unlink()  # stopped before its first checkpoint
    calls = []

    def runner(argv, log):
        calls.append(argv)
        return main(argv)

    from tether.cli.plan import split_recipe_args

    _, over = split_recipe_args(args[1:args.index("--set")])
    rows = run_sweep(None, over, parse_grid(["async.max_staleness=0,1"]), [0, 1], out, runner=runner)
    assert [c[:2] for c in calls] == [["train", over[0]], ["train", "--resume"]]
    assert "--run-dir" in calls[0] and str(fresh) in calls[0]
    assert calls[1][2] == str(out / "async.max_staleness=1" / "seed1")
    assert all(r["done"] for r in rows)


def test_bad_grids_are_refused_before_any_run(tiny_model_dir, tmp_path, capsys):
    for sets, says in [(["async.max_staleness=0,x"], "sweep point async.max_staleness=x"),
                       (["async.nope=1,2"], "async.nope"),
                       (["async.max_staleness="], "must look like"),
                       (["async.max_staleness=1", "async.max_staleness=2"], "twice"),
                       (["run.seed=1,2"], "--seeds"),
                       ([], "at least one --set")]:
        assert main(["sweep", *overrides(tiny_model_dir), *[a for s in sets for a in ("--set", s)],
                     "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tether sweep: error: ") and says in err, err
        assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
