"""A finished run's rollout workers and learner ranks exit through their own exit handlers, so a
library's named semaphores are unlinked there: nothing is left to multiprocessing's resource
tracker, which would unlink it and warn the user of a leak."""

import pytest

pytest.importorskip("torch")

from runs import ROOT, Run, recipe

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PLUGIN = ROOT / "tests" / "faults" / "named_semaphore.py"


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_finished_run_leaves_nothing_to_the_resource_tracker(tiny_model_dir, tmp_path, world_size):
    run_dir = tmp_path / "run"
    keys = recipe(tiny_model_dir, f"run.plugins=[{PLUGIN}]", "train.num_batches=2", "checkpoint.interval=0",
                  f"train.world_size={world_size}")
    run = Run([*keys, "--run-dir", str(run_dir)], run_dir=run_dir)
    out, err = run.proc.communicate(timeout=240)
    assert run.proc.returncode == 0, err[-3000:]
    assert "trained 2 batches" in out + err
    assert "resource_tracker" not in err, err[-3000:]
