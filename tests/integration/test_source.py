"""From a recipe's data section to examples: tasks, datasets, held-out rows, chat template."""

import json

import pytest

pytest.importorskip("transformers")

from tether.config import load_config
from tether.data.source import resolve_data
from tether.data.tiny_model import build_char_tokenizer
from tether.errors import ConfigError, DataError

pytestmark = pytest.mark.integration
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture
def tok():
    return build_char_tokenizer()


def dataset(tmp_path, n):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"q": f"{i}+1=", "a": str(i + 1)}) + "\n" for i in range(n)))
    return path


def data_cfg(*overrides):
    return load_config(None, list(overrides)).data


def test_task_data(tok):
    bundle = resolve_data(data_cfg("data.task=reverse", "data.difficulty=5", "data.num_train=50",
                                   "data.num_eval=10"), tok)
    assert (len(bundle.train), len(bundle.eval), bundle.stop_text) == (50, 10, "\n")
    assert all(len(e.fields["word"]) == 5 for e in bundle.train)


def test_eval_seed_draws_the_held_out_examples_and_run_seed_the_training_ones(tok):
    def prompts(*overrides):
        cfg = load_config(None, ["data.task=reverse", "data.num_train=50", "data.num_eval=10", *overrides])
        bundle = resolve_data(cfg.data, tok, seed=cfg.run.seed, eval_seed=cfg.eval_seed)
        return [e.prompt for e in bundle.train], [e.prompt for e in bundle.eval]

    (train0, eval0), (train1, eval1) = prompts(), prompts("run.seed=1")
    assert train1 != train0 and eval1 != eval0  # unset, eval.seed is run.seed
    fixed_train, fixed_eval = prompts("run.seed=1", "eval.seed=0")
    assert fixed_eval == eval0 and fixed_train == train1
    assert not set(fixed_train) & set(fixed_eval)  # the splits never share a prompt


def test_dataset_holds_out_num_eval_rows_deterministically(tmp_path, tok):
    cfg = data_cfg("data.task=", f"data.dataset={dataset(tmp_path, 30)}", "data.prompt_column=q",
                   "data.answer_column=a", "data.num_eval=5", "reward.function=exact_match")
    a, b = resolve_data(cfg, tok, seed=1), resolve_data(cfg, tok, seed=1)
    assert (len(a.train), len(a.eval)) == (25, 5)
    assert [e.prompt for e in a.eval] == [e.prompt for e in b.eval]
    assert not {e.prompt for e in a.train} & {e.prompt for e in a.eval}
    small = data_cfg("data.task=", f"data.dataset={dataset(tmp_path, 5)}", "data.prompt_column=q",
                     "data.answer_column=a", "data.num_eval=5", "reward.function=exact_match")
    with pytest.raises(DataError, match=r"not enough to hold out data\.num_eval=5"):
        resolve_data(small, tok)


def test_chat_template_wraps_prompts_or_says_there_is_none(tmp_path, tok):
    cfg = data_cfg("data.task=", f"data.dataset={dataset(tmp_path, 12)}", "data.prompt_column=q",
                   "data.answer_column=a", "data.num_eval=2", "data.chat_template=true",
                   "reward.function=exact_match")
    with pytest.raises(ConfigError, match="the tokenizer has no chat template"):
        resolve_data(cfg, tok)
    tok.chat_template = TEMPLATE
    bundle = resolve_data(cfg, tok)
    assert all(e.prompt.startswith("<user>") and e.prompt.endswith("<assistant>") for e in bundle.train)


def test_long_prompts_are_skipped_and_counted_or_fail_the_run(tok):
    # countdown prompts ('3 4 17>25:') vary in length around 10 characters
    cfg = data_cfg("data.task=countdown", "data.max_prompt_tokens=10", "data.num_train=200",
                   "data.num_eval=20")
    bundle = resolve_data(cfg, tok)
    assert bundle.skipped_long_prompts > 0
    assert 0 < len(bundle.train) < 200
    assert all(len(e.prompt) <= 10 for e in bundle.train + bundle.eval)
    with pytest.raises(DataError, match=r"longer than data\.max_prompt_tokens=10"):
        resolve_data(data_cfg("data.task=countdown", "data.max_prompt_tokens=10",
                              "data.on_long_prompt=error", "data.num_train=200"), tok)


def long_dataset(tmp_path, long_at: int):
    """20 short prompts, and one of 230 characters at row ``long_at`` (deep in the data)."""
    rows = [{"q": f"{i}+1=", "a": str(i + 1)} for i in range(20)]
    rows.insert(long_at, {"q": "9" * 225 + "+1=", "a": "x"})
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompts_are_checked_against_the_models_context_at_load(tiny_model_dir, tmp_path):
    """The tiny model attends over 256 positions: with 40 new tokens a prompt may have 216, less
    than data.max_prompt_tokens=300. A prompt past that is skipped and counted at load, or fails
    the load naming the context — not a worker at the batch that reaches it."""
    family = load_config(None, [f"model.path={tiny_model_dir}"]).family()
    common = [f"model.path={tiny_model_dir}", "data.task=", f"data.dataset={long_dataset(tmp_path, 17)}",
              "data.prompt_column=q", "data.answer_column=a", "data.num_eval=2",
              "data.max_prompt_tokens=300", "reward.function=exact_match", "rollout.max_new_tokens=40"]
    bundle = family.data(load_config(None, common), tiny_model_dir)
    assert bundle.skipped_long_prompts == 1 and len(bundle.train) + len(bundle.eval) == 20
    with pytest.raises(DataError, match=r"example \d+ has a 228-token prompt, longer than the 216 tokens "
                                        r"the model's context of 256 positions leaves after "
                                        r"rollout\.max_new_tokens=40"):
        family.data(load_config(None, [*common, "data.on_long_prompt=error"]), tiny_model_dir)
    with pytest.raises(ConfigError, match=r"rollout\.max_new_tokens=256 leaves no room for a prompt in the "
                                          r"model's context of 256 positions"):
        family.data(load_config(None, [*common[:-1], "rollout.max_new_tokens=256"]), tiny_model_dir)


def test_characters_a_tokenizer_does_not_know_are_counted_and_named(tok, tmp_path, caplog):
    import logging

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"q": q, "a": "1"}) + "\n"
                            for q in ["café=", "naïve=", "plain=", "x=", "y=", "z="]))
    caplog.set_level(logging.WARNING, logger="tether")
    resolve_data(data_cfg("data.task=", f"data.dataset={path}", "data.prompt_column=q",
                          "data.answer_column=a", "data.num_eval=1", "reward.function=exact_match"), tok)
    said = [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("2 prompts of dataset")
    assert "'é' in 'café='" in said[0] or "'ï' in 'naïve='" in said[0]  # the first met, after a shuffle
