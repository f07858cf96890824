"""train.activation_checkpointing: each layer's activations recomputed in the backward.

The gradients are the unmarked model's to float32 rounding — through the model's own forward and
the shared-prompt forward, with and without LoRA adapters, for the flow transformer, and on two
FSDP2 ranks — while a forward with gradients keeps a fraction of the tensors (measured with
autograd's saved-tensor hooks) and a forward without gradients runs no checkpoint at all. A run
trains with it; a model with no layers to recompute is refused at load."""

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_learner import sampled_batch  # noqa: E402
from test_sharded_learner import batches, ranks, trained  # noqa: E402

from configs import config  # noqa: E402
from procs import wait_gone  # noqa: E402
from tether import recompute  # noqa: E402
from tether.decoding.prefix_forward import SharedPrefixForward  # noqa: E402
from tether.families.text.batch import to_train_batch  # noqa: E402
from tether.families.text.policy import TextPolicy  # noqa: E402
from tether.train.learner import TorchLearner  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
REWARD = Path(__file__).parent / "varied_reward.py"


class Saved:
    """Bytes of the tensors autograd keeps for the backward outside any checkpointed region."""

    def __init__(self) -> None:
        self.bytes = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def pack(self, t):
        self.bytes += t.numel() * t.element_size()
        return t

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


@pytest.fixture
def checkpoints(monkeypatch):
    """Counts the checkpointed calls ``tether.recompute`` makes."""
    calls = []
    real = recompute.checkpoint

    def counted(fn, *args, **kwargs):
        calls.append(fn)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(recompute, "checkpoint", counted)
    return calls


def text_gradients(model_dir, *, shared: bool, lora_rank: int, mark: bool, calls: list):
    """(gradients by name, bytes kept for the backward) of a weighted sum of the log-probs of a
    real rollout batch; checks that a forward without gradients checkpoints nothing."""
    from tether.adapters import attach

    policy = TextPolicy(1.0)
    model, tok = policy.load(model_dir)
    if lora_rank:
        torch.manual_seed(0)  # PEFT draws A at random
        model = attach(model, config(lora_rank=lora_rank, lora_alpha=16).train)
        with torch.no_grad():  # B starts at zero: make the adapters matter
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    model.train()
    layers = policy.layers(model)
    assert len(layers) == model.config.num_hidden_layers
    if mark:
        recompute.recompute(layers)
    forward = SharedPrefixForward(model) if shared else None
    batch, _ = sampled_batch(model_dir)
    tb = to_train_batch(batch.payload, tok.pad_token_id)
    weights = torch.linspace(-1, 1, tb.mask.numel()).view_as(tb.mask) * tb.mask
    with torch.no_grad():
        policy.forward(model, tb, forward=forward)
    assert calls == []  # π_old, the reference, evaluations: nothing checkpointed
    with Saved() as saved:
        logp, _, _ = policy.forward(model, tb, with_entropy=True, forward=forward)
    assert len(calls) == (len(layers) if mark else 0)
    (logp * weights).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, saved.bytes


@pytest.mark.parametrize(("shared", "lora_rank"), [(False, 0), (True, 0), (False, 4), (True, 4)],
                         ids=["own", "shared-prefix", "own-lora", "shared-prefix-lora"])
def test_recomputed_layers_give_the_unmarked_gradients_and_keep_a_fraction(tiny_model_dir, checkpoints,
                                                                          shared, lora_rank):
    plain, kept = text_gradients(tiny_model_dir, shared=shared, lora_rank=lora_rank, mark=False,
                                 calls=checkpoints)
    marked, kept_marked = text_gradients(tiny_model_dir, shared=shared, lora_rank=lora_rank, mark=True,
                                         calls=checkpoints)
    assert set(marked) == set(plain) and plain
    if lora_rank:
        assert all(".lora_" in name for name in plain)
    for name, g in plain.items():
        assert torch.allclose(marked[name], g, rtol=1e-5, atol=1e-7), name
    print(f"\nkept for the backward: {kept / 2**10:.0f} KiB → {kept_marked / 2**10:.0f} KiB")
    assert kept_marked < kept / 3


def test_the_flow_transformers_blocks_recompute_with_the_same_gradients(checkpoints):
    from tether.families.flow import scenes
    from tether.families.flow.learn import FlowPolicy
    from tether.families.flow.model import FlowModel, FlowModelConfig

    def gradients(mark: bool):
        torch.manual_seed(0)
        model = FlowModel(FlowModelConfig(vocab=scenes.WORDS, width=32, depth=3, patch=4))
        with torch.no_grad():  # adaLN-Zero starts at the zero velocity: give every block a say
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        blocks = FlowPolicy().layers(model)
        assert len(blocks) == 3
        if mark:
            recompute.recompute(blocks)
        g = torch.Generator().manual_seed(1)
        x, t = torch.randn(4, 3, 16, 16, generator=g), torch.rand(4, generator=g)
        words = torch.randint(0, len(scenes.WORDS), (4, 4), generator=g)
        with Saved() as saved:
            v = model(x, t, words)
        (v * torch.randn(v.shape, generator=g)).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}, saved.bytes

    plain, kept = gradients(False)
    marked, kept_marked = gradients(True)
    assert len(checkpoints) == 3
    for name, g in plain.items():
        assert torch.allclose(marked[name], g, rtol=1e-5, atol=1e-7), name
    assert kept_marked < kept / 2


@pytest.mark.parametrize("shared_prefix", [False, True], ids=["own", "shared-prefix"])
def test_two_ranks_that_recompute_make_the_single_process_update(tiny_model_dir, shared_prefix):
    """Marked before ``fully_shard``: FSDP2 gathers each layer's weights again for its recompute,
    and the ranks' update is one process's without checkpointing (the tolerance of
    tests/integration/test_sharded_learner.py)."""
    rollout_batches = batches(tiny_model_dir)
    keys = {"shared_prefix": shared_prefix, "updates_per_batch": 2, "lr": 5e-5}
    solo_weights, solo = trained(TorchLearner(tiny_model_dir, config(**keys)), rollout_batches)
    sharded = ranks(config(world_size=2, activation_checkpointing=True, **keys), tiny_model_dir)
    try:
        pids = list(sharded.pids)
        weights, two = trained(sharded, rollout_batches)
    finally:
        sharded.close()
    assert wait_gone(pids) == []
    worst = max(((weights[n] - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item()
                for n, ref in solo_weights.items())
    print(f"\nrecomputing ranks vs one process: max relative parameter difference {worst:.1e}")
    assert worst <= 1e-5
    for a, b in zip(solo, two, strict=True):
        assert b.committed_updates == a.committed_updates == 2
        assert b.metrics["loss/policy"] == pytest.approx(a.metrics["loss/policy"], rel=1e-4, abs=1e-6)


def tether(*args):
    return subprocess.run([sys.executable, "-m", "tether.cli.main", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)


def test_a_run_trains_with_checkpointing_on(tiny_model_dir, tmp_path):
    out = tether("train", "--run-dir", tmp_path / "run", "--plain", "--no-report",
                 f"model.path={tiny_model_dir}", f"reward.function={REWARD}:reward", "data.task=reverse",
                 "data.num_train=100", "data.num_eval=8", "rollout.batch_size=2", "rollout.group_size=2",
                 "rollout.max_new_tokens=4", "train.num_batches=2", "eval.interval=0",
                 "checkpoint.interval=0", "train.activation_checkpointing=true")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "train.activation_checkpointing: 2 layers recompute their activations" in out.stderr
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def test_a_model_with_no_layers_to_recompute_is_refused_at_load(tmp_path):
    from test_plugin_family import write_recipe

    out = tether("train", write_recipe(tmp_path), "--run-dir", tmp_path / "run", "--plain", "--no-report",
                 "train.activation_checkpointing=true")
    assert out.returncode == 2, out.stderr[-3000:]
    assert ("train.activation_checkpointing=true: the model.family=bandit model (BanditModel) has no layers "
            "to recompute") in out.stderr
    assert "set train.activation_checkpointing=false" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_diffusers_transformers_blocks_recompute_with_the_same_gradients(tmp_path, checkpoints):
    pytest.importorskip("diffusers")
    from tether.families.flow.learn import FlowPolicy
    from tether.families.flow.pipeline import DiffusersFlow
    from tether.families.flow.tiny_sd3 import build_tiny_sd3

    build_tiny_sd3(tmp_path / "sd3")

    def gradients(mark: bool):
        torch.manual_seed(0)
        model = DiffusersFlow.from_pretrained(tmp_path / "sd3", whole=False)
        config = model.transformer.config
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        blocks = FlowPolicy().layers(model)
        assert len(blocks) == config.num_layers == 2
        if mark:
            recompute.recompute(blocks)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, config.in_channels, config.sample_size, config.sample_size, generator=g)
        cond = {"prompt_embeds": torch.randn(2, 8, config.joint_attention_dim, generator=g),
                "pooled_projections": torch.randn(2, config.pooled_projection_dim, generator=g)}
        v = model(x, torch.rand(2, generator=g), cond)
        (v * torch.randn(v.shape, generator=g)).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, marked = gradients(False), gradients(True)
    assert len(checkpoints) == 2  # build_tiny_sd3's depth: one checkpointed call per block
    for name, g in plain.items():
        assert torch.allclose(marked[name], g, rtol=1e-5, atol=1e-7), name
