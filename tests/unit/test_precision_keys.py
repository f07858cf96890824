"""``train.dtype`` / ``train.reduce_dtype`` refused where they cannot act, before anything starts."""

import pytest

torch = pytest.importorskip("torch")

from tether.config import load_config  # noqa: E402
from tether.errors import ConfigError  # noqa: E402
from tether.modeling import check_dtype_on_device  # noqa: E402
from tether.runtime.assemble import assemble  # noqa: E402
from tether.train import precision  # noqa: E402


def test_reduce_dtype_without_bfloat16_ranks_is_refused():
    for extra in ([], ["train.dtype=bfloat16"], ["train.world_size=2"]):
        with pytest.raises(ConfigError, match=r"train.reduce_dtype=bfloat16 has no effect with .*; remove "
                                              "it, or set train.dtype=bfloat16 and train.world_size > 1"):
            load_config(None, ["train.reduce_dtype=bfloat16", *extra])
    cfg = load_config(None, ["train.dtype=bfloat16", "train.world_size=2", "train.reduce_dtype=bfloat16"])
    policy = precision.of(cfg, torch.device("cpu")).fsdp_policy()
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    assert precision.of(load_config(None, []), torch.device("cpu")).fsdp_policy() is None


def test_the_flow_family_refuses_a_bfloat16_learner():
    with pytest.raises(ConfigError, match=r"train.dtype=bfloat16 asks for a bfloat16 learner .* "
                                          r"model.family=flow does not have \(its learner computes in "
                                          "float32; flow.dtype sets"):
        load_config(None, ["model.family=flow", "data.task=shapes", "train.dtype=bfloat16"])


def test_bfloat16_on_a_gpu_without_it_is_refused_before_the_run_starts(monkeypatch):
    """A CUDA device without bfloat16 (before Ampere, or a build without it): refused by the check
    every run makes before it starts (``Parts.check_here``), naming the key. No GPU is needed: the
    device's answers are stood in for."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100")
    cfg = load_config(None, ["train.device=cuda", "train.dtype=bfloat16"])
    with pytest.raises(ConfigError, match=r"train.dtype=bfloat16, but Tesla V100 \(torch .*\) has no "
                                          "bfloat16 support; set train.dtype=float32"):
        assemble(cfg).check_here()
    assemble(load_config(None, ["train.device=cuda"])).check_here()  # float32 asks nothing of it
    check_dtype_on_device("bfloat16", "cpu")  # every CPU build computes in bfloat16


def test_cpu_offload_without_gpu_ranks_is_refused():
    """train.cpu_offload moves FSDP2 ranks' shards off their GPUs: without ranks on CUDA there is
    nothing to move, and the key is refused rather than ignored."""
    for extra in ([], ["train.world_size=2"], ["train.device=cuda"]):
        with pytest.raises(ConfigError, match=r"train.cpu_offload=true offloads FSDP2 ranks' shards .* set "
                                              r"train.device=cuda and train.world_size > 1, or remove"):
            load_config(None, ["train.cpu_offload=true", *extra])


def test_a_bfloat16_rollout_worker_on_a_gpu_without_it_is_refused_naming_rollout_dtype(monkeypatch):
    """A Ray worker on a GPU (ray.gpus_per_worker) builds the torch engine there: refused before
    the model loads, naming rollout.dtype, not a kernel error from the first decode step."""
    from tether.rollout.engines.torch import TORCH

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100")
    cfg = load_config(None, ["rollout.dtype=bfloat16"])
    with pytest.raises(ConfigError, match=r"rollout.dtype=bfloat16, but Tesla V100 \(torch .*\) has no "
                                          "bfloat16 support; set rollout.dtype=float32"):
        TORCH.build(cfg, "/nonexistent", None, (), device="cuda", threads=1, seed=0)
