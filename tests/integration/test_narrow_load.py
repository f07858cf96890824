"""A float32 model folder read in bfloat16 part by part (``tether.narrow_load``), and the learner
that reads a LoRA run's frozen base that way (``train.lora_rank`` with ``train.dtype=bfloat16``),
on the tiny model of tests/integration/test_precision.py."""

import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_learner import sampled_batch  # noqa: E402

from configs import config  # noqa: E402
from tether import narrow_load  # noqa: E402
from tether.families.text import policy as text_policy  # noqa: E402
from tether.families.text.batch import to_train_batch  # noqa: E402
from tether.modeling import load_causal_lm  # noqa: E402
from tether.train import lora  # noqa: E402
from tether.train.learner import TorchLearner  # noqa: E402
from tether.train.precision import Precision  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
LORA = {"lora_rank": 4, "lora_targets": ["q_proj", "v_proj", "up_proj"]}


@pytest.fixture(scope="module")
def batch(tiny_model_dir):
    """A real rollout batch (4 prompts × 4 samples) of the float32 engine."""
    return sampled_batch(tiny_model_dir, seed=0)[0]


@pytest.fixture
def no_from_pretrained(monkeypatch):
    """transformers' whole-file load made to fail: what loads then was read part by part."""
    from transformers import AutoModelForCausalLM

    def refuse(*args, **kwargs):
        raise AssertionError("read through from_pretrained, not part by part")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


def test_a_float32_folder_read_in_bfloat16_part_by_part_is_from_pretrained_s_cast(
        tiny_model_dir, monkeypatch, request):
    reference = _from_pretrained(tiny_model_dir, torch.bfloat16)
    monkeypatch.setattr(narrow_load, "SLICE_BYTES", 256)  # many slices a tensor
    request.getfixturevalue("no_from_pretrained")
    model, _ = load_causal_lm(tiny_model_dir, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied as the folder says
    assert model.generation_config.eos_token_id == reference.generation_config.eos_token_id
    assert not model.training
    assert not any(b.is_meta for b in model.buffers())  # rotary frequencies computed, not left unset


def test_a_folder_of_other_tensors_is_read_by_from_pretrained(tiny_model_dir, tmp_path):
    """A tensor the model does not have (or one it misses) leaves the folder to transformers."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "extra"
    shutil.copytree(tiny_model_dir, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({**tensors, "unused.weight": torch.zeros(2)}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    model, _ = load_causal_lm(folder, dtype=torch.bfloat16)  # transformers ignores the extra one
    reference = _from_pretrained(tiny_model_dir, torch.bfloat16)
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in model.state_dict().items())


def _from_pretrained(folder, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)


@pytest.fixture
def read_dtypes(monkeypatch):
    """The dtypes the text policy's loads asked for, in order."""
    seen = []
    original = text_policy.load_causal_lm

    def spy(path, *, dtype=torch.float32):
        seen.append(dtype)
        return original(path, dtype=dtype)

    monkeypatch.setattr(text_policy, "load_causal_lm", spy)
    return seen


def test_a_bfloat16_lora_learner_reads_its_base_in_bfloat16_and_trains_float32_adapters(
        tiny_model_dir, batch, read_dtypes, request):
    request.getfixturevalue("no_from_pretrained")  # part by part: no float32 copy of the base
    learner = TorchLearner(tiny_model_dir, config("train.dtype=bfloat16", "train.kl_coef=0.1", **LORA))
    assert read_dtypes == [torch.bfloat16]  # once: the KL reference is the base, adapters off
    assert learner.ref_model is None
    frozen = [p for p in learner.model.parameters() if not p.requires_grad]
    adapters = [p for p in learner.model.parameters() if p.requires_grad]
    assert frozen and {p.dtype for p in frozen} == {torch.bfloat16}
    assert adapters and {p.dtype for p in adapters} == {torch.float32}
    assert learner.params == adapters
    result = learner.train(batch, train_version=0)
    assert result.committed_updates == 1
    assert all(s["exp_avg"].dtype == torch.float32 for s in learner.optimizer.state.values())
    assert {p.dtype for p in adapters} == {torch.float32}


def test_its_log_probs_are_the_float32_read_then_cast_base_s(tiny_model_dir, batch):
    """The earlier path: the base read in float32, adapters attached, the frozen part cast down.
    The same base weights (a float32 → bfloat16 cast is one rounding either way) and adapters
    whose B is still 0: the same log-probs, bit for bit."""
    torch.manual_seed(0)
    learner = TorchLearner(tiny_model_dir, config("train.dtype=bfloat16", **LORA))
    torch.manual_seed(0)
    model, tokenizer = load_causal_lm(tiny_model_dir)
    model = lora.attach(model, learner.s)
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    tb = to_train_batch(batch.payload, tokenizer.pad_token_id)
    with torch.no_grad():
        ours = learner.policy.forward(learner.model, tb)[0]
        before = learner.policy.forward(model, tb)[0]
    assert ours.dtype == torch.float32
    assert torch.equal(ours * tb.mask, before * tb.mask)


@pytest.mark.parametrize("dtype,lora_rank", [("bfloat16", 0), ("float32", 4)])
def test_without_lora_or_in_float32_the_model_is_read_in_float32(tiny_model_dir, read_dtypes, dtype,
                                                                 lora_rank):
    """Full fine-tuning keeps float32 master weights; a float32 LoRA learner a float32 base."""
    learner = TorchLearner(tiny_model_dir, config(f"train.dtype={dtype}", "train.kl_coef=0.1",
                                                  **(LORA if lora_rank else {})))
    assert set(read_dtypes) == {torch.float32}
    assert {p.dtype for p in learner.model.parameters()} == {torch.float32}
    if not lora_rank:
        assert {p.dtype for p in learner.ref_model.parameters()} == {torch.float32}


def test_load_dtype_is_the_compute_dtype_for_a_frozen_model_only():
    assert Precision("bfloat16", torch.device("cpu")).load_dtype(frozen=True) == torch.bfloat16
    assert Precision("bfloat16", torch.device("cpu")).load_dtype(frozen=False) == torch.float32
    assert Precision("float32", torch.device("cpu")).load_dtype(frozen=True) == torch.float32


def test_a_bfloat16_built_in_engine_reads_its_model_part_by_part(tiny_model_dir, request):
    """``rollout.dtype=bfloat16``: the engine's worker holds no float32 copy at load either."""
    from tether import registry
    from tether.config import load_config

    reference = _from_pretrained(tiny_model_dir, torch.bfloat16).state_dict()
    _, tok = load_causal_lm(tiny_model_dir)
    request.getfixturevalue("no_from_pretrained")
    engine = registry.engines.get("torch").build(load_config(None, ["rollout.dtype=bfloat16"]),
                                                 str(tiny_model_dir), tok, [tok.eos_token_id],
                                                 device=torch.device("cpu"), threads=1, seed=0)
    assert all(torch.equal(v, reference[k]) for k, v in engine.model.state_dict().items())
    assert engine.model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_the_shared_prompt_forward_keeps_no_merged_adapted_weight(tiny_model_dir, batch):
    """With adapters, a training forward reads each adapted layer as its terms, x·W₀ᵀ +
    (α/r)·(x·Aᵀ)·Bᵀ: autograd keeps no new weight-sized tensor (a merged W₀ + (α/r)·B·A of every
    layer at once would be a whole base model's worth), and the adapters get their gradients."""
    from tether.decoding.prefix_forward import SharedPrefixForward

    learner = TorchLearner(tiny_model_dir, config("train.dtype=bfloat16", lora_rank=4))  # all-linear
    model = learner.model
    assert isinstance(learner.forward, SharedPrefixForward)
    sizes = {p.numel() for n, p in model.named_parameters() if ".base_layer." in n}
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = []

    def pack(t):
        if t.numel() in sizes and t.untyped_storage().data_ptr() not in own:
            kept.append(tuple(t.shape))
        return t

    tb = to_train_batch(batch.payload, learner.tokenizer.pad_token_id)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp = learner.policy.forward(model, tb, forward=learner.forward)[0]
    assert kept == []
    (logp * tb.mask).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    assert all(g.abs().sum() > 0 for n, g in grads.items() if ".lora_B." in n)  # A's: 0 while B is 0


def test_two_bfloat16_lora_ranks_make_the_one_process_update(tiny_model_dir, batch):
    """Learner ranks read the base in bfloat16 too (FSDP2 shards a bfloat16 base beside float32
    adapters): their update is the one bfloat16 process's to bfloat16's rounding."""
    from learners import solo_and_ranks

    overrides = ("train.dtype=bfloat16", "train.lora_rank=4", "train.lora_alpha=8", "train.lr=3e-3")
    (solo, solo_results), (ranked, results) = solo_and_ranks(
        tiny_model_dir, config(*overrides), config(*overrides, "train.world_size=2"), [batch])
    assert set(ranked) == set(solo) and all(".lora_" in n for n in ranked)
    assert {w.dtype for w in ranked.values()} == {torch.float32}
    # Adam's first step is ±lr for every element whatever its gradient's size, so an element whose
    # gradient is near 0 takes rounding's sign (worst_relative: 2); the whole update agrees closely
    gap = (torch.cat([(ranked[n] - solo[n]).flatten() for n in solo]).norm()
           / torch.cat([solo[n].flatten() for n in solo]).norm())
    print(f"\ntwo bfloat16 LoRA ranks vs one process: {float(gap):.2e}")
    assert gap < 0.05
    for a, b in zip(solo_results, results, strict=True):
        assert b.committed_updates == a.committed_updates == 1


def test_a_plug_in_policy_whose_load_takes_no_dtype_reads_float32_and_is_settled_after():
    """A family's ``load(path)`` written before the dtype: called as before; ``settle`` then casts
    its frozen parameters to the compute dtype and keeps the trained ones float32."""
    calls = []

    class Old:
        def load(self, path):
            calls.append(path)
            model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
            model[0].requires_grad_(False)
            return model, None

    precision = Precision("bfloat16", torch.device("cpu"))
    model, _ = precision.load(Old(), "here", frozen=True)
    assert calls == ["here"]
    assert precision.settle(model) == 6
    assert [p.dtype for p in model.parameters()] == [torch.bfloat16] * 2 + [torch.float32] * 2
