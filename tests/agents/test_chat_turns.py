"""Observations as chat turns: only the new turn's text is encoded and appended, the model's ids
are never re-encoded, and a template that rewrites earlier turns is refused."""

from pathlib import Path

import pytest
from envs import Echo, Summarises

pytest.importorskip("torch")

from tether.decoding.sampling import stop_ids_for
from tether.families.agent.chat import ChatTurns, NotAppendOnly
from tether.families.agent.env import factory
from tether.families.agent.envthreads import EnvThreads
from tether.families.agent.episodes import Limits, Player
from tether.modeling import load_causal_lm
from tether.rollout.engines.torch.engine import TorchEngine
from tether.vocabulary import SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# renders every assistant turn but the last empty: what templates that strip earlier reasoning do
FORGETFUL = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_model(tiny_model_dir, tmp_path_factory):
    """The tiny model with ChatML's two special tokens, <|im_end|> its EOS, and a ChatML template."""
    model, tokenizer = load_causal_lm(tiny_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = CHATML
    model.resize_token_embeddings(len(tokenizer))
    path = tmp_path_factory.mktemp("chat") / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def play(path, template=None, episodes=4, env=Echo):
    model, tokenizer = load_causal_lm(path)
    if template is not None:
        tokenizer.chat_template = template
    engine = TorchEngine(model, pad_id=tokenizer.pad_token_id, stop_ids=stop_ids_for(tokenizer, ""))
    threads = EnvThreads(2)
    player = Player(engine, tokenizer, factory(env, {}), Limits(4, 6, 256, 10, 60), threads, chat=True)
    try:
        return tokenizer, player.play([({}, 0)] * episodes, SamplingParams(max_new_tokens=6), seed=1)
    finally:
        threads.close()


def test_each_observation_appends_only_its_own_turn_and_the_model_ids_stay_as_sampled(chat_model):
    tokenizer, episodes = play(chat_model)
    for ep in episodes:
        assert ep.status == "done" and ep.turns == 3
        text = tokenizer.decode(ep.ids, skip_special_tokens=False)
        assert text == ep.chat.text  # the sequence is the episode's text, token for token
        runs, start = [], None  # the runs of model tokens: one per turn
        for j, m in enumerate([*ep.model, 0]):
            if m and start is None:
                start = j
            elif not m and start is not None:
                runs.append((start, j))
                start = None
        assert len(runs) == 3
        # up to the last turn, the sequence is exactly the template's rendering of the conversation
        before_last = tokenizer.decode(ep.ids[: runs[-1][0]], skip_special_tokens=False)
        assert before_last == tokenizer.apply_chat_template(
            ep.chat.messages[:-1], tokenize=False, add_generation_prompt=True
        )
        assert text.startswith("<|im_start|>user\ngo \n<|im_end|>\n<|im_start|>assistant\n")
        for (_, b), (next_a, _) in zip(runs, [*runs[1:], (len(ep.ids), None)], strict=True):
            after = tokenizer.decode(ep.ids[b:next_a], skip_special_tokens=False)
            ended = tokenizer.decode(ep.ids[b - 1 : b], skip_special_tokens=False) == "<|im_end|>"
            if next_a < len(ep.ids):
                assert after.startswith(
                    "\n<|im_start|>user\no" if ended else "<|im_end|>\n<|im_start|>user\no"
                )


def test_a_rewritten_history_opens_a_new_conversation_rendered_by_the_template(chat_model):
    tokenizer, episodes = play(chat_model, env=Summarises)
    for ep in episodes:
        assert ep.status == "done" and ep.rewrites == 1
        first, second = ep.samples()
        assert tokenizer.decode(first.ids, skip_special_tokens=False).startswith("<|im_start|>user\ngo \n")
        text = tokenizer.decode(second.ids, skip_special_tokens=False)
        assert text == ep.chat.text  # the new conversation is the second sample, token for token
        assert text.startswith("<|im_start|>user\nsummary: ")
        opening = tokenizer.apply_chat_template(ep.chat.messages[:1], tokenize=False,
                                                add_generation_prompt=True)
        assert tokenizer.decode(second.ids[: second.model.index(1)], skip_special_tokens=False) == opening


def test_a_template_that_rewrites_earlier_turns_is_refused_with_what_differed(chat_model):
    with pytest.raises(NotAppendOnly, match="not append-only"):
        play(chat_model, FORGETFUL)


def test_a_tokenizer_without_a_template_is_refused(tiny_model_dir):
    _, tokenizer = load_causal_lm(tiny_model_dir)
    from tether.errors import ConfigError

    with pytest.raises(ConfigError, match="no chat template"):
        ChatTurns(tokenizer)


def test_the_warm_start_encodes_transcripts_as_the_player_appends_them(chat_model):
    from tether.families.agent.warmstart import encode_transcript

    _, tokenizer = load_causal_lm(chat_model)
    ids, labels = encode_transcript(
        tokenizer,
        [("key b", False), ("get b<|im_end|>", True), ("b=7", False), ("ans 7<|im_end|>", True)],
        chat=True,
    )
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text == (
        "<|im_start|>user\nkey b<|im_end|>\n<|im_start|>assistant\nget b<|im_end|>\n<|im_start|>user\n"
        "b=7<|im_end|>\n<|im_start|>assistant\nans 7<|im_end|>"
    )
    trained = tokenizer.decode(
        [i for i, lab in zip(ids, labels, strict=True) if lab != -100], skip_special_tokens=False
    )
    assert trained == "get b<|im_end|>ans 7<|im_end|>"
    assert Path(chat_model).is_dir()
