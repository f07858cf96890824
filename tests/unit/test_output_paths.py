"""Where a command writes is checked before it does any work: a file where a folder is to be made
(or a folder under a file), an empty ``--run-dir``, a figure name whose extension nothing writes,
are refused naming the option, with nothing built or written. ``tether plan``'s own options are
refused where they would be ignored or break the drawing, and ``tether sweep`` refuses a kept run
whose recipe is no longer its point's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tether.cli.main import main
from tether.config import load_config
from tether.errors import ConfigError
from tether.paths import check_file_to_write, check_folder_to_write
from tether.runtime.sweep import parse_grid, run_sweep

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def a_file(tmp_path) -> Path:
    path = tmp_path / "afile"
    path.write_text("hi\n")
    return path


def refused(capsys, argv: list[str], says: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"tether {argv[0]}: error: " in err and says in err, err
    assert "Traceback" not in err
    return err


def test_the_checks_name_the_option_and_what_is_wrong(a_file, tmp_path):
    with pytest.raises(ConfigError, match=r"--run-dir .*afile exists and is not a folder"):
        check_folder_to_write(a_file, "--run-dir")
    with pytest.raises(ConfigError, match=r"--out .*afile/sub/deeper is under .*afile, which is a file"):
        check_folder_to_write(a_file / "sub" / "deeper", "--out")
    with pytest.raises(ConfigError, match="--run-dir is empty"):
        check_folder_to_write(" ", "--run-dir")
    check_folder_to_write(tmp_path / "new" / "deeper", "--out")  # made later, by the command
    check_folder_to_write(tmp_path, "--out")
    with pytest.raises(ConfigError, match=r"is a folder; give a file name \(for example .*out.png\)"):
        check_file_to_write(tmp_path, "--out", (".png",))
    with pytest.raises(ConfigError, match=r"the extension \.txt is not one this writes; use one of \.png"):
        check_file_to_write(tmp_path / "figure.txt", "--out", (".png", ".pdf"))
    with pytest.raises(ConfigError, match="which is a file"):
        check_file_to_write(a_file / "figure.png", "--out", (".png",))
    check_file_to_write(tmp_path / "new" / "figure.PNG", "--out", (".png",))
    assert not (tmp_path / "new").exists()  # a check writes nothing


def test_train_refuses_a_run_dir_or_model_path_it_cannot_use_before_building_anything(
        capsys, a_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "models" / "demo"
    recipe = str(ROOT / "recipes" / "demo.yaml")
    base = ["train", recipe, f"model.path={model}", "train.num_batches=2", "--plain", "--no-report"]
    refused(capsys, [*base, "--run-dir", str(a_file)], "exists and is not a folder; choose a new folder")
    refused(capsys, [*base, "--run-dir", str(a_file / "sub")], "which is a file, not a folder")
    refused(capsys, [*base, "--run-dir", ""], "--run-dir is empty")
    assert not model.exists() and not (tmp_path / "runs").exists()  # no model built, no run begun
    refused(capsys, ["train", recipe, f"model.path={a_file}", "--run-dir", str(tmp_path / "r")],
            f"model.path {a_file} is a file, not a model directory")
    refused(capsys, ["train", recipe, f"model.path={a_file / 'sub'}", "--run-dir", str(tmp_path / "r")],
            "which is a file, not a folder; choose another model.path")
    assert a_file.read_text() == "hi\n"


def test_model_writing_commands_refuse_an_out_that_is_a_file(capsys, a_file, tmp_path):
    refused(capsys, ["init-model", str(a_file)], "exists and is not a folder")
    refused(capsys, ["init-model", str(a_file / "sub")], "which is a file, not a folder")
    model = tmp_path / "tiny"
    assert main(["init-model", str(model), "--size", "tiny"]) == 0
    capsys.readouterr()
    recipe = str(ROOT / "recipes" / "demo.yaml")
    warm = ["warmstart", recipe, "--model", str(model), "--out"]
    refused(capsys, [*warm, str(a_file)], "exists and is not a folder")
    refused(capsys, [*warm, str(a_file / "sub")], "which is a file")
    assert a_file.read_text() == "hi\n"


def test_compare_refuses_a_figure_it_cannot_write_before_reading_the_runs(capsys, a_file, tmp_path):
    runs = [str(tmp_path / "a"), str(tmp_path / "b")]  # never read: the figure's name is checked first
    refused(capsys, ["compare", *runs, "--out", str(tmp_path / "cmp.txt")], "use one of .png, .pdf, .svg")
    refused(capsys, ["compare", *runs, "--out", str(tmp_path)], "is a folder; give a file name")
    refused(capsys, ["compare", *runs, "--out", str(a_file / "x.png")], "which is a file, not a folder")


def test_plan_refuses_options_it_would_ignore_or_could_not_draw(capsys):
    recipe = str(ROOT / "recipes" / "demo.yaml")
    for extra, says in [(["--width", "0"], "--width must be 10 or more"),
                        (["--width", "-5"], "--width must be 10 or more"),
                        (["--cores", "4"], "--cores only applies with --optimize"),
                        (["--vary-batch", "--top", "3"], "--vary-batch, --top only apply with --optimize"),
                        (["--optimize", "--cores", "0"], "--cores must be 1 or more, got 0"),
                        (["--optimize", "--top", "0"], "--top must be 1 or more"),
                        (["--optimize", "--staleness-cap", "-1"], "--staleness-cap must be 0 or more")]:
        refused(capsys, ["plan", recipe, *extra], says)
    assert main(["plan", recipe, "--width", "10"]) == 0


def test_plan_takes_a_pipeline_key_for_an_sd3_pipeline_the_recipe_is_to_build(capsys, tmp_path):
    """``recipes/flow-sd3.yaml`` before its first run: model.path does not exist yet, and the
    pipeline the build makes there takes a pipeline's keys; the built-in DiT still refuses them."""
    recipe, model = str(ROOT / "recipes" / "flow-sd3.yaml"), f"model.path={tmp_path / 'sd3'}"
    assert main(["plan", recipe, model, "flow.dtype=bfloat16", "--num-batches", "4"]) == 0
    refused(capsys, ["plan", recipe, model, "flow.resolution=15"],
            "flow.resolution=15 is not a multiple of 2")
    assert main(["plan", recipe, model, "flow.resolution=16", "--num-batches", "4"]) == 0
    refused(capsys, ["plan", str(ROOT / "recipes" / "flow-demo.yaml"), f"model.path={tmp_path / 'dit'}",
                     "flow.dtype=bfloat16"], "the built-in model samples in float32")
    assert not (tmp_path / "sd3").exists()


def test_sweep_refuses_an_out_that_is_a_file_and_a_value_given_twice(capsys, a_file):
    refused(capsys, ["sweep", str(ROOT / "recipes" / "demo.yaml"), "--set", "async.max_staleness=0,1",
                     "--out", str(a_file)], "exists and is not a folder")
    with pytest.raises(ConfigError, match="lists 0 more than once; give each value once"):
        parse_grid(["async.max_staleness=0,1,0"])


def test_sweep_refuses_a_kept_run_whose_recipe_is_no_longer_its_points(tmp_path):
    """A finished run of the point, recorded with lr 2e-4: the same sweep again reports it as
    done; with lr 1e-3 added it is refused, naming the key and the run, and nothing runs."""
    common = ["data.task=reverse", "rollout.batch_size=2", "train.num_batches=2"]
    grid = parse_grid(["async.max_staleness=0"])
    run = tmp_path / "out" / "async.max_staleness=0" / "seed0"
    run.mkdir(parents=True)
    kept = load_config(None, [*common, "async.max_staleness=0", "run.seed=0", "train.lr=2e-4"])
    (run / "config.yaml").write_text(kept.to_yaml())
    (run / "summary.json").write_text(json.dumps({"evals": [{"step": 2, "eval/pass_at_1": 0.5}]}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "staleness/batches": 0}) + "\n"
                                               for s in (1, 2)))

    def runner(argv, log):
        raise AssertionError(f"nothing should run: {argv}")

    said: list[str] = []
    run_sweep(None, [*common, "train.lr=2e-4"], grid, [0], tmp_path / "out", say=said.append, runner=runner)
    assert said == ["[1/1] async.max_staleness=0 seed 0: done already"]
    with pytest.raises(ConfigError) as info:
        run_sweep(None, [*common, "train.lr=1e-3"], grid, [0], tmp_path / "out", runner=runner)
    assert f"its run {run} was trained with another recipe" in str(info.value)
    assert "train.lr: 0.0002 → 0.001" in str(info.value) and "Choose another --out" in str(info.value)


def test_recipes_and_runs_that_cannot_be_what_they_claim_are_named_as_such(capsys, tmp_path):
    """A folder given as a recipe, a key given twice in a recipe file, a run whose config.yaml is
    empty, and a run that has trained no batch yet, each told for what it is."""
    refused(capsys, ["config", "show", str(tmp_path)], "is a folder; give a YAML recipe file")
    twice = tmp_path / "twice.yaml"
    twice.write_text("train:\n  lr: 0.001\n  num_batches: 4\n  lr: 0.002\n")
    refused(capsys, ["config", "show", str(twice)], "'lr' is given twice in one mapping (lines 2 and 4)")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("")
    refused(capsys, ["train", "--resume", str(run), "train.num_batches=4"], "config.yaml is empty")
    (run / "config.yaml").write_text(load_config(None, []).to_yaml())
    (run / "metrics.jsonl").write_text("")
    refused(capsys, ["report", str(run)], "has trained no batch yet")
