"""Where a turn ends: stop strings of several tokens, the end-of-turn ids (EOS, the chat template's,
the generation config's), chat turns not cut at a newline, and the action an environment receives
(special tokens kept, the final end-of-turn token left out)."""

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
import torch

from tether.config.config import Config, load_config
from tether.errors import ConfigError
from tether.vocabulary import Completion, Example, SamplingParams, WorkItem

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
ECHO = f"{Path(__file__).with_name('envs.py')}:Echo"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SAMPLED = SamplingParams(max_new_tokens=12, temperature=1.0)  # a random model's greedy turns repeat
PROMPTS = ["go 1\n", "go 23\n", "key b\n"]


def config(model_dir, *extra: str):
    return load_config(None, ["model.family=agent", "data.task=kv_lookup", f"model.path={model_dir}",
                              f"env.env_class={ECHO}", "env.max_turns=3", "env.max_turn_tokens=8",
                              "rollout.max_new_tokens=8", "rollout.group_size=2", *extra])


def with_turn_stop(cfg, stop: str):
    """``cfg`` with ``env.turn_stop`` set to ``stop`` as it is (an override would strip whitespace)."""
    recipe = cfg.to_dict()
    recipe["env"]["turn_stop"] = stop
    return Config.from_dict(recipe)


def sampler_for(cfg):
    from tether.families.agent.sampler import AgentSampler

    return AgentSampler(cfg, str(cfg.model.path), cfg.env.turn_stop, device=torch.device("cpu"), threads=1,
                        seed=0)


def sampled_turns(sampler):
    """The turns of ``PROMPTS`` at temperature 1 from seed 0: the same draws whatever ends them."""
    ids = [sampler.tokenizer(p, add_special_tokens=False).input_ids for p in PROMPTS]
    out = sampler.engine.generate(ids, samples_per_prompt=1, params=SAMPLED, seed=0)
    return [c for (c,) in out]


@pytest.fixture(scope="module")
def chat_model(tiny_model_dir, tmp_path_factory):
    """The tiny model with ChatML's tokens and a protocol marker ``<tool>`` as special tokens, a
    ChatML template, its EOS left ``<eos>`` (not ``<|im_end|>``), and a generation config that
    also ends at ``;``."""
    from tether.modeling import load_causal_lm

    model, tokenizer = load_causal_lm(tiny_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<tool>"]})
    tokenizer.chat_template = CHATML
    model.resize_token_embeddings(len(tokenizer))
    path = tmp_path_factory.mktemp("chat") / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    semicolon = tokenizer.convert_tokens_to_ids(";")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokenizer.eos_token_id,
                                                                             semicolon]}))
    return path


def test_the_end_of_turn_ids_are_the_eos_the_template_s_and_the_generation_config_s(chat_model):
    from tether.decoding.stops import generation_eos_ids, turn_ends
    from tether.modeling import load_tokenizer

    tok = load_tokenizer(chat_model)
    eos, im_end, semicolon = (tok.convert_tokens_to_ids(t) for t in ("<eos>", "<|im_end|>", ";"))
    ends = turn_ends(tok, "\n", generation_eos=generation_eos_ids(chat_model))
    assert ends.end_ids == (eos, im_end, semicolon)
    assert ends.stop_ids == (tok.convert_tokens_to_ids("\n"),) and ends.strings == ()
    assert turn_ends(tok, "</call>").strings == ("</call>",)  # seven tokens: matched as text


@pytest.mark.parametrize("decoder", ["auto", "python"])
def test_a_stop_string_of_several_tokens_ends_the_turn_where_it_completes(tiny_model_dir, decoder):
    """The string is cut from what the model samples anyway, so it must end there; a turn ended by
    it is a stop, not a truncation. On the native decoder (auto) and the lean decoder's Python path."""
    free = sampler_for(config(tiny_model_dir, "env.turn_stop=", f"rollout.decoder={decoder}"))
    try:
        turns = sampled_turns(free)
        text = free.tokenizer.decode(turns[0].token_ids, skip_special_tokens=False)
    finally:
        free.close()
    assert len(text) == 12, text  # plain characters (the tiny tokenizer: one token each)
    stop = text[3:6]
    end = text.index(stop) + len(stop)  # where the string first completes
    cut = sampler_for(with_turn_stop(config(tiny_model_dir, f"rollout.decoder={decoder}"), stop))
    try:
        stopped = sampled_turns(cut)
    finally:
        cut.close()
    assert stopped[0].token_ids == turns[0].token_ids[:end]
    assert stopped[0].finish_reason == "stop"
    for before, after in zip(turns[1:], stopped[1:], strict=True):  # the others: cut where theirs completes
        full = free.tokenizer.decode(before.token_ids)
        assert after.token_ids == before.token_ids[:full.index(stop) + len(stop) if stop in full else None]


def test_a_stop_string_the_tokenizer_cannot_express_is_refused_naming_the_key(tiny_model_dir):
    from tether.families.agent import FAMILY

    with pytest.raises(ConfigError, match=r"env\.turn_stop='€nd' cannot be expressed"):
        FAMILY.data(config(tiny_model_dir, "env.turn_stop=€nd"), Path(tiny_model_dir))


def test_chat_turns_are_not_cut_at_a_newline_by_default(chat_model):
    for chat, cut in (("true", False), ("false", True)):
        sampler = sampler_for(config(chat_model, f"data.chat_template={chat}"))
        try:
            tok_newline = sampler.tokenizer.convert_tokens_to_ids("\n")
            assert (tok_newline in sampler.engine.stop_ids) is cut
            assert sampler.tokenizer.convert_tokens_to_ids("<|im_end|>") in sampler.engine.stop_ids
        finally:
            sampler.close()


def scripted(sampler, turns: list[str], finish: str = "stop"):
    """Make the sampler's engine return ``turns`` (text with special tokens) in order, one a call."""
    tok = sampler.tokenizer
    planned = iter(turns)

    def generate(prompts, *, samples_per_prompt, params, seed):
        text = next(planned)
        ids = tok(text, add_special_tokens=False).input_ids
        return [[Completion(token_ids=list(ids), logprobs=[-1.0] * len(ids), versions=[0] * len(ids),
                            finish_reason=finish)] for _ in prompts]

    sampler.engine.generate = generate


def play_one(sampler):
    examples = [(0, Example(prompt="p", answer="1"))]
    return sampler.generate(WorkItem(batch_index=0, version=0, examples=examples, group_size=1,
                                     params=SamplingParams(max_new_tokens=8), seed=1))


def test_a_chat_turn_ended_by_the_template_s_end_token_closes_once_and_the_action_keeps_markers(chat_model):
    """EOS is ``<eos>``, the template closes turns with ``<|im_end|>``: a turn the model ends with
    ``<|im_end|>`` is stored once (not ``ok<|im_end|><|im_end|>``), and the environment receives the
    turn with its ``<tool>`` marker and without the end-of-turn token."""
    sampler = sampler_for(config(chat_model, "data.chat_template=true"))
    scripted(sampler, ["<tool>get b<|im_end|>", "ok<|im_end|>", "done<eos>"])
    try:
        batch = play_one(sampler)
    finally:
        sampler.close()
    text = sampler.tokenizer.decode(batch.ids[0], skip_special_tokens=False)
    assert "<|im_end|><|im_end|>" not in text
    assert "assistant\n<tool>get b<|im_end|>\n<|im_start|>user\no1:" in text
    assert "assistant\nok<|im_end|>\n<|im_start|>user\no2:" in text
    assert batch.transcripts[0][1::2] == ["<tool>get b", "ok", "done"]  # the actions
    assert batch.statuses == ["done"]


def test_a_plain_text_action_keeps_special_tokens_but_not_the_final_eos(tiny_model_dir):
    sampler = sampler_for(config(tiny_model_dir))
    scripted(sampler, ["<pad>a\n", "b<eos>", "c<eos>"])
    try:
        batch = play_one(sampler)
    finally:
        sampler.close()
    assert batch.transcripts[0][1::2] == ["<pad>a\n", "b", "c"]


def test_a_turn_cut_by_the_budget_is_counted_and_one_ended_by_a_stop_is_not(tiny_model_dir):
    sampler = sampler_for(config(tiny_model_dir))
    scripted(sampler, ["abcdefgh"] * 3, finish="length")
    try:
        assert play_one(sampler).metrics["agent/turn_truncated_frac"] == 1.0
        scripted(sampler, ["ab\n"] * 3)
        assert play_one(sampler).metrics["agent/turn_truncated_frac"] == 0.0
    finally:
        sampler.close()
