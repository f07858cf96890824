"""vLLM behind the engine seam, in real rollout worker processes on vLLM's CPU build.

Runs where vLLM is installed (`make test` runs this folder with .venv-vllm); skipped elsewhere.
One pool (one vLLM engine) serves the module; the truncated-sampling test starts a second.
"""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from configs import pool_settings  # noqa: E402
from procs import running, wait_gone  # noqa: E402
from tether.data.stream import PromptStream  # noqa: E402
from tether.data.tasks import get_task  # noqa: E402
from tether.errors import RolloutError  # noqa: E402
from tether.families.text.batch import to_train_batch, token_logprobs  # noqa: E402
from tether.modeling import load_causal_lm, unique_parameters  # noqa: E402
from tether.rollout.backends.local.pool import ProcessPool  # noqa: E402
from tether.vocabulary import GenerationRequest  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
STREAM = PromptStream(get_task("arithmetic").examples("train", 300, seed=0), batch_size=4)
TEMPERATURE = 0.8


def start(model_dir, *sampling):
    """A pool of one vLLM worker, sampling as ``sampling`` (rollout.* overrides) says."""
    model, tokenizer = load_causal_lm(model_dir)
    settings = pool_settings(model_dir, "rollout.group_size=4", "rollout.engine=vllm", *sampling)
    return ProcessPool(settings, STREAM.batch, unique_parameters(model)), model, tokenizer


@pytest.fixture(scope="module")
def vllm_pool(demo_model):
    pool, model, tokenizer = start(demo_model, "rollout.max_new_tokens=8",
                                   f"rollout.temperature={TEMPERATURE}")
    with pool:
        yield pool, model, tokenizer
    assert wait_gone(pool.pids) == []


def collect(pool, n, timeout=120):
    got = []
    while len(got) < n:
        got += pool.wait(timeout)
    return sorted(got, key=lambda b: b.index)


def deltas(model, pad_id, batch, temperature=TEMPERATURE, truncate=None):
    """|log μ (the engine's) − log π (the learner's computation)| over every sampled token."""
    tb = to_train_batch(batch.payload, pad_id)
    with torch.no_grad():
        if truncate is None:
            logp, _ = token_logprobs(model, tb, temperature)
        else:
            logits = model(input_ids=tb.input_ids, attention_mask=tb.attention_mask).logits[:, :-1]
            logits = logits / temperature
            logp = truncate(logits).log_softmax(-1).gather(-1, tb.targets[..., None]).squeeze(-1)
    on = tb.mask.bool()
    return (logp[on] - tb.behavior_logp[on]).abs()


def test_vllm_log_probs_equal_the_learners_and_seeds_repeat(vllm_pool, record_property):
    pool, model, tokenizer = vllm_pool
    assert all(running(p) for p in pool.pids)
    for i in range(3):
        pool.launch(GenerationRequest(index=i, version=0))
    batches = collect(pool, 3)
    diff = torch.cat([deltas(model, tokenizer.pad_token_id, b) for b in batches])
    mean, worst = diff.mean().item(), diff.max().item()
    record_property("vllm_logprob_delta", json.dumps({"mean": mean, "max": worst, "tokens": diff.numel()}))
    print(f"\nvLLM vs learner log-probs (float32, demo-size model, T={TEMPERATURE}): mean |Δ| {mean:.2e}, "
          f"max |Δ| {worst:.2e} over {diff.numel()} tokens")
    assert mean <= 1e-4 and worst <= 1e-3
    for b in batches:
        scored = b.payload
        assert (b.num_groups, b.group_size, b.behavior_version) == (4, 4, 0)
        assert all(v == 0 for vs in scored.versions for v in vs)
        assert {"reward/mean", "time/generate", "throughput/gen_tokens_per_s"} <= set(b.metrics)
    # the same seed, weights and prompts: the same tokens
    pool.launch(GenerationRequest(index=1, version=0))
    assert collect(pool, 1)[0].payload.completion_ids == batches[1].payload.completion_ids


def test_a_publication_changes_what_vllm_samples_and_a_torn_one_is_refused(vllm_pool):
    pool, model, tokenizer = vllm_pool
    pool.launch(GenerationRequest(index=0, version=0))
    before = collect(pool, 1)[0]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    metrics = pool.publish(unique_parameters(model), 5)
    assert {"sync/publish_s", "sync/load_s", "sync/bytes"} <= set(metrics)
    pool.launch(GenerationRequest(index=0, version=5))
    after = collect(pool, 1)[0]
    assert after.behavior_version == 5 and all(v == 5 for vs in after.payload.versions for v in vs)
    assert after.payload.completion_ids != before.payload.completion_ids
    # the new weights, not a cached prefix of the old ones, produced them
    assert deltas(model, tokenizer.pad_token_id, after).mean().item() <= 1e-4
    # a block modified after its checksum was taken never reaches vLLM
    channel, publish = pool.channel, pool.channel.publish

    def torn(weights, version):
        out = publish(weights, version)
        next(iter(channel.views().values())).view(-1)[0] += 1.0
        return out

    channel.publish = torn
    with pytest.raises(RolloutError, match="fail their checksum"):
        pool.publish(unique_parameters(model), 6)


def test_truncated_sampling_log_probs_are_of_the_renormalised_distribution(demo_model):
    """top-k / top-p: vLLM's processed log-probs are those of the truncated, renormalised
    distribution it samples from — the built-in engine's μ too."""
    k, p = 5, 0.9
    pool, model, tokenizer = start(demo_model, "rollout.max_new_tokens=8", "rollout.temperature=1.0",
                                   f"rollout.top_k={k}", f"rollout.top_p={p}")

    def truncate(logits):
        kth = logits.topk(k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(-1)
        ordered, order = probs.sort(-1, descending=True)
        drop = (ordered.cumsum(-1) - ordered) > p  # keep the smallest prefix reaching p
        return logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))

    with pool:
        pool.launch(GenerationRequest(index=0, version=0))
        batch = collect(pool, 1)[0]
    diff = deltas(model, tokenizer.pad_token_id, batch, temperature=1.0, truncate=truncate)
    assert diff.mean().item() <= 1e-4
    full = deltas(model, tokenizer.pad_token_id, batch, temperature=1.0)
    assert full.max().item() > 1e-3  # against the full softmax they differ: truncation is in μ
    assert wait_gone(pool.pids) == []


def test_the_vllm_engine_keeps_the_token_engine_contract(demo_model):
    """The checks every token engine passes (tests/integration/test_contracts.py), on vLLM."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
    from test_contracts import check_token_engine

    from tether import registry
    from tether.config import load_config
    from tether.decoding.sampling import stop_ids_for
    from tether.modeling import load_tokenizer

    cfg = load_config(None, [f"model.path={demo_model}", "rollout.engine=vllm", "rollout.max_new_tokens=6"])
    tokenizer = load_tokenizer(demo_model)
    engine = registry.engines.get("vllm").build(cfg, str(demo_model), tokenizer,
                                                stop_ids_for(tokenizer, "\n"), device=torch.device("cpu"),
                                                threads=1, seed=0)
    try:
        prompts = [tokenizer(p, add_special_tokens=False).input_ids for p in ("1+2=", "33+4=")]
        check_token_engine(engine, prompts, cfg.sampling())
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2"])
def test_vllm_and_the_learner_agree_on_every_architecture_it_serves(tmp_path, arch):
    """tests/integration/test_architectures.py's check on vLLM: at the same weights the learner's
    log-probs of what vLLM sampled are vLLM's (float32)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
    from test_architectures import TEXTS, engine_batch

    from architectures import build
    from configs import config
    from tether import registry
    from tether.decoding.sampling import stop_ids_for
    from tether.modeling import load_tokenizer
    from tether.train.learner import TorchLearner

    path = build(tmp_path / arch, arch, "char", TEXTS)
    cfg = config(f"model.path={path}", "rollout.engine=vllm", "rollout.max_new_tokens=6", lr=1e-3,
                 shared_prefix=False)
    tokenizer = load_tokenizer(path)
    try:
        engine = registry.engines.get("vllm").build(cfg, str(path), tokenizer, stop_ids_for(tokenizer, ""),
                                                    device=torch.device("cpu"), threads=1, seed=0)
    except Exception as exc:  # an architecture vLLM's CPU build does not serve
        pytest.skip(f"vLLM does not serve {arch} here: {type(exc).__name__}: {str(exc)[:200]}")
    try:
        batch = engine_batch(engine, tokenizer)
    finally:
        engine.close()
    metrics = TorchLearner(path, cfg).train(batch, train_version=0).metrics
    mean, worst = (metrics[f"mismatch/numeric_logprob_abs_diff_{k}"] for k in ("mean", "max"))
    print(f"\n{arch} on vLLM: |log π − log μ| at the same weights: mean {mean:.1e}, max {worst:.1e}")
    assert mean <= 1e-5, (arch, mean, worst)
