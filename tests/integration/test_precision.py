"""A bfloat16 learner (``train.dtype``) and a bfloat16 engine (``rollout.dtype``) on the tiny model.

How close is "close": AdamW's first steps move every weight by about ±lr whatever its gradient's
size, so the sign of a near-zero gradient decides a whole step and two precisions' weights differ
by a few percent of the update after one step, however close their gradients (the bfloat16
gradient is within 1% of the float32 one, cosine 0.99997). The update is compared by what it does
instead: the change of every sampled sequence's log-probability under a float32 forward, which
the large-gradient directions decide. Measured (lr 1e-3, three batches): bfloat16 against float32
0.44% of that change, two bfloat16 ranks against one bfloat16 process 0.48%, two float32 ranks
against one float32 process 4e-6. bfloat16 keeps 8 bits of mantissa (a relative step of 0.39%),
so 2.5% is a few of its roundings, and 1e-4 is far above float32's.
"""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_learner import sampled_batch  # noqa: E402

from configs import config  # noqa: E402
from learners import solo_and_ranks, trained  # noqa: E402
from tether import registry  # noqa: E402
from tether.config import load_config  # noqa: E402
from tether.decoding.fast_decoder import FastDecoder  # noqa: E402
from tether.families.text.batch import to_train_batch, token_logprobs  # noqa: E402
from tether.modeling import copy_weights, load_causal_lm  # noqa: E402
from tether.runtime.run import train  # noqa: E402
from tether.train.learner import TorchLearner  # noqa: E402
from tether.train.precision import Precision  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
BF16_TOLERANCE = 2.5e-2
"""Of the change an update makes to the sampled sequences' log-probs (module docstring)."""


@pytest.fixture(scope="module")
def batches(tiny_model_dir):
    """Three real rollout batches (4 prompts × 4 samples) of the float32 engine."""
    return [sampled_batch(tiny_model_dir, seed=seed)[0] for seed in range(3)]


@pytest.fixture(scope="module")
def effect(tiny_model_dir, batches):
    """weights → how they change every sampled sequence's log-probability (a float32 forward),
    against the model's own weights."""
    model, tok = load_causal_lm(tiny_model_dir)
    tbs = [to_train_batch(b.payload, tok.pad_token_id) for b in batches]
    start = {n: p.detach().clone() for n, p in model.named_parameters()}

    def logp(weights) -> torch.Tensor:
        copy_weights(model, weights)
        with torch.no_grad():
            return torch.cat([(token_logprobs(model, tb, 1.0)[0] * tb.mask).sum(1) for tb in tbs])

    before = logp(start)
    return lambda weights: logp(weights) - before


def differ(effect, weights, reference) -> float:
    """How far ``weights``' update is from ``reference``'s, relative to ``reference``'s."""
    a, b = effect(weights), effect(reference)
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def learners(tiny_model_dir, batches):
    """dtype → (learner, its weights after the three batches, its results)."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        learner = TorchLearner(tiny_model_dir, config(f"train.dtype={dtype}", lr=1e-3))
        out[dtype] = (learner, *trained(learner, batches))
    return out


def test_a_bfloat16_learner_keeps_float32_weights_gradients_and_optimizer_state(learners):
    learner = learners["bfloat16"][0]
    assert learner.precision.mixed and learner.committed == 3
    assert {p.dtype for p in learner.model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in learner.params} == {torch.float32}
    state = [t for s in learner.optimizer.state.values() for t in s.values() if t.is_floating_point()]
    assert state and {t.dtype for t in state if t.dim()} == {torch.float32}


def test_its_update_is_close_to_the_float32_learners_but_not_equal(learners, effect):
    gap = differ(effect, learners["bfloat16"][1], learners["float32"][1])
    print(f"\nbfloat16 vs float32 learner: {gap:.2%} of the update's effect")
    assert 1e-4 < gap < BF16_TOLERANCE


def test_the_mismatch_it_adds_is_reported_as_numeric(learners):
    """The first batch is trained at the version it was sampled with: every token's π_old/μ is
    numerics alone, ~1e-7 in float32, bfloat16's rounding here."""
    f32, bf16 = (learners[d][2][0].metrics for d in ("float32", "bfloat16"))
    assert f32["mismatch/numeric_token_frac"] == bf16["mismatch/numeric_token_frac"] == 1.0
    assert f32["mismatch/numeric_logprob_abs_diff_mean"] < 1e-5
    assert bf16["mismatch/numeric_logprob_abs_diff_mean"] > 30 * f32["mismatch/numeric_logprob_abs_diff_mean"]
    assert bf16["mismatch/numeric_logprob_abs_diff_max"] > 1e-4


def test_the_corrections_act_on_that_mismatch(tiny_model_dir, batches):
    """A token mask of ρ = π_old/μ in [0.9995, 1.0005]: no float32 token is outside it, some
    bfloat16 ones are."""
    masked = {}
    for dtype in ("float32", "bfloat16"):
        cfg = config(f"train.dtype={dtype}", "correction.mask=token", "correction.mask_low=0.9995",
                     "correction.mask_high=1.0005", lr=1e-3)
        masked[dtype] = TorchLearner(tiny_model_dir, cfg).train(batches[0], train_version=0).metrics[
            "ratio/masked_frac"]
    assert masked["float32"] == 0.0 < masked["bfloat16"]


def test_two_bfloat16_ranks_make_the_one_process_bfloat16_update(tiny_model_dir, batches, effect):
    cfg = config("train.dtype=bfloat16", lr=1e-3, world_size=2)
    (solo, solo_results), (ranked, results) = solo_and_ranks(tiny_model_dir, config("train.dtype=bfloat16",
                                                                                     lr=1e-3), cfg, batches)
    assert {w.dtype for w in ranked.values()} == {torch.float32}  # the shards stay float32
    gap = differ(effect, ranked, solo)
    print(f"\ntwo bfloat16 ranks vs one process: {gap:.2%} of the update's effect")
    assert gap < BF16_TOLERANCE
    for a, b in zip(solo_results, results, strict=True):
        assert b.committed_updates == a.committed_updates == 1
        for key in ("train/grad_norm", "train/entropy"):  # the loss itself is ~0 here: rounding alone
            assert b.metrics[key] == pytest.approx(a.metrics[key], rel=BF16_TOLERANCE), key


def test_a_bfloat16_learner_resumes_from_its_checkpoint_exactly(tiny_model_dir, batches, tmp_path):
    settings = config("train.dtype=bfloat16", lr=1e-3, warmup_steps=3)
    a = TorchLearner(tiny_model_dir, settings)
    a.train(batches[0], train_version=0)
    a.save(tmp_path / "ckpt")
    a.train(batches[1], train_version=1)
    b = TorchLearner(tiny_model_dir, settings)
    b.load(tmp_path / "ckpt")
    b.train(batches[1], train_version=1)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_the_built_in_engine_samples_in_bfloat16_on_the_python_path(tiny_model_dir):
    """``rollout.dtype=bfloat16``: bfloat16 weights (tied ones still tied), float32 rotary
    frequencies, the Python path (the native decoder says why not), and log-probs a bfloat16
    teacher-forced forward gives to bfloat16 rounding."""
    cfg = load_config(None, ["rollout.dtype=bfloat16"])
    model, tok = load_causal_lm(tiny_model_dir)
    engine = registry.engines.get("torch").build(cfg, str(tiny_model_dir), tok, [tok.eos_token_id],
                                                 device=torch.device("cpu"), threads=1, seed=0)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert engine.model.model.rotary_emb.inv_freq.dtype == torch.float32
    if model.config.tie_word_embeddings:
        assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    from tether.vocabulary import SamplingParams

    prompt = tok("12+34=", add_special_tokens=False).input_ids
    [group] = engine.generate([prompt], samples_per_prompt=2, params=SamplingParams(max_new_tokens=8), seed=0)
    assert engine.decoder_path == "python" and engine.stepper.native_reason == "the model is not float32"
    for c in group:
        with torch.no_grad():
            logits = engine.model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(c.logprobs), expected, atol=0.05)  # bfloat16's rounding


def test_held_out_evaluation_under_autocast_runs_the_python_path_in_bfloat16(tiny_model_dir):
    """A bfloat16 learner's evaluator runs under its autocast: the lean decoder then takes its
    Python path (torch ops follow autocast, the native library would not), even when
    ``rollout.decoder=native`` asks the engine for the native one."""
    model, tok = load_causal_lm(tiny_model_dir)
    ids = torch.tensor([tok("12+34=", add_special_tokens=False).input_ids])
    plain = FastDecoder(model, decoder="python").prefill(ids, torch.ones_like(ids), 4)
    decoder = FastDecoder(model, decoder="native")
    evaluate = Precision("bfloat16", torch.device("cpu")).evaluating(
        lambda step: decoder.prefill(ids, torch.ones_like(ids), 4))
    logits = evaluate(0)
    assert decoder.native_reason == "autocast (train.dtype=bfloat16)" and decoder.path == "python"
    assert 0 < float((logits - plain).abs().max()) < 0.1


def _run(model_dir, *extra):
    return [f"model.path={model_dir}", f"reward.function={Path(__file__).parent / 'varied_reward.py'}:reward",
            "data.task=reverse", "data.difficulty=3", "data.num_train=300", "data.num_eval=20",
            "rollout.batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=4", "train.lr=1e-3",
            "train.num_batches=4", "eval.interval=2", "checkpoint.interval=2", "train.dtype=bfloat16",
            "rollout.dtype=bfloat16", "async.max_staleness=0", "async.max_inflight=1", *extra]


def test_tether_train_runs_a_bfloat16_learner_and_engine_and_resumes_exactly(tiny_model_dir, tmp_path):
    whole = tmp_path / "whole"
    train(load_config(None, _run(tiny_model_dir)), whole, progress_plain=True)
    metrics = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 4 and all(m["rollout/native_decoder"] == 0.0 for m in metrics)
    assert all(m["mismatch/numeric_token_frac"] == 1.0 for m in metrics)  # max_staleness=0: same weights
    assert min(m["mismatch/numeric_logprob_abs_diff_max"] for m in metrics) > 1e-4  # bfloat16, not 1e-6
    assert len((whole / "eval.jsonl").read_text().splitlines()) == 3  # steps 0, 2 and 4
    from safetensors.torch import load_file

    saved = load_file(whole / "checkpoints" / "step-000004" / "learner" / "model" / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.float32}  # the master weights
    parts = tmp_path / "parts"
    train(load_config(None, _run(tiny_model_dir, "train.num_batches=2")), parts, progress_plain=True)
    resumed = load_config(parts / "config.yaml", ["train.num_batches=4"])
    train(resumed, parts, resume=True, progress_plain=True)
    keys = ("step", "reward/mean", "loss/policy", "mismatch/numeric_logprob_abs_diff_mean")
    again = [json.loads(line) for line in (parts / "metrics.jsonl").read_text().splitlines()]
    assert [{k: m[k] for k in keys} for m in again] == [{k: m[k] for k in keys} for m in metrics]


def test_a_bfloat16_lora_learner_keeps_its_frozen_base_in_bfloat16(tiny_model_dir, batches, effect):
    """With adapters (train.lora_rank) the base is frozen: a bfloat16 learner stores it in bfloat16
    (half its bytes), the adapters and their AdamW state stay float32, and its update is the
    float32 LoRA learner's to bfloat16's rounding."""
    runs = {}
    for dtype in ("float32", "bfloat16"):
        learner = TorchLearner(tiny_model_dir, config(f"train.dtype={dtype}", lr=1e-2, lora_rank=4,
                                                      lora_targets=["q_proj", "v_proj", "up_proj"]))
        results = [learner.train(b, train_version=2 * i) for i, b in enumerate(batches)]
        assert sum(r.committed_updates for r in results) == len(batches)
        runs[dtype] = learner
    learner = runs["bfloat16"]
    frozen = [p for p in learner.model.parameters() if not p.requires_grad]
    adapters = [p for p in learner.model.parameters() if p.requires_grad]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
    assert adapters and all(p.dtype == torch.float32 for p in adapters)
    assert all(s["exp_avg"].dtype == torch.float32 for s in learner.optimizer.state.values())
    assert all(p.dtype == torch.float32 for p in runs["float32"].model.parameters())

    def merged(learner) -> dict:
        """The policy's float32 weights with the published adapters merged in (an engine's)."""
        from tether.adapters import MergedAdapter

        model, _ = load_causal_lm(tiny_model_dir)
        MergedAdapter(model, learner.s.lora_alpha / learner.s.lora_rank).apply(learner.export_weights())
        return {n: p.detach() for n, p in model.named_parameters()}

    # measured 2.9%: a bfloat16 base makes the residual stream bfloat16 too (the embedding's output),
    # one more rounding per layer than the autocast learner's 0.44%; a few bfloat16 roundings still
    assert differ(effect, merged(learner), merged(runs["float32"])) < 2 * BF16_TOLERANCE
