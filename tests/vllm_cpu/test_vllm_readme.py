"""The README's vLLM lines (``.venv-vllm/bin/tether ...``) run as a user would type them, shortened
as ``tests/readme.py`` says; the main suite runs every other line (tests/integration/test_readme.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from readme import Workspace, readme_commands

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
COMMANDS = [c for c in readme_commands() if c.venv == ".venv-vllm"]


def test_the_readme_shows_a_vllm_line():
    assert COMMANDS


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.id for c in COMMANDS])
def test_the_readme_vllm_command_runs(tmp_path, cmd):
    ws = Workspace(tmp_path)
    argv = ws.argv(cmd)
    ws.run(argv)
    run = tmp_path / argv[argv.index("--run-dir") + 1]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
