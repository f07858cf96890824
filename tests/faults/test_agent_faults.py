"""A hung environment in a real agent run: the run stops with the failure's own message once
failed episodes pass ``env.max_failed_frac``, and leaves no process, shared memory or partial
checkpoint behind, though the hung calls never return."""

from pathlib import Path

import pytest
from runs import Run, leftovers

pytest.importorskip("torch")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
ENVS = Path(__file__).resolve().parents[1] / "agents" / "envs.py"


def test_a_hung_environment_fails_the_run_clearly_and_leaves_nothing_running(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    run = Run([f"model.path={tiny_model_dir}", "model.family=agent", "data.task=kv_lookup",
               f"env.env_class={ENVS}:Hangs", "env.step_timeout_s=1", "env.max_turn_tokens=4",
               "rollout.max_new_tokens=4", "data.num_train=100", "data.num_eval=8", "rollout.batch_size=2",
               "rollout.group_size=2", "train.num_batches=20", "eval.interval=0", "checkpoint.interval=5",
               "--run-dir", run_dir], run_dir=run_dir)
    run.look()
    _, err = run.finish(timeout=180)
    assert run.proc.returncode != 0
    assert "4 of 4 episodes of rollout batch" in err and "step ran past its timeout" in err, err[-2000:]
    assert "env.max_failed_frac" in err
    assert run.left() == ""
    assert run.shm == set() or all(not Path("/dev/shm", name).exists() for name in run.shm)
    assert leftovers(run_dir) == []
