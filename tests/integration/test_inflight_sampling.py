"""Weights that change mid-generation (``async.inflight_update``), at the sampler: every token
is stamped with the version whose forward gave its logits, and its log-prob is what that forward
gave — checked against independent forwards of the old and new models:

- ``keep``: the prefix's keys and values stay as the old weights computed them (the reference:
  the old model's forward over the prefix, then the new model's over the rest, on that cache);
- ``recompute``: every token after the switch is the new model's teacher-forced log-prob;
- ``abort``: finished rows are the old model's; every unfinished row is sampled again, all of it
  under the new weights; the dropped tokens are counted.
"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tether.control.inflight import inflight_mode  # noqa: E402
from tether.decoding.sampling import (  # noqa: E402  # noqa: E402
    SamplingParams,
    _cache_kwarg,
    _cache_of,
    _TransformersStepper,
    sample,
    stepper_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SWITCH_AT = 3  # the poll before the 4th decode step puts the new weights in place
PARAMS = SamplingParams(max_new_tokens=12, temperature=1.0)


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    old = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    new = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(5)
        for p in new.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return old, new, tok


def prompt_ids(tok):
    return [tok(t, add_special_tokens=False).input_ids for t in ["1+1=", "12+345=", "rev abcdef="]]


def run(models, mode, *, lean=True, switch_at=SWITCH_AT, stop=True, seed=0):
    """Sample from a working copy of the old model, switching it to the new weights at the
    ``switch_at``-th poll (never if None)."""
    old, new, tok = models
    model = transformers.AutoModelForCausalLM.from_config(old.config).eval()
    model.load_state_dict(old.state_dict())
    polls = []

    def poll():
        polls.append(len(polls))
        if len(polls) - 1 != switch_at:
            return None
        with torch.no_grad():
            for p, q in zip(model.parameters(), new.parameters(), strict=True):
                p.copy_(q)
        return 1

    stepper = stepper_for(model) if lean else _TransformersStepper(model)
    out = sample(model, prompt_ids(tok), PARAMS, stop_ids=[tok.eos_token_id] if stop else [],
                 pad_id=tok.pad_token_id, generator=torch.Generator().manual_seed(seed), stepper=stepper,
                 samples_per_prompt=2, version=0, poll=poll, inflight=inflight_mode(mode))
    return out


def teacher_forced(model, prompt, completion):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1: -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def kept(old, new, prompt, completion, k):
    """Log-probs of ``completion`` when the old model computed the keys and values of the prompt
    and of its first ``k`` tokens, and the new model everything after (on that cache)."""
    with torch.no_grad():
        head = old(torch.tensor([prompt + completion[:k]]), use_cache=True)
        cache = {_cache_kwarg(type(new)): _cache_of(head)}
        tail = new(torch.tensor([completion[k:]]), use_cache=True, **cache)
    logits = torch.cat([head.logits[0, len(prompt) - 1:], tail.logits[0]]).float()[:-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def rows(models):
    _old, _new, tok = models
    return [p for p in prompt_ids(tok) for _ in range(2)]


@pytest.mark.parametrize("lean", [True, False], ids=["lean-decoder", "transformers-forward"])
def test_keep_continues_on_the_old_prefix_cache_with_the_new_weights(models, lean):
    old, new, _tok = models
    out = run(models, "keep", lean=lean, stop=False)
    assert out.switches == 1 and out.wasted_tokens == 0
    for prompt, toks, lps, vs in zip(rows(models), out.tokens, out.logprobs, out.versions, strict=True):
        assert vs == [0] * (SWITCH_AT + 1) + [1] * (len(toks) - SWITCH_AT - 1)
        expected = kept(old, new, prompt, toks, SWITCH_AT)
        assert torch.allclose(torch.tensor(lps), expected, atol=1e-5)
        # and the old part is the old model's own
        before = slice(0, SWITCH_AT + 1)
        assert torch.allclose(torch.tensor(lps[before]), teacher_forced(old, prompt, toks)[before], atol=1e-5)
    # the kept cache is not the new model's: a recomputation would give other log-probs
    prompt, toks = rows(models)[0], out.tokens[0]
    assert not torch.allclose(kept(old, new, prompt, toks, SWITCH_AT)[SWITCH_AT + 1:],
                              teacher_forced(new, prompt, toks)[SWITCH_AT + 1:], atol=1e-4)


@pytest.mark.parametrize("lean", [True, False], ids=["lean-decoder", "transformers-forward"])
def test_recompute_runs_the_prefix_again_under_the_new_weights(models, lean):
    old, new, _tok = models
    out = run(models, "recompute", lean=lean, stop=False)
    assert out.switches == 1
    for prompt, toks, lps, vs in zip(rows(models), out.tokens, out.logprobs, out.versions, strict=True):
        assert vs == [0] * (SWITCH_AT + 1) + [1] * (len(toks) - SWITCH_AT - 1)
        lps = torch.tensor(lps)
        before, after = slice(0, SWITCH_AT + 1), slice(SWITCH_AT + 1, None)
        assert torch.allclose(lps[before], teacher_forced(old, prompt, toks)[before], atol=1e-5)
        assert torch.allclose(lps[after], teacher_forced(new, prompt, toks)[after], atol=1e-5)


def test_abort_samples_unfinished_rows_again_under_the_new_weights(models):
    _old, new, _tok = models
    out = run(models, "abort", stop=False)  # no stop token: every row is unfinished at the switch
    assert out.switches == 1
    assert out.wasted_tokens == (SWITCH_AT + 1) * 6
    for prompt, toks, lps, vs in zip(rows(models), out.tokens, out.logprobs, out.versions, strict=True):
        assert len(toks) == PARAMS.max_new_tokens and vs == [1] * len(toks)
        assert torch.allclose(torch.tensor(lps), teacher_forced(new, prompt, toks), atol=1e-5)


def test_abort_keeps_the_rows_that_had_finished(models):
    """With the stop token on, rows that stopped before the switch keep their old tokens; the
    rest start over (found by seed: some rows stop early)."""
    old, new, _tok = models
    for seed in range(40):
        out = run(models, "abort", switch_at=4, seed=seed)
        finished_early = [len(vs) <= 5 and set(vs) == {0} for vs in out.versions]
        if any(finished_early) and not all(finished_early):
            break
    else:
        pytest.fail("no seed gave both early-finished and unfinished rows")
    redone = [not f for f in finished_early]
    assert out.wasted_tokens == 5 * sum(redone)
    for prompt, toks, lps, vs, again in zip(rows(models), out.tokens, out.logprobs, out.versions, redone,
                                            strict=True):
        model = new if again else old
        assert set(vs) == {1 if again else 0}
        assert torch.allclose(torch.tensor(lps), teacher_forced(model, prompt, toks), atol=1e-5)


@pytest.mark.parametrize("mode", ["keep", "recompute", "abort"])
def test_without_a_switch_every_mode_samples_what_plain_sampling_does(models, mode):
    old, _new, tok = models
    plain = sample(old, prompt_ids(tok), PARAMS, stop_ids=[tok.eos_token_id], pad_id=tok.pad_token_id,
                   generator=torch.Generator().manual_seed(0), samples_per_prompt=2)
    polled = run(models, mode, switch_at=None)
    assert polled.tokens == plain.tokens and polled.logprobs == plain.logprobs
    assert polled.switches == 0 and all(set(vs) <= {0} for vs in polled.versions)
