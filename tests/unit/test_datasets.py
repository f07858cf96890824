"""Local dataset formats, column mapping, loaders, and their errors."""

import csv
import json
from types import SimpleNamespace

import pytest

from tether.data.datasets import limit_prompt_length, load_examples
from tether.errors import ConfigError, DataError

ROWS = [
    {"question": "1+1=", "solution": "2", "id": 7},
    {"question": "2+2=", "solution": 4, "id": 8},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def check(examples):
    assert [(e.prompt, e.answer) for e in examples] == [("1+1=", "2"), ("2+2=", "4")]
    assert examples[0].fields["id"] in (7, "7")


def test_jsonl(tmp_path):
    check(load_examples(str(write_jsonl(tmp_path / "d.jsonl", ROWS)), prompt_column="question",
                        answer_column="solution"))


def test_json(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    check(load_examples(str(tmp_path / "d.json"), prompt_column="question", answer_column="solution"))


def test_csv(tmp_path):
    with (tmp_path / "d.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["question", "solution", "id"])
        w.writeheader()
        w.writerows(ROWS)
    check(load_examples(str(tmp_path / "d.csv"), prompt_column="question", answer_column="solution"))


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{**r, "solution": str(r["solution"])} for r in ROWS]),
                   tmp_path / "d.parquet")
    check(load_examples(str(tmp_path / "d.parquet"), prompt_column="question", answer_column="solution"))


def test_save_to_disk_folder_and_split_selection(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{**r, "solution": str(r["solution"])} for r in ROWS]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "single"))
    check(load_examples(str(tmp_path / "single"), prompt_column="question", answer_column="solution"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:1])}).save_to_disk(str(tmp_path / "dd"))
    assert len(load_examples(f"{tmp_path / 'dd'}#test", prompt_column="question",
                             answer_column="solution")) == 1
    with pytest.raises(DataError, match=r"holds splits \['train', 'test'\]; choose one as"):
        load_examples(str(tmp_path / "dd"), prompt_column="question", answer_column="solution")
    with pytest.raises(DataError, match="has no split 'dev'"):
        load_examples(f"{tmp_path / 'dd'}#dev", prompt_column="question", answer_column="solution")
    (tmp_path / "not_a_dataset").mkdir()
    with pytest.raises(DataError, match="not a folder written by datasets' save_to_disk"):
        load_examples(str(tmp_path / "not_a_dataset"))


def test_python_loader(tmp_path):
    (tmp_path / "load.py").write_text(
        "def rows():\n    return [{'prompt': f'{i}+1=', 'answer': str(i + 1)} for i in range(3)]\n"
    )
    examples = load_examples(f"{tmp_path / 'load.py'}:rows")
    assert [e.answer for e in examples] == ["1", "2", "3"]
    with pytest.raises(ConfigError, match="defines no 'nope'; its functions are: rows"):
        load_examples(f"{tmp_path / 'load.py'}:nope")
    (tmp_path / "bad.py").write_text("def rows():\n    return 5\n")
    with pytest.raises(DataError, match="must return an iterable of rows"):
        load_examples(f"{tmp_path / 'bad.py'}:rows")


def test_missing_column_names_file_row_and_columns(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "b"}, {"prompt": "c", "ans": "d"}])
    with pytest.raises(DataError) as info:
        load_examples(str(path))
    msg = str(info.value)
    assert str(path) in msg and "line 2" in msg and "no column 'answer'" in msg
    assert "['ans', 'prompt']" in msg and "data.answer_column" in msg


def test_unreadable_rows_and_empty_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "b"}\n{not json\n')
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        load_examples(str(bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="is empty: it must hold at least one row"):
        load_examples(str(empty))
    (tmp_path / "obj.json").write_text('{"prompt": "a"}')
    with pytest.raises(DataError, match="must hold a JSON list of objects"):
        load_examples(str(tmp_path / "obj.json"))
    nulls = write_jsonl(tmp_path / "nulls.jsonl", [{"prompt": "", "answer": "1"}])
    with pytest.raises(DataError, match="line 1: column 'prompt' must be non-empty text"):
        load_examples(str(nulls))
    with pytest.raises(DataError, match="does not exist"):
        load_examples(str(tmp_path / "missing.jsonl"))
    (tmp_path / "d.xml").write_text("x")
    with pytest.raises(DataError, match=r"unknown format '\.xml'"):
        load_examples(str(tmp_path / "d.xml"))
    (tmp_path / "d.txt").write_text("a prompt\n")  # prompts a line: no answers, which text needs
    with pytest.raises(DataError, match="line 1 has no column 'answer'"):
        load_examples(str(tmp_path / "d.txt"))
    assert load_examples(str(tmp_path / "d.txt"), answers=False)[0].prompt == "a prompt"


class CharTokenizer:
    """Stands in for a tokenizer: one token per character."""

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=list(range(len(text))))


def test_long_prompts_are_skipped_and_counted_or_rejected(tmp_path):
    examples = load_examples(str(write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "short", "answer": "1"}, {"prompt": "x" * 50, "answer": "2"}])))
    kept, skipped = limit_prompt_length(CharTokenizer(), examples, 10, "skip")
    assert ([e.prompt for e in kept], skipped) == (["short"], 1)
    too_long = r"example 1 has a 50-token prompt, longer than data\.max_prompt_tokens=10"
    with pytest.raises(DataError, match=too_long):
        limit_prompt_length(CharTokenizer(), examples, 10, "error")
    with pytest.raises(DataError, match="every prompt is longer"):
        limit_prompt_length(CharTokenizer(), examples, 2, "skip")


def test_local_data_is_named_by_the_files_it_is_read_from():
    # `tether eval` says "N held-out examples of <this>": the held-out file too when it is another one
    from tether.data.source import dataset_description

    alone = SimpleNamespace(dataset="train.jsonl", eval_dataset="")
    both = SimpleNamespace(dataset="train.jsonl", eval_dataset="eval.jsonl")
    assert dataset_description(alone) == "dataset train.jsonl"
    assert dataset_description(both) == "dataset train.jsonl (held out: eval.jsonl)"
