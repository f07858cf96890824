"""Every command in the README runs, as a user would type it (shortened to a few batches: see
``tests/readme.py``). The lines come from README.md itself, so a line added there is tested here,
and a line that breaks (``train.advantage=rloo`` once crashed its rollout worker) fails this test."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from readme import Command, Workspace, make_lines, readme_commands

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
COMMANDS = readme_commands()
NEEDS_RAY = ("rollout.backend=ray",)


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("readme"))


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ensure_demo(ws: Workspace) -> Path:
    """The README's main job, shortened (what ``runs/demo-<time>`` stands for)."""
    run = ws.root / "runs" / "demo"
    if not (run / "summary.json").exists():
        ws.run(ws.argv(Command(".venv", ("train", "recipes/demo.yaml"), "")))
    return run


def check_train(ws: Workspace, argv: list[str], batches: int) -> None:
    run = ws.root / argv[argv.index("--run-dir") + 1] if "--run-dir" in argv else ws.root / argv[
        argv.index("--resume") + 1]
    metrics = rows(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, batches + 1)), f"{run}: {len(metrics)} rows"
    assert (run / "summary.json").exists() and (run / "config.yaml").exists()


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.id for c in COMMANDS])
def test_the_readme_command_runs(ws: Workspace, cmd: Command):
    if cmd.venv == ".venv-vllm":
        pytest.skip("vLLM's lines run in .venv-vllm: tests/vllm_cpu/test_vllm_readme.py")
    if cmd.venv == "make":
        run_make_target(ws, cmd)
        return
    if any(w in NEEDS_RAY for w in cmd.words):
        pytest.importorskip("ray")
    verb = cmd.words[0] if cmd.words else ""
    if any(w in ("runs/demo-<time>",) for w in cmd.words):
        ensure_demo(ws)
    if verb == "compare" and not (ws.root / "runs" / "sync" / "summary.json").exists():
        ws.run(ws.argv(Command(".venv", ("train", "recipes/demo.yaml", "async.max_staleness=0"), ""), "sync"))
    if (verb == "train" and "--resume" not in cmd.words and ws.run_name(list(cmd.words)) == "demo"
            and (ws.root / "runs" / "demo").exists()):  # ensure_demo ran it for a line after it
        pytest.skip("the demo run exists already (the same line ran)")
    if verb == "warmstart":
        model = cmd.words[cmd.words.index("--model") + 1]
        if not (ws.root / model).exists():  # the init-model line before it, when run alone
            ws.run([ws.tether(cmd.venv), "init-model", model, "--size", "small"])
    argv = ws.argv(cmd)
    out = ws.run(argv)
    check_output(ws, cmd, argv, out.stdout + out.stderr)


def check_output(ws: Workspace, cmd: Command, argv: list[str], text: str) -> None:
    """What each kind of line must have produced, beyond exiting 0."""
    words = list(cmd.words)
    verb = words[0] if words else ""
    if words == ["--version"]:
        assert text.startswith("tether ")
    elif verb == "train":
        check_train(ws, argv, 3 if "--resume" in words else 2)
    elif verb == "report":
        assert sorted(p.name for p in (ws.root / "runs" / "demo" / "plots").glob("*.png"))
    elif verb == "eval":
        assert "pass@8" in text or "pass_at_8" in text, text[-1500:]
    elif verb == "compare":
        assert (ws.root / "compare.png").stat().st_size > 0
    elif verb == "plan":
        if "--json" in words:
            doc = json.loads(text[text.index("{"):])
            assert len(doc["batches"]) == doc["settings"]["num_batches"]
        else:
            assert "staleness" in text
    elif verb == "sweep":
        doc = json.loads((ws.root / "runs" / "sweep" / "sweep.json").read_text())
        assert len(doc["rows"]) == 2 and all(r["done"] for r in doc["rows"]), doc
        assert (ws.root / "runs" / "sweep" / "sweep.png").stat().st_size > 0
    elif verb == "config":
        assert "max_staleness" in text
    elif verb == "tasks":
        assert "arithmetic" in text
    elif verb == "init-model":
        assert (ws.root / words[1] / "config.json").exists()
    elif verb == "warmstart":
        assert (ws.root / words[words.index("--out") + 1] / "config.json").exists()
    else:
        raise AssertionError(f"README line `tether {' '.join(words)}`: tests/integration/test_readme.py "
                             "does not know what it should produce; add a check")


def readme_twin(target: str) -> Command | None:
    """The README's own ``tether`` line that a Makefile target runs word for word, if there is one
    (``make demo`` is ``tether train recipes/demo.yaml``): that line's run is the target's."""
    lines = make_lines(target)
    words = shlex.split(lines[0]) if len(lines) == 1 else []
    if words[:1] != ["$(VENV)/bin/tether"]:
        return None
    return next((c for c in COMMANDS if c.venv == ".venv" and c.words == tuple(words[1:])), None)


def run_make_target(ws: Workspace, cmd: Command) -> None:
    (target,) = cmd.words
    if target == "test":
        pytest.skip("`make test` is this suite (.ci/run calls it)")
    twin = readme_twin(target)
    if twin is not None:  # one run for both lines
        argv = ws.argv(twin)
        if not (ws.root / argv[argv.index("--run-dir") + 1] / "summary.json").exists():
            ws.run(argv)
        check_train(ws, argv, 2)
        return
    for line in ws.run_make(target):
        assert line.returncode == 0
    if (ws.root / "runs" / f"make-{target}").exists():
        metrics = rows(ws.root / "runs" / f"make-{target}" / "metrics.jsonl")
        assert [m["step"] for m in metrics] == [1, 2]
    else:
        raise AssertionError(f"make {target} trained no run under runs/make-{target}")


def test_every_readme_line_is_one_this_module_knows():
    # A README line of an unknown kind is refused by readme_commands() itself; here, that the
    # README still shows the lines the project promises (the two commands and the main job).
    words = {c.words for c in COMMANDS}
    assert ("demo",) in words and ("test",) in words and ("train", "recipes/demo.yaml") in words
    assert any(c.venv == ".venv-vllm" for c in COMMANDS)
