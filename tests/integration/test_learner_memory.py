"""A learner that runs out of memory says in which phase and which keys lower it
(``LearnerMemoryError``); what a run does then is tests/faults/test_out_of_memory.py."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_learner import sampled_batch  # noqa: E402

from configs import config  # noqa: E402
from tether.errors import LearnerMemoryError  # noqa: E402
from tether.train import learner as learner_module  # noqa: E402
from tether.train.learner import TorchLearner  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def out_of_memory(*args, **kwargs):
    raise MemoryError


def cuda_out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize(("phase", "says", "lowers", "not_offered"), [
    ("old", "π_old and the reference", ["train.micro_batch_size: fewer sequences per forward (now 0, a whole "
                                        "mini-batch; halve it)", "train.world_size"],
     ["train.activation_checkpointing", "train.lora_rank"]),
    ("update", "an update's forward and backward",
     ["train.micro_batch_size", "train.activation_checkpointing=true", "train.lora_rank", "train.world_size"],
     []),
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

    if phase == "old" or phase.startswith("update"):
        grad = phase != "old"
        monkeypatch.setattr(learner.policy, "forward",
                            lambda *a, **k: forward_without_room(*a, grad=grad, **k))
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


def test_a_bfloat16_learner_is_offered_only_where_the_family_has_one():
    """train.dtype=bfloat16 lowers a forward's memory for the text and agent families; the flow
    family refuses it, so its advice leaves it out."""
    from tether.config import load_config
    from tether.train import memory

    text = load_config(None, []).train
    flow = load_config(None, ["model.family=flow", "data.task=shapes"]).train
    assert any(k.startswith("train.dtype=bfloat16") for k in memory.knobs("update", text, bf16=True))
    assert not any(k.startswith("train.dtype") for k in memory.knobs("update", flow, bf16=False))
    with pytest.raises(LearnerMemoryError) as e, memory.phase("old", flow, bf16=False):
        raise MemoryError
    assert "train.dtype" not in str(e.value) and "train.micro_batch_size" in str(e.value)


def test_a_process_killed_in_a_phase_is_named_by_its_mark_and_by_the_out_of_memory_killer(tmp_path,
                                                                                          monkeypatch):
    """What ``procinfo.killed`` adds to "killed by SIGKILL": the phase the process had marked, and,
    where the kernel's out-of-memory count rose meanwhile, that and what lowers that phase."""
    from types import SimpleNamespace

    from tether import procinfo
    from tether.train import memory

    train = SimpleNamespace(max_tokens_per_micro_batch=0, micro_batch_size=4, world_size=1, lora_rank=0,
                            dtype="float32", activation_checkpointing=False)
    monkeypatch.setenv(procinfo.MARKS_ENV, str(tmp_path))
    monkeypatch.setattr(procinfo, "oom_kills", lambda: 3)  # the kernel's count: none since "before" (3)
    mark = tmp_path / str(__import__("os").getpid())
    with memory.phase("update", train):
        with memory.phase("optimizer", train):
            assert mark.read_text().startswith("the optimizer step\n")
        assert mark.read_text().startswith("an update's forward and backward\n")  # the outer one again
        assert procinfo.killed(0, tmp_path, 3) == ""  # a process with no mark
        pid = int(mark.name)
        assert procinfo.killed(pid, tmp_path, 3) == ", in an update's forward and backward"
        monkeypatch.setattr(procinfo, "oom_kills", lambda: 4)
        said = procinfo.killed(pid, tmp_path, 3)
        assert said.startswith("; the kernel's out-of-memory killer ended a process meanwhile, and the "
                               "learner ran out of memory in an update's forward and backward. what lowers "
                               "it: train.micro_batch_size")
    assert mark.read_text() == ""  # out of every phase
    assert procinfo.killed(pid, tmp_path, 3).startswith("; the kernel's out-of-memory killer ended a process "
                                                        "meanwhile (this one outside")
