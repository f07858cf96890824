"""Tiny models: built locally, saved with save_pretrained, loaded back by the Auto classes."""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tether.data.tiny_model import SIZES, build_char_tokenizer, init_model  # noqa: E402
from tether.errors import ConfigError  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_round_trip_through_auto_classes(tmp_path, arch):
    info = init_model(tmp_path / "m", arch=arch, size="tiny", seed=1)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "m")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert model.config.model_type == arch
    assert sum(p.numel() for p in model.parameters()) == info.parameters
    assert json.loads((tmp_path / "m" / "tether_model.json").read_text())["arch"] == arch
    # the reloaded weights are the saved ones: same logits as a fresh build with the same seed
    again = init_model(tmp_path / "again", arch=arch, size="tiny", seed=1)
    assert again.parameters == info.parameters
    other = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    ids = torch.tensor([tok("12+34=").input_ids])
    assert torch.equal(model(ids).logits, other(ids).logits)


def test_char_tokenizer_is_one_token_per_character_with_left_padding():
    tok = build_char_tokenizer()
    text = "rev abc=\ncba"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.padding_side == "left"
    batch = tok(["1+1=", "12+34="], padding=True)
    assert batch.input_ids[0][:2] == [tok.pad_token_id] * 2
    assert batch.attention_mask[0] == [0, 0, 1, 1, 1, 1]
    assert tok.decode([*ids, tok.eos_token_id], skip_special_tokens=True) == text
    assert tok.convert_ids_to_tokens(tok("é", add_special_tokens=False).input_ids) == ["<unk>"]


def test_presets_have_the_documented_sizes(tmp_path):
    from tether.data.tiny_model import build_model

    def count(size, arch="qwen3", vocab=87):
        with torch.device("meta"):  # shapes only: the 1.5b preset would take 6 GB
            return sum(p.numel() for p in build_model(vocab, arch=arch, size=size).parameters())

    assert 50_000 < count("tiny") < 200_000
    assert 2_500_000 < count("small") < 4_000_000
    assert 20_000_000 < count("base") < 30_000_000
    # the released Qwen2-0.5B and Qwen2-1.5B have 494,032,768 and 1,543,714,304 parameters
    assert count("0.5b", "qwen2", SIZES["0.5b"].vocab_size) == 494_032_768
    assert count("1.5b", "qwen2", SIZES["1.5b"].vocab_size) == 1_543_714_304


def test_a_padded_tokenizer_keeps_its_characters_and_fills_to_the_vocabulary():
    plain, padded = build_char_tokenizer(), build_char_tokenizer(vocab_size=1000)
    assert len(padded) == 1000
    text = "12+34=46"
    assert padded(text).input_ids == plain(text).input_ids
    assert padded.convert_ids_to_tokens([999]) == ["<x_" + str(999 - len(plain)) + ">"]
    with pytest.raises(ConfigError, match="cannot hold"):
        build_char_tokenizer(vocab_size=10)


def test_init_refuses_to_overwrite_and_bad_choices(tmp_path):
    init_model(tmp_path / "m", size="tiny")
    with pytest.raises(ConfigError, match="already exists and is not empty"):
        init_model(tmp_path / "m", size="tiny")
    init_model(tmp_path / "m", size="tiny", overwrite=True)
    with pytest.raises(ConfigError, match=r"choose one of: tiny, small, base, 0\.5b, 1\.5b"):
        init_model(tmp_path / "x", size="huge")
    with pytest.raises(ConfigError, match="choose one of: qwen3, llama, qwen2"):
        init_model(tmp_path / "y", arch="gpt2")
