"""A learner that runs out of memory says in which phase and which keys lower it
(``LearnerMemoryError``), and the run ends leaving its directory resumable."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_learner import sampled_batch  # noqa: E402

from configs import config  # noqa: E402
from tether.errors import LearnerMemoryError  # noqa: E402
from tether.train import learner as learner_module  # noqa: E402
from tether.train.learner import TorchLearner  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent


def out_of_memory(*args, **kwargs):
    raise MemoryError


def cuda_out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize(("phase", "says", "lowers", "not_offered"), [
    ("old", "π_old and the reference", ["train.micro_batch_size: fewer sequences per forward (now 0, a whole "
                                        "mini-batch; halve it)", "train.world_size"],
     ["train.activation_checkpointing", "train.lora_rank"]),
    ("update", "an update's forward and backward",
     ["train.micro_batch_size", "train.activation_checkpointing=true", "train.lora_rank", "train.world_size"], []),
    ("update-recomputing", "an update's forward and backward",
     ["train.micro_batch_size", "train.lora_rank", "train.world_size"], ["train.activation_checkpointing"]),
    ("optimizer", "the optimizer step", ["train.lora_rank", "train.world_size"], ["train.micro_batch_size"]),
    ("publication", "the publication", ["train.lora_rank"], ["train.micro_batch_size"]),
])
def test_each_phase_that_runs_out_of_memory_is_named_with_what_lowers_it(tiny_model_dir, monkeypatch, phase,
                                                                         says, lowers, not_offered):
    batch, _ = sampled_batch(tiny_model_dir)
    learner = TorchLearner(tiny_model_dir, config(updates_per_batch=2, shared_prefix=False,
                                                  activation_checkpointing=phase == "update-recomputing"))
    forward = learner.policy.forward

    def forward_without_room(*args, grad: bool, **kwargs):
        if torch.is_grad_enabled() == grad:
            raise MemoryError
        return forward(*args, **kwargs)

    if phase == "old":
        monkeypatch.setattr(learner.policy, "forward", lambda *a, **k: forward_without_room(*a, grad=False, **k))
    elif phase.startswith("update"):
        monkeypatch.setattr(learner.policy, "forward", lambda *a, **k: forward_without_room(*a, grad=True, **k))
    elif phase == "optimizer":
        monkeypatch.setattr(learner.optimizer, "step", cuda_out_of_memory)
    else:
        monkeypatch.setattr(learner_module, "unique_parameters", out_of_memory)
    with pytest.raises(LearnerMemoryError) as info:
        if phase == "publication":
            learner.export_weights()
        else:
            learner.train(batch, train_version=0)
    message = str(info.value)
    assert message.startswith(f"the learner ran out of memory in {says}"), message
    for key in lowers:
        assert key in message, (key, message)
    for key in not_offered:
        assert key not in message, (key, message)
    assert isinstance(info.value.__cause__, MemoryError | torch.OutOfMemoryError)


def tether(*args, env=None):
    return subprocess.run([sys.executable, "-m", "tether.cli.main", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240, env={**os.environ, **(env or {})})


def test_a_run_out_of_memory_says_where_and_resumes_from_its_last_checkpoint(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    recipe = [f"run.plugins=[{HERE / 'oom_loss.py'}]", "train.loss=oom_at", f"model.path={tiny_model_dir}",
              f"reward.function={HERE / 'varied_reward.py'}:reward", "data.task=reverse", "data.num_train=100",
              "data.num_eval=8", "rollout.batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
              "train.num_batches=4", "eval.interval=0", "checkpoint.interval=1"]
    # one loss call per batch (one update, one micro-batch): the third batch's update fails
    failed = tether("train", "--run-dir", run, "--plain", "--no-report", *recipe, env={"OOM_AT_CALL": "3"})
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert ("tether train: error: the learner ran out of memory in an update's forward and backward. "
            "what lowers it: train.micro_batch_size") in failed.stderr
    assert "train.activation_checkpointing=true" in failed.stderr
    assert f"resume with `tether train --resume {run}`" in failed.stderr
    assert "Traceback" not in failed.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000001", "step-000002"]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    resumed = tether("train", "--resume", run, "--plain", "--no-report")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
