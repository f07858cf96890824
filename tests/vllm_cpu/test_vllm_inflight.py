"""vLLM switching weights mid-generation (``async.inflight_update`` keep, recompute, abort) in real
rollout worker processes on vLLM's CPU build: without a publication each mode samples exactly
what draining samples; with publications every token's version is the weights that produced it
(checked against transformers forwards of each version), and abort leaves every sequence under
one version and counts what it threw away."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from test_inflight_update import (  # noqa: E402
    check_abort,
    check_recompute_stamps,
    eval_model,
    publish_until_a_switch,
    sampled_rows,
)
from test_vllm_engine import STREAM, collect  # noqa: E402

from configs import pool_settings  # noqa: E402
from procs import wait_gone  # noqa: E402
from tether.modeling import load_causal_lm, unique_parameters  # noqa: E402
from tether.rollout.backends.local.pool import ProcessPool  # noqa: E402
from tether.vocabulary import GenerationRequest  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ATOL = 1e-4  # vLLM's CPU kernels against a transformers forward, float32


def pool_for(model_dir, mode):
    model, _ = load_causal_lm(model_dir)
    settings = pool_settings(model_dir, "rollout.group_size=8", "rollout.max_new_tokens=40",
                             "rollout.engine=vllm", f"async.inflight_update={mode}", stop_text="")
    return ProcessPool(settings, STREAM.batch, unique_parameters(model)), model


@pytest.fixture(scope="module")
def drained(demo_model):
    """What a draining vLLM worker samples for batch 0 at version 0."""
    pool, _ = pool_for(demo_model, "drain")
    with pool:
        pool.launch(GenerationRequest(index=0, version=0))
        return collect(pool, 1)[0].payload


def kept_cache_logprobs(model, weights, prompt, tokens, versions):
    """Log-probs of ``tokens`` when each decode step ran under the version stamped on the token it
    gave, continuing the KV cache the earlier steps left (what keep does): a transformers
    forward per run of equal versions, on the cache of the runs before."""
    from transformers import DynamicCache

    cache, out, k = DynamicCache(), [], 0
    while k < len(tokens):
        end = k
        while end < len(tokens) and versions[end] == versions[k]:
            end += 1
        ids = (prompt if k == 0 else [tokens[k - 1]]) + tokens[k:end - 1]
        model.load_state_dict(weights[versions[k]], strict=False)
        with torch.no_grad():
            o = model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
        cache = o.past_key_values
        logits = o.logits[0, -(end - k):].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[k:end])[:, None]).squeeze(-1))
        k = end
    return torch.cat(out)


def check_keep(model_dir, batch, weights):
    scored = batch.payload
    assert any(len(set(vs)) > 1 for vs in scored.versions), "no sequence saw a publication"
    assert batch.metrics["rollout/weight_switches"] >= 1 and batch.metrics["rollout/wasted_tokens"] == 0
    model = eval_model(model_dir)
    for row, prompt, toks, lps, vs in sampled_rows(scored, weights):
        expected = kept_cache_logprobs(model, weights, prompt, toks, vs)
        assert torch.allclose(torch.tensor(lps), expected, atol=ATOL), row


@pytest.mark.parametrize("mode", ["keep", "recompute", "abort"])
def test_vllm_switches_weights_mid_generation_and_stamps_every_token(demo_model, drained, mode):
    pool, model = pool_for(demo_model, mode)
    with pool:
        pids = list(pool.pids)
        pool.launch(GenerationRequest(index=0, version=0))
        quiet = collect(pool, 1)[0].payload  # nothing published: exactly what draining samples
        assert quiet.completion_ids == drained.completion_ids
        for got, want in zip(quiet.logprobs, drained.logprobs, strict=True):
            assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-6)
        assert all(v == 0 for vs in quiet.versions for v in vs)
        batch, launched, weights = publish_until_a_switch(pool, model, mode)
    assert wait_gone(pids) == []
    if mode == "keep":
        check_keep(demo_model, batch, weights)
    elif mode == "recompute":
        check_recompute_stamps(demo_model, batch, weights, atol=ATOL)
    else:  # some rows may stop at end-of-sequence before the first switch
        check_abort(batch, every_row_restarted=False, launched=launched)
