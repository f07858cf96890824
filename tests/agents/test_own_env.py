"""The worked example of docs/agents.md: a user's own async environment (examples/lookup/env.py)
over a user's dataset rows, through `tether train` and `tether eval` from its recipe."""

import json
from pathlib import Path

import pytest
from cli_run import tether

pytest.importorskip("torch")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]


def test_the_own_environment_recipe_trains_and_evaluates_on_its_rows(kv_lookup_model, tmp_path):
    # a model that sometimes answers right: the tiny one, warm-started briefly on kv_lookup's scripts
    # (the format the example's tool speaks), as `make agent-demo` does for the recipe's own model
    model = kv_lookup_model
    run = tmp_path / "run"
    args = ["recipes/agent-own-env.yaml", f"model.path={model}", "train.num_batches=3",
            "rollout.batch_size=2", "rollout.group_size=4", "eval.interval=3", "--run-dir", run, "--plain",
            "--no-report"]
    tether("train", *args)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3
    for m in metrics:  # the environment's own observations reached the sequences, nothing failed
        assert m["agent/env_tokens_mean"] >= 7 and m["agent/env_errors"] == 0 and m["agent/timeouts"] == 0
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 3] and evals[-1]["eval/examples"] == 50.0
