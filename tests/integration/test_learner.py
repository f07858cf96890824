"""The torch learner on a real tiny model and real engine samples."""

import copy
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from configs import config  # noqa: E402
from tether.control import AsyncControl, BudgetSettings  # noqa: E402
from tether.errors import ConfigError  # noqa: E402
from tether.families.text.batch import to_train_batch, token_logprobs  # noqa: E402
from tether.families.text.payload import ScoredBatch  # noqa: E402
from tether.families.text.policy import TextPolicy  # noqa: E402
from tether.modeling import load_causal_lm  # noqa: E402
from tether.rollout.engines.torch.engine import TorchEngine  # noqa: E402
from tether.train.learner import TorchLearner  # noqa: E402
from tether.vocabulary import RolloutBatch, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
PROMPTS = ["1+1=", "22+3=", "rev abc=", "sort cab="]


def sampled_batch(model_dir, *, group_size=4, temperature=1.0, seed=0):
    """A real rollout batch: samples and log-probs from the engine; reward 1 for the first half
    of each group, 0 for the rest (so advantages are ±1 within every group)."""
    model, tok = load_causal_lm(model_dir)
    engine = TorchEngine(model, pad_id=tok.pad_token_id, stop_ids=[tok.eos_token_id])
    prompt_ids = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    groups = engine.generate(prompt_ids, samples_per_prompt=group_size,
                             params=SamplingParams(max_new_tokens=6, temperature=temperature), seed=seed)
    flat = [c for g in groups for c in g]
    rewards = [1.0 if i % group_size < group_size // 2 else 0.0 for i in range(len(flat))]
    scored = ScoredBatch(positions=list(range(len(PROMPTS))), prompt_ids=prompt_ids,
                         completion_ids=[c.token_ids for c in flat], logprobs=[c.logprobs for c in flat],
                         versions=[c.versions for c in flat], rewards=rewards,
                         finish_reasons=[c.finish_reason for c in flat], completions=[""] * len(flat),
                         group_size=group_size)
    return RolloutBatch(index=0, behavior_version=0, num_groups=len(PROMPTS), group_size=group_size,
                        payload=scored), tok


def sequence_logprobs(learner, batch, tok):
    tb = to_train_batch(batch.payload, tok.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(learner.model, tb, 1.0)
    return (logp * tb.mask).sum(dim=1)  # (N,)


@pytest.mark.parametrize("algorithm", [
    {"loss": "ppo_clip", "aggregation": "token_mean", "clip_high": 0.28},
    {"loss": "gspo", "aggregation": "seq_mean_token_mean", "clip_low": 3e-4, "clip_high": 4e-4},
    {"loss": "cispo", "aggregation": "token_mean", "clip_low": 1.0, "clip_high": 0.28},
    {"loss": "ppo_clip", "aggregation": "seq_mean_token_sum_norm", "adv_std_norm": False, "kl_coef": 0.04},
    {"loss": "ppo_clip", "aggregation": "token_mean", "advantage": "rloo"},
    {"loss": "ppo_clip", "aggregation": "token_mean", "advantage": "reinforce_pp"},
])
def test_updates_raise_positive_and_lower_negative_completions(tiny_model_dir, algorithm):
    batch, tok = sampled_batch(tiny_model_dir)
    learner = TorchLearner(tiny_model_dir, config(lr=3e-3, updates_per_batch=2, **algorithm))
    before = sequence_logprobs(learner, batch, tok)
    params_before = [p.detach().clone() for p in learner.model.parameters()]
    for _ in range(3):
        result = learner.train(batch, train_version=0)
        assert result.committed_updates == 2
    after = sequence_logprobs(learner, batch, tok)
    positive = torch.tensor(batch.payload.rewards) > 0.5
    delta = after - before
    assert delta[positive].mean() > 0 > delta[~positive].mean()
    assert any(not torch.equal(a, b) for a, b in zip(params_before, learner.model.parameters(), strict=True))
    for key in ("loss/policy", "loss/total", "train/grad_norm", "train/lr", "train/entropy", "ratio/mean",
                "ratio/std", "ratio/min", "ratio/max", "ratio/clip_frac_low", "ratio/clip_frac_high",
                "ratio/is_weight_mean", "ratio/is_weight_max", "ratio/masked_frac", "ratio/ess",
                "mismatch/logprob_abs_diff_mean", "mismatch/logprob_abs_diff_max", "mismatch/k3",
                "mismatch/numeric_token_frac", "mismatch/numeric_logprob_abs_diff_max",
                "train/skipped_updates", "reward/frac_zero_std", "loss/kl"):
        assert key in result.metrics, key


def test_trainer_logprobs_match_the_engine_at_the_sampling_temperature(tiny_model_dir):
    batch, _tok = sampled_batch(tiny_model_dir, temperature=0.7)
    learner = TorchLearner(tiny_model_dir, config("rollout.temperature=0.7"))
    metrics = learner.train(batch, train_version=0).metrics
    assert metrics["mismatch/logprob_abs_diff_max"] < 1e-5
    # every token was sampled with the weights being trained: the whole difference is numerics
    assert metrics["mismatch/numeric_token_frac"] == 1.0
    assert metrics["mismatch/numeric_logprob_abs_diff_max"] < 1e-5
    # the same tokens counted as sampled by an older policy: nothing to measure numerics on
    stale = TorchLearner(tiny_model_dir, config("rollout.temperature=0.7")).train(batch, train_version=1)
    assert stale.metrics["mismatch/numeric_token_frac"] == 0.0
    assert math.isnan(stale.metrics["mismatch/numeric_logprob_abs_diff_max"])
    wrong_t = TorchLearner(tiny_model_dir, config("rollout.temperature=1.0")).train(batch, train_version=0)
    assert wrong_t.metrics["mismatch/logprob_abs_diff_max"] > 1e-2  # the ratio would measure T


def test_a_non_finite_gradient_skips_the_update_and_keeps_the_clock_honest(tiny_model_dir):
    batch, _tok = sampled_batch(tiny_model_dir)
    learner = TorchLearner(tiny_model_dir, config(lr=1e-3, updates_per_batch=2))
    calls = {"n": 0}

    def poison(grad):  # the embedding's gradient on the second backward becomes NaN
        calls["n"] += 1
        return grad * float("nan") if calls["n"] == 2 else grad

    learner.model.get_input_embeddings().weight.register_hook(poison)
    control = AsyncControl(BudgetSettings(max_staleness=1, updates_per_batch=2, total_batches=4))
    before = [p.detach().clone() for p in learner.model.parameters()]
    result = learner.train(batch, train_version=0)
    control.commit(result.committed_updates)
    assert (result.committed_updates, result.attempted_updates) == (1, 2)
    assert result.metrics["train/skipped_updates"] == 1.0
    assert result.metrics["train/skipped_nonfinite_grad"] == 1.0
    assert control.train_version == 1
    assert (learner.committed, learner.skipped) == (1, 1)
    assert all(torch.isfinite(p).all() for p in learner.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.model.parameters(), strict=True))


@pytest.mark.parametrize("case", ["zero_variance_dropped", "zero_advantage", "all_truncated_masked"])
def test_a_batch_with_nothing_to_learn_from_makes_no_step_and_commits_nothing(tiny_model_dir, case):
    """No token in the loss (or none with a non-zero advantage, and no KL): no backward, no
    optimizer step — AdamW would still move the weights by its momentum — and not committed.
    The learner first trains one real batch, so the optimizer has momentum to move them with."""
    batch, _tok = sampled_batch(tiny_model_dir)
    settings = {"zero_variance_dropped": {"drop_zero_std": True}, "zero_advantage": {"drop_zero_std": False},
                "all_truncated_masked": {"mask_truncated": True}}[case]
    learner = TorchLearner(tiny_model_dir, config(lr=1e-3, updates_per_batch=2, **settings))
    batch.payload.finish_reasons = ["stop"] * len(batch.payload.finish_reasons)  # a batch with signal
    assert learner.train(batch, train_version=0).committed_updates == 2
    scored = copy.deepcopy(batch.payload)
    if case == "all_truncated_masked":
        scored.finish_reasons = ["length"] * len(scored.finish_reasons)
    else:
        scored.rewards = [0.5] * len(scored.rewards)  # every group's rewards equal
    flat = copy.deepcopy(batch)
    object.__setattr__(flat, "payload", scored)
    before = [p.detach().clone() for p in learner.model.parameters()]
    result = learner.train(flat, train_version=2)
    assert (result.committed_updates, result.attempted_updates) == (0, 2)
    assert result.metrics["train/skipped_no_signal"] == 2.0 and result.metrics["train/skipped_updates"] == 2.0
    assert all(torch.equal(a, b) for a, b in zip(before, learner.model.parameters(), strict=True))
    assert learner.committed == 2 and learner.scheduler.last_epoch == 2  # the schedule did not move


def test_micro_batches_accumulate_to_the_same_update(tiny_model_dir):
    batch, _tok = sampled_batch(tiny_model_dir)
    # Compare the accumulated gradients (lr 0 leaves them in .grad): Adam's first step is about
    # ±lr·sign(g), which would turn round-off in a near-zero gradient into a visible difference.
    grads = []
    for micro in (0, 3):
        learner = TorchLearner(tiny_model_dir, config(lr=0.0, micro_batch_size=micro, grad_clip=0.0))
        learner.train(batch, train_version=0)
        grads.append([p.grad.detach().clone() for p in learner.model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-4)
    assert any(float(g.abs().max()) > 1e-4 for g in grads[0])


def test_save_and_load_resume_exactly(tiny_model_dir, tmp_path):
    batch, _tok = sampled_batch(tiny_model_dir)
    settings = config(lr=1e-3, warmup_steps=3)
    a = TorchLearner(tiny_model_dir, settings)
    a.train(batch, train_version=0)
    a.save(tmp_path / "ckpt")
    a.train(batch, train_version=1)
    b = TorchLearner(tiny_model_dir, settings)
    b.load(tmp_path / "ckpt")
    assert b.committed == 1 and b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"] * 2 / 3
    b.train(batch, train_version=1)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_cosine_schedule_follows_the_update_count_across_a_resume(tiny_model_dir, tmp_path):
    batch, _tok = sampled_batch(tiny_model_dir)
    settings = config(lr=1e-3, updates_per_batch=2, lr_schedule="cosine", min_lr_ratio=0.2, num_batches=2)
    a = TorchLearner(tiny_model_dir, settings)
    rates = []
    for version in range(2):
        metrics = a.train(batch, train_version=version).metrics
        rates.append(metrics["train/lr"])
        if version == 0:
            a.save(tmp_path / "ckpt")
    # the rate reported after a batch is the next update's: k = 2 → p = ½ → 0.6; k = 4 → the floor
    assert rates == pytest.approx([1e-3 * 0.6, 1e-3 * 0.2])
    b = TorchLearner(tiny_model_dir, settings)
    b.load(tmp_path / "ckpt")
    assert b.train(batch, train_version=1).metrics["train/lr"] == pytest.approx(rates[1])
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)


def with_lengths(batch, lengths, max_new_tokens=6):
    """``batch`` with sample i cut to its first ``lengths[i]`` tokens (a prefix of a sample is a
    sample, with the same log-probs); those at ``max_new_tokens`` finish by 'length'."""
    s = batch.payload
    assert all(len(c) >= n for c, n in zip(s.completion_ids, lengths, strict=True))
    s.completion_ids = [c[:n] for c, n in zip(s.completion_ids, lengths, strict=True)]
    s.logprobs = [lp[:n] for lp, n in zip(s.logprobs, lengths, strict=True)]
    s.versions = [v[:n] for v, n in zip(s.versions, lengths, strict=True)]
    s.finish_reasons = ["length" if n == max_new_tokens else "stop" for n in lengths]
    return batch


def grads_after_one_batch(model_dir, batch, *overrides, **settings):
    learner = TorchLearner(model_dir, config(*overrides, lr=0.0, grad_clip=0.0, **settings))
    result = learner.train(batch, train_version=0)
    return [None if p.grad is None else p.grad.detach().clone() for p in learner.model.parameters()], \
        result.metrics


def test_truncated_completions_are_left_out_of_the_loss(tiny_model_dir):
    batch, _tok = sampled_batch(tiny_model_dir, seed=3)
    # group 0 stops early; groups 1–3 are all cut off at max_new_tokens
    batch = with_lengths(batch, [2, 3, 4, 5] + [6] * 12)
    masked, _ = grads_after_one_batch(tiny_model_dir, batch, mask_truncated=True)
    # the same update as training on group 0 alone (token_mean: the same tokens in the denominator)
    alone = copy.deepcopy(batch)
    s = alone.payload
    s.prompt_ids, s.positions = s.prompt_ids[:1], s.positions[:1]
    for name in ("completion_ids", "logprobs", "versions", "rewards", "finish_reasons", "completions"):
        setattr(s, name, getattr(s, name)[:4])
    group0, _ = grads_after_one_batch(tiny_model_dir, alone)
    full, _ = grads_after_one_batch(tiny_model_dir, batch)
    for a, b in zip(masked, group0, strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-4)
    assert any(not torch.allclose(a, b, atol=1e-6) for a, b in zip(masked, full, strict=True))


def test_overlong_penalty_shapes_rewards_before_advantages(tiny_model_dir):
    batch, _tok = sampled_batch(tiny_model_dir, seed=3)
    lengths = [1, 2, 3, 4, 5, 6, 6, 6, 3, 4, 5, 6, 1, 1, 2, 2]
    batch = with_lengths(batch, lengths)
    batch.payload.rewards = [1.0] * len(lengths)  # equal rewards: no signal without the penalty
    plain, metrics = grads_after_one_batch(tiny_model_dir, batch)
    assert all(g is None for g in plain) and metrics["train/skipped_no_signal"] == 1.0  # not even a backward
    shaped, metrics = grads_after_one_batch(tiny_model_dir, batch, "reward.overlong_buffer=3",
                                            "reward.overlong_penalty=0.5", "rollout.max_new_tokens=6")
    # L_max = 6, L_c = 3: lengths 4, 5, 6 lose 0.5·⅓, 0.5·⅔, 0.5; 8 of the 16 samples are past 3 tokens
    expected = sum({4: 1 / 6, 5: 1 / 3, 6: 0.5}.get(n, 0.0) for n in lengths) / len(lengths)
    assert metrics["reward/overlong_penalty_mean"] == pytest.approx(-expected)
    assert metrics["reward/overlong_frac"] == pytest.approx(8 / 16)
    assert any(float(g.abs().max()) > 0.0 for g in shaped)


def test_bad_batches_are_refused(tiny_model_dir):
    batch, _tok = sampled_batch(tiny_model_dir)
    with pytest.raises(ConfigError, match="exceeds the 16 sequences"):
        TorchLearner(tiny_model_dir, config(updates_per_batch=17)).train(batch, train_version=0)
    scored = batch.payload
    scored.logprobs = [None] * len(scored.logprobs)
    with pytest.raises(ConfigError, match="carries no engine log-probs"):
        TorchLearner(tiny_model_dir, config()).train(batch, train_version=0)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_shared_prompt_forward_gives_the_model_forwards_logprobs_and_gradients(tmp_path, arch):
    from tether.data.tiny_model import init_model

    init_model(tmp_path / arch, arch=arch, size="tiny", seed=2)
    model, tok = load_causal_lm(tmp_path / arch)
    check_shared_prompt_forward(model.train(), tok)


def test_shared_prompt_forward_on_a_model_whose_head_is_not_its_embedding(tmp_path):
    """A tied head takes the lookup's gradient sparse, added into its own; an untied embedding's
    gradient stays dense (the optimizers take no sparse gradient)."""
    from tether.data.tiny_model import init_model

    init_model(tmp_path / "m", arch="qwen3", size="tiny", seed=2)
    model, tok = load_causal_lm(tmp_path / "m")
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    assert model.lm_head.weight is not model.get_input_embeddings().weight
    check_shared_prompt_forward(model.train(), tok)


def test_shared_prompt_forward_on_a_model_fsdp2_shards(tmp_path):
    """Learner ranks shard the model with FSDP2, whose weights outside a module's forward are
    shards: the shared-prompt forward then runs as FSDP forward methods, and gives the model's
    own (sharded) forward's log-probs and gradients. One gloo rank, in this process."""
    import torch.distributed as dist

    from tether.data.tiny_model import init_model
    from tether.decoding.prefix_forward import SharedPrefixForward
    from tether.train import fsdp

    init_model(tmp_path / "m", arch="qwen3", size="tiny", seed=2)
    model, tok = load_causal_lm(tmp_path / "m")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        fsdp.shard(model, TextPolicy(1.0).layers(model))
        assert SharedPrefixForward(model).sharded
        check_shared_prompt_forward(model.train(), tok)
    finally:
        dist.destroy_process_group()


def check_shared_prompt_forward(model, tok):
    from tether.decoding.prefix_forward import SharedPrefixForward

    g = torch.Generator().manual_seed(0)
    prompts = [tok(p, add_special_tokens=False).input_ids for p in ["1+1=", "123+45=", "rev abcdef="]]
    lengths = torch.randint(0, 8, (12,), generator=g).tolist()  # 3 groups of 4, 0 to 7 tokens each
    completions = [torch.randint(3, len(tok), (n,), generator=g).tolist() for n in lengths]
    completions[5] = []  # an empty completion (nothing to predict)
    scored = ScoredBatch(positions=[0, 1, 2], prompt_ids=prompts, completion_ids=completions,
                         logprobs=[[-1.0] * len(c) for c in completions],
                         versions=[[0] * len(c) for c in completions], rewards=[0.0] * 12,
                         finish_reasons=["length"] * 12, completions=[""] * 12, group_size=4)
    tb = to_train_batch(scored, tok.pad_token_id)
    shared = SharedPrefixForward(model)

    def whole(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t  # a DTensor's gradient under FSDP2

    for rows in (slice(None), slice(2, 9)):  # the whole batch, and a slice that splits two groups
        part = tb.rows(rows)
        weights = torch.randn(part.mask.shape, generator=g) * part.mask

        def run(fn, part=part, weights=weights):
            model.zero_grad()
            logp, entropy = fn(part)
            (logp * weights).sum().backward()
            return logp.detach(), entropy, {n: whole(p.grad).clone() for n, p in model.named_parameters()}

        a_lp, a_ent, a_grad = run(lambda b: token_logprobs(model, b, 0.8, with_entropy=True))
        b_lp, b_ent, b_grad = run(lambda b: token_logprobs(model, b, 0.8, with_entropy=True, forward=shared))
        on = part.mask.bool()
        assert torch.allclose(a_lp[on], b_lp[on], atol=1e-5)
        assert torch.allclose(a_ent[on], b_ent[on], atol=1e-5)
        assert (b_lp[~on] == 0).all()
        for name, grad in a_grad.items():
            assert not b_grad[name].is_sparse, name  # what AdamW and clipping take
            assert grad.abs().sum() > 0, name  # every weight's gradient reached it
            assert torch.allclose(grad, b_grad[name], atol=1e-5, rtol=1e-4), name
    with torch.no_grad():  # as the learner computes π_old and the reference's log-probs
        assert torch.allclose(token_logprobs(model, tb, 0.8)[0][tb.mask.bool()],
                              token_logprobs(model, tb, 0.8, forward=shared)[0][tb.mask.bool()], atol=1e-5)


def test_the_learner_reads_its_keys_from_the_recipe(tiny_model_dir):
    learner = TorchLearner(tiny_model_dir, config(
        "reward.overlong_buffer=3", "reward.overlong_penalty=0.5", "rollout.max_new_tokens=9",
        "rollout.temperature=0.7", mask_truncated=True, lr_schedule="linear", min_lr_ratio=0.2,
        warmup_steps=2,
        num_batches=7, updates_per_batch=3, advantage="rloo"))
    schedule = learner.scheduler.lr_lambdas[0].keywords
    assert (schedule["kind"], schedule["min_ratio"], schedule["warmup_steps"], schedule["total_steps"]) == (
        "linear", 0.2, 2, 21)
    assert learner.norm_constant == 9 and learner.policy.temperature == 0.7
    assert (learner.s.mask_truncated, learner.s.advantage, learner.s.adv_std_norm) == (True, "rloo", False)
    assert (learner.cfg.reward.overlong_buffer, learner.cfg.reward.overlong_penalty) == (3, 0.5)


def test_evaluation_sees_the_ema_and_a_checkpoint_resumes_it_exactly(tiny_model_dir, tmp_path):
    """train.ema_decay: the average moves with the updates (every 2nd, the reference's warm-up),
    evaluation runs on it and the training weights come back after; a checkpoint holds it as a
    model folder, a resume continues it bit for bit, and one without it is refused."""
    from tether.train.learner_state import model_folder

    batch, _tok = sampled_batch(tiny_model_dir)
    settings = config(lr=1e-3, ema_decay=0.9, ema_every=2)
    a = TorchLearner(tiny_model_dir, settings)
    start = {n: p.detach().clone() for n, p in a.model.named_parameters()}
    seen = []
    evaluate = a.evaluating(lambda step: seen.append(
        {n: p.detach().clone() for n, p in a.model.named_parameters()}) or {"eval/x": 1.0})
    a.train(batch, train_version=0)
    assert all(torch.equal(v, start[n]) for n, v in a.ema.values.items())  # n = 0: not folded
    a.train(batch, train_version=1)  # n = 1: ema = d·start + (1 − d)·θ, d = min(2/11, 0.9)
    trained = {n: p.detach().clone() for n, p in a.model.named_parameters()}
    evaluate(2)
    for name, value in seen[0].items():
        torch.testing.assert_close(value, 2 / 11 * start[name] + 9 / 11 * trained[name], rtol=1e-5, atol=1e-7)
    assert any(not torch.equal(seen[0][n], trained[n]) for n in trained)
    assert all(torch.equal(p, trained[n]) for n, p in a.model.named_parameters())  # back after
    a.save(tmp_path / "ckpt")
    assert model_folder(tmp_path / "ckpt") == tmp_path / "ckpt" / "ema"
    assert model_folder(tmp_path / "ckpt", trained=True) == tmp_path / "ckpt" / "model"
    for _ in range(2):
        a.train(batch, train_version=2)
    b = TorchLearner(tiny_model_dir, settings)
    b.load(tmp_path / "ckpt")
    for _ in range(2):
        b.train(batch, train_version=2)
    for name, value in a.ema.values.items():
        assert torch.equal(b.ema.values[name], value), name
    with pytest.raises(ConfigError, match=r"holds an EMA of the weights and train\.ema_decay=0\.0"):
        TorchLearner(tiny_model_dir, config(lr=1e-3)).load(tmp_path / "ckpt")
