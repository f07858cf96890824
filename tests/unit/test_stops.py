"""What ends a turn (``tether.decoding.stops``) on a character tokenizer: the end-of-turn ids, stop
strings of one token and of several, and the refusal of text the tokenizer cannot express."""

import json

import pytest

pytest.importorskip("transformers")

from tether.data.tiny_model import build_char_tokenizer
from tether.decoding.stops import StopStrings, end_of_turn_ids, generation_eos_ids, turn_ends
from tether.errors import ConfigError

CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
GEMMA = "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"


@pytest.fixture()
def tok():
    t = build_char_tokenizer()
    t.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<start_of_turn>",
                                                        "<end_of_turn>", "<|eot_id|>"]})
    return t


def test_the_end_of_turn_ids_are_the_eos_then_the_template_s_end_token_when_it_uses_one(tok):
    eos = tok.eos_token_id
    assert end_of_turn_ids(tok) == (eos,)  # no template: EOS alone
    tok.chat_template = CHATML
    assert end_of_turn_ids(tok) == (eos, tok.convert_tokens_to_ids("<|im_end|>"))
    tok.chat_template = GEMMA  # <|eot_id|> is in the vocabulary but not in this template
    assert end_of_turn_ids(tok) == (eos, tok.convert_tokens_to_ids("<end_of_turn>"))


def test_the_generation_config_s_end_ids_count_an_id_or_a_list(tok, tmp_path):
    assert generation_eos_ids(tmp_path) == []
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert generation_eos_ids(tmp_path) == [7]  # config.json's, as vLLM reads it without a generation config
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9, 7]}))
    assert generation_eos_ids(tmp_path) == [2, 9, 7]
    assert end_of_turn_ids(tok, [tok.eos_token_id, 9]) == (tok.eos_token_id, 9)  # no repeats


def test_a_stop_string_of_one_token_is_an_id_and_a_longer_one_is_matched_as_text(tok):
    ends = turn_ends(tok, ["\n", "</call>", "</call>", ""])
    assert ends.stop_ids == (tok.convert_tokens_to_ids("\n"),)
    assert ends.strings == ("</call>",)
    assert ends.ids == [tok.eos_token_id, tok.convert_tokens_to_ids("\n")]
    assert turn_ends(tok, "").ids == [tok.eos_token_id]


@pytest.mark.parametrize("stop", ["€", "snow☃"])
def test_a_stop_string_the_tokenizer_cannot_express_is_refused_naming_the_key(tok, stop):
    with pytest.raises(ConfigError, match=r"env\.turn_stop=.* cannot be expressed by the model's tokenizer"):
        turn_ends(tok, stop)


def test_the_token_that_completes_a_stop_string_is_found_and_no_earlier_one(tok):
    stops = StopStrings(tok, ["</call>", "ans"])
    ids = tok("get b</call> more", add_special_tokens=False).input_ids
    completed = [k for k in range(1, len(ids) + 1) if stops.completes(ids[:k])]
    assert completed[0] == len(tok("get b</call>", add_special_tokens=False).input_ids)
    assert not stops.completes(tok("an", add_special_tokens=False).input_ids)
    assert stops.completes(tok("xx ans", add_special_tokens=False).input_ids)
