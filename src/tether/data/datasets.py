"""Local datasets: JSONL, JSON, Parquet, CSV, a `datasets` save_to_disk folder, or a Python loader.

Every source becomes a list of ``Example``. Columns are mapped by name (``prompt_column``,
``answer_column``); the row's other columns travel along as ``Example.fields`` for reward
functions. Nothing is fetched from a hub: a source is a local path or ``path/to/file.py:function``.

Errors name the file, the row (1-based line for JSONL and CSV, 0-based index otherwise) and what
was expected.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tether.errors import ConfigError, DataError
from tether.pyload import load_python_object
from tether.vocabulary import Example

FORMATS = ("jsonl", "json", "parquet", "csv", "txt (one prompt a line)", "save_to_disk folder",
           "file.py:function")


def is_python_spec(source: str) -> bool:
    """``path/to/file.py:function``."""
    path, sep, name = source.rpartition(":")
    return bool(sep) and path.endswith(".py") and name.isidentifier()


def read_rows(source: str) -> tuple[str, Iterable[tuple[str, Any]]]:
    """(a description of the source, (row label, row) pairs)."""
    if is_python_spec(source):
        fn = load_python_object(source, what="dataset loader")
        try:
            rows = fn()
        except Exception as exc:
            raise DataError(f"dataset loader {source} raised {type(exc).__name__}: {exc}") from exc
        if isinstance(rows, Mapping) or not isinstance(rows, Iterable):
            raise DataError(f"dataset loader {source} must return an iterable of rows (dicts), "
                            f"got {type(rows).__name__}")
        return source, ((f"row {i}", r) for i, r in enumerate(rows))
    path_text, _, split = source.partition("#")
    path = Path(path_text)
    if not path.exists():
        raise DataError(f"dataset {path_text!r} does not exist (formats: {', '.join(FORMATS)})")
    if path.is_dir():
        return path_text, _folder_rows(path, split or None)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return path_text, _jsonl_rows(path)
    if suffix == ".json":
        return path_text, _json_rows(path)
    if suffix == ".csv":
        return path_text, _csv_rows(path)
    if suffix == ".txt":
        return path_text, _txt_rows(path)
    if suffix == ".parquet":
        return path_text, _parquet_rows(path)
    raise DataError(f"dataset {path_text!r}: unknown format {suffix!r}; use one of: {', '.join(FORMATS)}")


def _jsonl_rows(path: Path):
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"line {n}", json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: line {n} is not valid JSON ({exc.msg}); each line must be "
                                "one JSON object") from exc


def _json_rows(path: Path):
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, list):
        raise DataError(f"{path} must hold a JSON list of objects, got {type(data).__name__}")
    for i, row in enumerate(data):
        yield f"row {i}", row


def _csv_rows(path: Path):
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        for n, row in enumerate(reader, start=2):  # line 1 is the header
            if None in row:
                raise DataError(f"{path}: line {n} has more fields than the header")
            yield f"line {n}", row


def _txt_rows(path: Path):
    """One prompt per non-blank line, in the column ``prompt`` (Flow-GRPO's prompt files)."""
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if line.strip():
                yield f"line {n}", {"prompt": line.strip()}


def _parquet_rows(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ConfigError("reading Parquet needs pyarrow: pip install 'tether[data]'") from exc
    try:
        table = pq.read_table(path)
    except Exception as exc:
        raise DataError(f"{path} is not a readable Parquet file: {exc}") from exc
    for i, row in enumerate(table.to_pylist()):
        yield f"row {i}", row


def _folder_rows(path: Path, split: str | None):
    try:
        import datasets
    except ImportError as exc:
        raise ConfigError(f"{path} is a folder; reading a `datasets` save_to_disk folder needs the "
                          "datasets package: pip install 'tether[data]'") from exc
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise DataError(f"{path} is not a folder written by datasets' save_to_disk: {exc}") from exc
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            raise DataError(f"{path} holds splits {list(ds)}; choose one as {path}#SPLIT")
        if split not in ds:
            raise DataError(f"{path} has no split {split!r}; its splits are {list(ds)}")
        ds = ds[split]
    elif split:
        raise DataError(f"{path} holds a single dataset, not splits; drop '#{split}'")
    for i, row in enumerate(ds):
        yield f"row {i}", row


def _text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int) or (isinstance(value, float) and math.isfinite(value)):
        return str(value)
    return None


def load_examples(source: str, *, prompt_column: str = "prompt", answer_column: str = "answer",
                  answers: bool = True) -> list[Example]:
    """Read ``source`` into examples, strictly: every row must have both columns (with
    ``answers`` False, as for image prompts, the answer column is optional: '' where absent)."""
    where, rows = read_rows(source)
    out: list[Example] = []
    for label, row in rows:
        if isinstance(row, Example):
            out.append(row)
            continue
        if not isinstance(row, Mapping):
            raise DataError(f"{where}: {label} must be an object with columns, got {type(row).__name__}")
        for column in (prompt_column, answer_column) if answers else (prompt_column,):
            if column not in row:
                raise DataError(
                    f"{where}: {label} has no column {column!r}; its columns are {sorted(row)}. "
                    f"Map yours with data.prompt_column / data.answer_column."
                )
        prompt, answer = _text(row[prompt_column]), _text(row.get(answer_column, ""))
        if not prompt:
            raise DataError(f"{where}: {label}: column {prompt_column!r} must be non-empty text, "
                            f"got {row[prompt_column]!r}")
        if answer is None:
            raise DataError(f"{where}: {label}: column {answer_column!r} must be text or a number, "
                            f"got {row[answer_column]!r}")
        fields = {k: v for k, v in row.items() if k not in (prompt_column, answer_column)}
        out.append(Example(prompt=prompt, answer=answer, fields=fields))
    if not out:
        raise DataError(f"dataset {where} is empty: it must hold at least one row")
    return out


def apply_chat_template(tokenizer, examples: Sequence[Example], *, system: str = "",
                        kwargs: Mapping[str, Any] | None = None) -> list[Example]:
    """Wrap each prompt as one user turn with the tokenizer's chat template, after a ``system``
    message when one is given (``data.system_prompt``), with more template arguments ``kwargs``
    (``data.chat_template_kwargs``)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("data.chat_template is true but the tokenizer has no chat template; "
                          "set data.chat_template=false or use a tokenizer that defines one")
    opening = [{"role": "system", "content": system}] if system else []
    return [
        Example(
            prompt=tokenizer.apply_chat_template([*opening, {"role": "user", "content": ex.prompt}],
                                                 tokenize=False, add_generation_prompt=True,
                                                 **(kwargs or {})),
            answer=ex.answer, fields=ex.fields, demonstration=ex.demonstration,
        )
        for ex in examples
    ]


@dataclass
class Unknown:
    """Prompts holding text the tokenizer does not know (it becomes the unknown token)."""

    prompts: int = 0
    example: str = ""
    """One such character, and the prompt it is in."""


def limit_prompt_length(tokenizer, examples: Sequence[Example], max_tokens: int,
                        policy: Literal["skip", "error"], *, where: str = "dataset",
                        limit: str | None = None,
                        unknown: Unknown | None = None) -> tuple[list[Example], int]:
    """Drop (and count) or reject prompts longer than ``max_tokens`` tokens (``limit`` says what
    sets it: by default data.max_prompt_tokens); count in ``unknown`` the prompts holding text the
    tokenizer turns into its unknown token."""
    limit = limit or f"data.max_prompt_tokens={max_tokens}"
    unk = getattr(tokenizer, "unk_token_id", None)
    kept: list[Example] = []
    skipped = 0
    for i, ex in enumerate(examples):
        ids = tokenizer(ex.prompt, add_special_tokens=False).input_ids
        if unknown is not None and unk is not None and unk in ids:
            unknown.prompts += 1
            unknown.example = unknown.example or _unknown_character(tokenizer, ex.prompt, unk)
        if len(ids) <= max_tokens:
            kept.append(ex)
        elif policy == "error":
            raise DataError(f"{where}: example {i} has a {len(ids)}-token prompt, longer than {limit}; "
                            "raise the limit or set data.on_long_prompt=skip")
        else:
            skipped += 1
    if not kept:
        raise DataError(f"{where}: every prompt is longer than {limit}")
    return kept, skipped


def _unknown_character(tokenizer, prompt: str, unk: int) -> str:
    for char in dict.fromkeys(prompt):
        if unk in tokenizer(char, add_special_tokens=False).input_ids:
            return f"{char!r} in {prompt[:60]!r}"
    return repr(prompt[:60])
