"""The batched KV-cache sampler: log-prob semantics, padding, stopping, and seeding."""

import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tether.decoding.sampling import SamplingParams, categorical, sample, truncate_logits  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def model_and_tok(tiny_model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    return model, tok


def prompts(tok, texts):
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


def teacher_forced(model, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion])
    logits = model(ids).logits[0, len(prompt) - 1: -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_teacher_forced_forward(model_and_tok, temperature):
    model, tok = model_and_tok
    ps = prompts(tok, ["1+1=", "12+345=", "rev abcdef="])  # different lengths → left padding
    out = sample(model, ps, SamplingParams(max_new_tokens=12, temperature=temperature),
                 stop_ids=[tok.eos_token_id], pad_id=tok.pad_token_id,
                 generator=torch.Generator().manual_seed(0))
    for p, toks, lps in zip(ps, out.tokens, out.logprobs, strict=True):
        expected = teacher_forced(model, p, toks, temperature)
        assert torch.allclose(torch.tensor(lps), expected, atol=1e-5)


def test_same_seed_same_tokens_other_seed_other_tokens(model_and_tok):
    model, tok = model_and_tok
    ps = prompts(tok, ["12+34="] * 8)

    def run(seed):
        return sample(model, ps, SamplingParams(max_new_tokens=10), stop_ids=[tok.eos_token_id],
                      pad_id=tok.pad_token_id, generator=torch.Generator().manual_seed(seed)).tokens

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_padding_does_not_change_greedy_output(model_and_tok):
    model, tok = model_and_tok
    short, long_ = prompts(tok, ["7+8=", "rev abcdefgh="])
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    alone = sample(model, [short], greedy, stop_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
    batched = sample(model, [long_, short], greedy, stop_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
    assert batched.tokens[1] == alone.tokens[0]
    assert batched.logprobs[1] == pytest.approx(alone.logprobs[0], abs=1e-5)


def test_each_sequence_stops_at_its_own_stop_token(model_and_tok):
    model, tok = model_and_tok
    ps = prompts(tok, ["1+2=", "3+4=", "5+6="])
    # make every token a stop token for greedy decoding: every sequence stops after one token
    out = sample(model, ps, SamplingParams(max_new_tokens=5, temperature=0.0),
                 stop_ids=list(range(len(tok))), pad_id=tok.pad_token_id)
    assert [len(t) for t in out.tokens] == [1, 1, 1]
    assert out.finish_reasons == ["stop"] * 3
    none = sample(model, ps, SamplingParams(max_new_tokens=5, temperature=0.0), stop_ids=[],
                  pad_id=tok.pad_token_id)
    assert [len(t) for t in none.tokens] == [5, 5, 5]
    assert none.finish_reasons == ["length"] * 3


def test_truncation_keeps_exactly_top_k_and_the_top_p_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    k2 = truncate_logits(logits.clone(), top_k=2, top_p=1.0)
    assert torch.isinf(k2).tolist() == [[False, False, True, True]]
    p = truncate_logits(logits.clone(), top_k=0, top_p=0.8)  # 0.5 + 0.3 reaches 0.8
    assert torch.isinf(p).tolist() == [[False, False, True, True]]
    p = truncate_logits(logits.clone(), top_k=0, top_p=0.81)
    assert torch.isinf(p).tolist() == [[False, False, False, True]]


def test_categorical_draws_follow_the_distribution_and_never_pick_a_truncated_token():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logp = torch.log(probs).expand(4000, -1).contiguous()  # 4000 rows, one draw each
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([categorical(logp, g) for _ in range(25)])  # 100,000 draws
    counts = torch.bincount(draws, minlength=5).double()
    assert counts[4] == 0  # probability 0 (log p = −inf) is never drawn
    expected = probs[:4].double() * len(draws)
    chi2 = float(((counts[:4] - expected) ** 2 / expected).sum())
    assert chi2 < 16.3  # χ²(3 d.o.f.) at p = 0.001
    # and it is not a constant: a uniform distribution spreads the draws
    uniform = categorical(torch.zeros(1000, 4), g)
    assert set(uniform.tolist()) == {0, 1, 2, 3}
    assert categorical(logp[:8], torch.Generator().manual_seed(1)).tolist() == \
        categorical(logp[:8], torch.Generator().manual_seed(1)).tolist()


def test_truncated_logprobs_are_of_the_renormalised_distribution(model_and_tok):
    model, tok = model_and_tok
    ps = prompts(tok, ["12+34="] * 16)
    out = sample(model, ps, SamplingParams(max_new_tokens=6, top_k=3), stop_ids=[],
                 pad_id=tok.pad_token_id, generator=torch.Generator().manual_seed(0))
    full = [teacher_forced(model, p, t, 1.0) for p, t in zip(ps, out.tokens, strict=True)]
    # μ renormalises over 3 tokens, so log μ ≥ log π for every sampled token, strictly somewhere
    gaps = [lp - f for lps, fs in zip(out.logprobs, full, strict=True)
            for lp, f in zip(lps, fs.tolist(), strict=True)]
    assert min(gaps) > -1e-5
    assert max(gaps) > 1e-3
    assert all(math.isfinite(x) for lps in out.logprobs for x in lps)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_lean_decoder_and_transformers_forward_agree(tmp_path, arch):
    from tether.data.tiny_model import init_model
    from tether.decoding.fast_decoder import FastDecoder, supports
    from tether.decoding.sampling import _TransformersStepper

    init_model(tmp_path / arch, arch=arch, size="tiny", seed=3)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / arch).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / arch)
    assert supports(model)
    ps = prompts(tok, ["1+1=", "123+456=", "rev abcdefg="])
    params = SamplingParams(max_new_tokens=10, temperature=0.8)
    outs = [sample(model, ps, params, stop_ids=[tok.eos_token_id], pad_id=tok.pad_token_id,
                   generator=torch.Generator().manual_seed(4), stepper=stepper)
            for stepper in (FastDecoder(model), _TransformersStepper(model))]
    assert outs[0].tokens == outs[1].tokens
    for a, b in zip(outs[0].logprobs, outs[1].logprobs, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_unsupported_models_fall_back_to_the_transformers_forward(model_and_tok):
    from tether.decoding.fast_decoder import FastDecoder
    from tether.decoding.sampling import stepper_for

    model, _tok = model_and_tok
    assert isinstance(stepper_for(model), FastDecoder)
    model.config.use_sliding_window = True  # a feature the lean path does not implement
    try:
        assert not isinstance(stepper_for(model), FastDecoder)
    finally:
        model.config.use_sliding_window = False


def test_truncated_sampling_is_noted_at_start():
    from tether.rollout.notes import sampling_notes

    assert sampling_notes(SamplingParams(temperature=0.7)) == []
    (note,) = sampling_notes(SamplingParams(top_k=20, top_p=0.9))
    assert note.code == "truncated_sampling"
    assert "rollout.top_k=20 and rollout.top_p=0.9" in note.message
    assert "include the truncation" in note.message


@pytest.mark.parametrize("stepper_kind", ["lean", "transformers"])
def test_a_group_shares_its_prompt_prefill_and_samples_like_repeated_prompts(model_and_tok, stepper_kind):
    from tether.decoding.fast_decoder import FastDecoder
    from tether.decoding.sampling import _TransformersStepper

    model, tok = model_and_tok
    stepper = FastDecoder(model) if stepper_kind == "lean" else _TransformersStepper(model)
    ps = prompts(tok, ["1+1=", "12+345=", "rev abcdef="])  # different lengths → left padding
    params = SamplingParams(max_new_tokens=10, temperature=0.9)
    kw = dict(stop_ids=[tok.eos_token_id], pad_id=tok.pad_token_id, stepper=stepper)
    grouped = sample(model, ps, params, generator=torch.Generator().manual_seed(5), samples_per_prompt=4,
                     **kw)
    flat = sample(model, [p for p in ps for _ in range(4)], params,
                  generator=torch.Generator().manual_seed(5), **kw)
    assert len(grouped.tokens) == 12 and grouped.tokens == flat.tokens  # prompt-major, same draws
    assert len({tuple(t) for t in grouped.tokens[:4]}) > 1  # the group's samples differ
    for p_index, p in enumerate(ps):
        for row in range(4 * p_index, 4 * p_index + 4):
            expected = teacher_forced(model, p, grouped.tokens[row], 0.9)
            assert torch.allclose(torch.tensor(grouped.logprobs[row]), expected, atol=1e-5)
