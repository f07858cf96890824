"""The engine and the learner on a CUDA device: what a Ray rollout actor with
``ray.gpus_per_worker > 0`` runs, and what ``train.device=cuda`` trains and evaluates with.

Each test runs on ``cpu`` and on ``cuda``; the CUDA cases (marked ``gpu``) skip on the development
and CI machines, which have no GPU, and ``scripts/device_check.sh`` runs them on a GPU machine
(``pytest -m gpu``). The CPU cases check the tests themselves wherever they run. What a machine
without CUDA can check — the clear error when a GPU is asked for and none is there — is tested
at the end.
"""


import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from configs import config, pool_settings  # noqa: E402
from tether.data.tasks import get_task  # noqa: E402
from tether.decoding.sampling import SamplingParams, sample  # noqa: E402
from tether.errors import ConfigError  # noqa: E402
from tether.modeling import load_causal_lm  # noqa: E402
from tether.rollout.engines.torch.engine import TorchEngine  # noqa: E402
from tether.rollout.settings import WorkerSpec  # noqa: E402
from tether.rollout.worker import Rollout  # noqa: E402
from tether.train.learner import TorchLearner  # noqa: E402
from tether.vocabulary import WorkItem  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                    reason="needs a CUDA device")]),
]


def on(device, model_dir):
    model, tok = load_causal_lm(model_dir)
    return model.to(device).eval(), tok


def prompt_ids(tok, texts):
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


@pytest.fixture(autouse=True)
def exact_fp32():
    """TF32 would change fp32 matmuls on Ampere and later; the engine's promise is about fp32."""
    if torch.cuda.is_available():
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        yield
        torch.backends.cuda.matmul.allow_tf32 = before
    else:
        yield


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_on_the_device_match_a_teacher_forced_forward(tiny_model_dir, device, temperature):
    model, tok = on(device, tiny_model_dir)
    ps = prompt_ids(tok, ["1+1=", "12+345=", "rev abcdef="])  # different lengths → left padding
    engine = TorchEngine(model, pad_id=tok.pad_token_id, stop_ids=[tok.eos_token_id])
    groups = engine.generate(ps, samples_per_prompt=2, params=SamplingParams(max_new_tokens=12,
                             temperature=temperature), seed=0)
    for p, group in zip(ps, groups, strict=True):
        for c in group:
            ids = torch.tensor([p + c.token_ids], device=device)
            with torch.no_grad():
                logits = model(ids).logits[0, len(p) - 1: -1].float() / temperature
            expected = torch.log_softmax(logits, -1).gather(
                -1, torch.tensor(c.token_ids, device=device)[:, None]).squeeze(-1)
            assert torch.allclose(torch.tensor(c.logprobs), expected.cpu(), atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_engine_on_the_device_is_seeded_and_a_weight_load_changes_samples_and_versions(tiny_model_dir,
                                                                                      device):
    model, tok = on(device, tiny_model_dir)
    engine = TorchEngine(model, pad_id=tok.pad_token_id, stop_ids=[tok.eos_token_id])
    ps = prompt_ids(tok, ["12+34="] * 4)
    params = SamplingParams(max_new_tokens=8)

    def tokens(seed):
        return [c.token_ids for g in engine.generate(ps, samples_per_prompt=2, params=params, seed=seed)
                for c in g]

    assert tokens(1) == tokens(1)
    assert tokens(1) != tokens(2)
    before = tokens(1)
    # the weights a publication brings arrive as host tensors; a GPU engine copies them in
    new = {n: (p.detach().cpu() + 0.05 * torch.randn_like(p.cpu())) for n, p in model.named_parameters()}
    engine.bind(new, version=3)
    assert next(model.parameters()).device.type == device
    after = engine.generate(ps, samples_per_prompt=2, params=params, seed=1)
    assert [c.token_ids for g in after for c in g] != before
    assert all(v == 3 for g in after for c in g for v in c.versions)


@pytest.mark.parametrize("device", DEVICES)
def test_lean_decoder_on_the_device_agrees_with_the_transformers_forward(tiny_model_dir, device):
    from tether.decoding.fast_decoder import FastDecoder
    from tether.decoding.sampling import _TransformersStepper

    model, tok = on(device, tiny_model_dir)
    ps = prompt_ids(tok, ["7+8=", "rev abcdefgh=", "100+1="])
    outs = [sample(model, ps, SamplingParams(max_new_tokens=10), stop_ids=[tok.eos_token_id],
                   pad_id=tok.pad_token_id, generator=torch.Generator(device=device).manual_seed(0),
                   stepper=stepper, samples_per_prompt=3)
            for stepper in (FastDecoder(model), _TransformersStepper(model))]
    assert outs[0].tokens == outs[1].tokens
    for a, b in zip(outs[0].logprobs, outs[1].logprobs, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_a_rollout_worker_on_the_device_returns_a_whole_scored_batch(tiny_model_dir, device):
    rollout = Rollout(WorkerSpec(0, pool_settings(tiny_model_dir), device=device))
    assert next(rollout.engine.model.parameters()).device.type == device
    examples = list(enumerate(get_task("arithmetic").examples("train", 3, seed=0)))
    batch = rollout.generate(WorkItem(batch_index=0, examples=examples, group_size=4,
                                      params=SamplingParams(max_new_tokens=6), version=0, seed=0))
    assert len(batch.rewards) == 12 and batch.group_size == 4
    assert all(len(lp) == len(t) for lp, t in zip(batch.logprobs, batch.completion_ids, strict=True))


def rollout_batch(model_dir, group_size=4):
    """A real rollout batch sampled on the CPU engine; rewards vary within every group."""
    from tether.families.text.payload import ScoredBatch
    from tether.vocabulary import RolloutBatch

    model, tok = on("cpu", model_dir)
    ps = prompt_ids(tok, ["1+1=", "22+3=", "rev abc=", "sort cab="])
    groups = TorchEngine(model, pad_id=tok.pad_token_id, stop_ids=[tok.eos_token_id]).generate(
        ps, samples_per_prompt=group_size, params=SamplingParams(max_new_tokens=6), seed=0)
    flat = [c for g in groups for c in g]
    scored = ScoredBatch(positions=list(range(len(ps))), prompt_ids=ps,
                         completion_ids=[c.token_ids for c in flat],
                         logprobs=[c.logprobs for c in flat], versions=[c.versions for c in flat],
                         rewards=[float(i % 2) for i in range(len(flat))],
                         finish_reasons=[c.finish_reason for c in flat], completions=[""] * len(flat),
                         group_size=group_size)
    return RolloutBatch(index=0, behavior_version=0, num_groups=len(ps), group_size=group_size,
                        payload=scored)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shared_prefix", [True, False])
def test_the_learner_on_the_device_takes_the_cpu_learners_steps(tiny_model_dir, tmp_path, device,
                                                                 shared_prefix):
    batch = rollout_batch(tiny_model_dir)
    # a KL anchor (a second model on the device) and masks (thresholds against device tensors) too
    keys = dict(lr=1e-3, updates_per_batch=2, shared_prefix=shared_prefix, kl_coef=0.01)
    masks = ("correction.mask=token", "correction.outlier_token=20.0")
    settings = config(*masks, **keys)
    cpu = TorchLearner(tiny_model_dir, settings)
    dev = TorchLearner(tiny_model_dir, config(*masks, **keys, device=device))
    assert next(dev.model.parameters()).device.type == device
    for version in range(2):
        a, b = cpu.train(batch, train_version=version), dev.train(batch, train_version=version)
        assert (a.committed_updates, b.committed_updates) == (2, 2)
        for key in ("loss/policy", "loss/kl", "ratio/mean", "mismatch/logprob_abs_diff_max", "train/entropy"):
            assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-3, abs=1e-5), key
    for p, q in zip(cpu.model.parameters(), dev.model.parameters(), strict=True):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), atol=1e-5, rtol=1e-4)
    # publication: the exported weights land in host memory whatever the learner's device
    from tether.rollout.channel import Snapshot

    weights = dev.export_weights()
    snapshot = Snapshot.for_tensors(weights)
    snapshot.write(weights, version=4)
    assert snapshot._block.verify(4) >= 0.0
    # a checkpoint written on the device loads into a CPU learner, optimizer state included
    dev.save(tmp_path / "ckpt")
    back = TorchLearner(tiny_model_dir, settings)
    back.load(tmp_path / "ckpt")
    for p, q in zip(back.model.parameters(), dev.model.parameters(), strict=True):
        assert torch.equal(p.detach(), q.detach().cpu())
    assert back.train(batch, train_version=2).committed_updates == 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shared_prefix", [True, False])
def test_a_recomputing_learner_on_the_device_takes_the_plain_learners_steps(tiny_model_dir, device,
                                                                          shared_prefix):
    """train.activation_checkpointing on the device: the same updates as without it (the model's
    own forward and the shared-prompt one), and, on CUDA, a lower peak of allocated memory in an
    update."""
    batch = rollout_batch(tiny_model_dir)
    keys = dict(lr=1e-3, updates_per_batch=2, shared_prefix=shared_prefix, kl_coef=0.01, device=device)
    peaks = {}
    learners = {}
    for recompute in (False, True):
        settings = config(activation_checkpointing=recompute, **keys)
        learner = learners[recompute] = TorchLearner(tiny_model_dir, settings)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        assert learner.train(batch, train_version=0).committed_updates == 2
        if device == "cuda":
            peaks[recompute] = torch.cuda.max_memory_allocated() - base
    for p, q in zip(learners[False].model.parameters(), learners[True].model.parameters(), strict=True):
        torch.testing.assert_close(q.detach(), p.detach(), atol=1e-6, rtol=1e-5)
    if device == "cuda":
        print(f"\npeak allocated in an update: {peaks[False] / 2**20:.1f} MiB without, "
              f"{peaks[True] / 2**20:.1f} MiB with checkpointing")
        assert peaks[True] < peaks[False]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shared_prefix", [True, False])
def test_a_token_budget_on_the_device_makes_the_cpu_learners_fixed_count_update(tiny_model_dir, device,
                                                                                 shared_prefix):
    """train.max_tokens_per_micro_batch on the device (micro-batches packed by tokens, each forward
    run to its own longest row) against the CPU learner's micro-batches of 4 sequences."""
    batch = rollout_batch(tiny_model_dir)
    bounds = ("data.max_prompt_tokens=9", "rollout.max_new_tokens=6")  # the longest row: 15 tokens
    keys = dict(lr=5e-5, updates_per_batch=2, shared_prefix=shared_prefix, kl_coef=0.01)
    cpu = TorchLearner(tiny_model_dir, config(*bounds, micro_batch_size=4, **keys))
    dev = TorchLearner(tiny_model_dir, config(*bounds, max_tokens_per_micro_batch=30, device=device, **keys))
    for version in range(2):
        a, b = cpu.train(batch, train_version=version), dev.train(batch, train_version=version)
        assert (a.committed_updates, b.committed_updates) == (2, 2)
        for key in ("loss/policy", "loss/kl", "ratio/mean", "train/entropy"):
            assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-3, abs=1e-5), key
        assert b.metrics["train/micro_batches"] >= 2
    for p, q in zip(cpu.model.parameters(), dev.model.parameters(), strict=True):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="learner ranks on NCCL need two CUDA devices (two ranks cannot share one)")
@pytest.mark.parametrize("extra", [{}, {"activation_checkpointing": True}, {"dtype": "bfloat16"}],
                         ids=["float32", "checkpointing", "bfloat16"])
def test_two_nccl_ranks_take_the_single_device_learners_steps(tiny_model_dir, extra):
    """train.world_size=2 on CUDA: NCCL ranks on cuda:0 and cuda:1 make the one-GPU update,
    publish whole weights to host memory, and report each rank's largest peak memory; with
    activation checkpointing (marked before fully_shard) and with the bfloat16 learner
    (MixedPrecisionPolicy) against the same single-device learner."""
    from tether.train.ranks import ProcessRanks, RankGroup

    batch = rollout_batch(tiny_model_dir)
    keys = dict(lr=5e-5, updates_per_batch=2, shared_prefix=False, kl_coef=0.01, device="cuda", **extra)
    # bfloat16 compute rounds each side's sums differently: its figures agree to its rounding
    rel, atol = (2e-2, 5e-4) if extra.get("dtype") == "bfloat16" else (1e-3, 1e-5)
    one = TorchLearner(tiny_model_dir, config(**keys))
    two = RankGroup(ProcessRanks(config(**keys, world_size=2), tiny_model_dir, None))
    try:
        for version in range(2):
            a, b = one.train(batch, train_version=version), two.train(batch, train_version=version)
            assert (a.committed_updates, b.committed_updates) == (2, 2)
            for key in ("loss/policy", "loss/kl", "ratio/mean", "train/entropy"):
                assert b.metrics[key] == pytest.approx(a.metrics[key], rel=rel, abs=atol), key
            assert b.metrics["memory/trainer_gpu_peak_mb"] > 0
        weights = dict(two.export_weights())  # gathered before the ranks stop
    finally:
        two.close()
    for name, p in one.export_weights().items():
        assert weights[name].device.type == "cpu"
        torch.testing.assert_close(weights[name], p.detach().cpu(), atol=atol, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="learner ranks on NCCL need two CUDA devices (two ranks cannot share one)")
def test_two_nccl_ranks_with_cpu_offload_take_the_single_device_learners_steps(tiny_model_dir):
    """train.cpu_offload=true: two NCCL ranks whose shards, gradients and AdamW state live in host
    memory (FSDP2's CPUOffloadPolicy) make the one-GPU update."""
    from tether.train.ranks import ProcessRanks, RankGroup

    batch = rollout_batch(tiny_model_dir)
    keys = dict(lr=5e-5, updates_per_batch=2, shared_prefix=False, device="cuda")
    one = TorchLearner(tiny_model_dir, config(**keys))
    two = RankGroup(ProcessRanks(config(**keys, world_size=2, cpu_offload=True), tiny_model_dir, None))
    try:
        for version in range(2):
            a, b = one.train(batch, train_version=version), two.train(batch, train_version=version)
            assert (a.committed_updates, b.committed_updates) == (2, 2)
            assert b.metrics["loss/policy"] == pytest.approx(a.metrics["loss/policy"], rel=1e-3, abs=1e-5)
        weights = dict(two.export_weights())
    finally:
        two.close()
    for name, p in one.export_weights().items():
        torch.testing.assert_close(weights[name], p.detach().cpu(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_a_bfloat16_learner_and_engine_on_the_device(tiny_model_dir, device):
    """train.dtype=bfloat16 on the device: float32 weights, gradients and AdamW state there, a
    gradient within bfloat16's rounding of the float32 learner's, the same-weight mismatch it adds
    reported, and its held-out evaluation under autocast; rollout.dtype=bfloat16: the engine's
    log-probs a bfloat16 teacher-forced forward gives to bfloat16's rounding."""
    from tether.modeling import cast_parameters

    batch = rollout_batch(tiny_model_dir)
    learners = {d: TorchLearner(tiny_model_dir, config(f"train.dtype={d}", lr=1e-3, device=device))
                for d in ("float32", "bfloat16")}
    results = {d: learner.train(batch, train_version=0) for d, learner in learners.items()}
    bf16 = learners["bfloat16"]
    assert {(p.device.type, p.dtype, p.grad.dtype) for p in bf16.params} == {(device, torch.float32,
                                                                               torch.float32)}
    assert {t.dtype for s in bf16.optimizer.state.values() for t in s.values() if t.dim()} == {torch.float32}
    grads = {d: torch.cat([p.grad.flatten() for p in learner.params]) for d, learner in learners.items()}
    assert float(torch.nn.functional.cosine_similarity(grads["float32"], grads["bfloat16"], dim=0)) > 0.999
    numeric = {d: r.metrics["mismatch/numeric_logprob_abs_diff_mean"] for d, r in results.items()}
    assert numeric["bfloat16"] > 30 * numeric["float32"]
    from tether.families.text.evaluate import Evaluator

    model, tok = on(device, tiny_model_dir)
    task = get_task("arithmetic")
    evaluate = bf16.precision.evaluating(Evaluator(
        bf16.model, tok, task.examples("eval", 4, seed=0), _task_scorer(), stop_text=task.stop,
        params=SamplingParams(max_new_tokens=6), num_samples=2))
    assert evaluate(step=1)["eval/examples"] == 4.0
    engine = TorchEngine(cast_parameters(model, "bfloat16"), pad_id=tok.pad_token_id,
                         stop_ids=[tok.eos_token_id])
    prompt = prompt_ids(tok, ["12+34="])[0]
    [group] = engine.generate([prompt], samples_per_prompt=2, params=SamplingParams(max_new_tokens=8), seed=0)
    for c in group:
        with torch.no_grad():
            ids = torch.tensor([prompt + c.token_ids], device=device)
            logits = model(ids).logits[0, len(prompt) - 1:-1].float()
        expected = torch.log_softmax(logits, -1).gather(
            -1, torch.tensor(c.token_ids, device=device)[:, None])[:, 0].cpu()
        assert torch.allclose(torch.tensor(c.logprobs), expected, atol=0.05)


def _task_scorer():
    from tether.data.rewards import scorer

    return scorer("task", task="arithmetic")


@pytest.mark.parametrize("device", DEVICES)
def test_held_out_evaluation_runs_on_the_learners_device(tiny_model_dir, device):
    from tether.data.rewards import scorer
    from tether.families.text.evaluate import Evaluator

    model, tok = on(device, tiny_model_dir)
    task = get_task("arithmetic")
    evaluate = Evaluator(model, tok, task.examples("eval", 8, seed=0), scorer("task", task="arithmetic"),
                         stop_text=task.stop, params=SamplingParams(max_new_tokens=6), num_samples=3)
    metrics = evaluate(step=1)
    assert metrics["eval/examples"] == 8.0 and metrics["eval/num_samples"] == 3.0
    assert 0.0 <= metrics["eval/sampled_pass_at_1"] <= metrics["eval/pass_at_k"] <= 1.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_a_learner_asked_for_cuda_without_it_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"train\.device=cuda, but this process sees no CUDA") as info:
        TorchLearner(tiny_model_dir, config(device="cuda"))
    assert "set train.device=cpu" in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_asking_for_cuda_without_it_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ConfigError, match="no CUDA device") as info:
        Rollout(WorkerSpec(0, pool_settings(tiny_model_dir), device="cuda"))
    assert "ray.gpus_per_worker=0" in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_tether_eval_on_cuda_without_it_is_a_clear_error(tiny_model_dir, capsys):
    from tether.cli.main import main

    assert main(["eval", "--model", str(tiny_model_dir), "train.device=cuda", "data.num_eval=4"]) == 2
    assert "train.device=cuda, but this process sees no CUDA" in capsys.readouterr().err
