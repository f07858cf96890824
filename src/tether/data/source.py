"""From a recipe's data section to train and eval examples, filtered and ready to tokenize."""

from __future__ import annotations

import logging
import random

from tether.config.schema import DataSection
from tether.data.datasets import Unknown, apply_chat_template, limit_prompt_length, load_examples
from tether.data.tasks import get_task
from tether.errors import DataError
from tether.vocabulary import DataBundle

log = logging.getLogger("tether.data")


def dataset_description(d: DataSection) -> str:
    """How messages name a run's local data: the training file, and the held-out file when it is
    another one (`tether eval` and the warm start name what they read)."""
    return f"dataset {d.dataset}" + (f" (held out: {d.eval_dataset})" if d.eval_dataset else "")


def resolve_data(d: DataSection, tokenizer, *, seed: int = 0, eval_seed: int | None = None,
                 room: int | None = None, room_why: str = "") -> DataBundle:
    """Build examples from a built-in task or local datasets, then apply template and length limit:
    ``data.max_prompt_tokens``, or ``room`` (the tokens the model's context leaves a prompt, said by
    ``room_why``) when that is less. A built-in task's held-out examples are drawn by ``eval_seed``
    (``eval.seed``; None: ``seed``)."""
    if d.task:
        task = get_task(d.task)
        difficulty = d.difficulty or task.default_difficulty
        train = task.examples("train", d.num_train, seed=seed, difficulty=difficulty)
        held_out = task.examples("eval", d.num_eval, seed=seed if eval_seed is None else eval_seed,
                                 difficulty=difficulty)
        stop_text = task.stop
        description = f"task {task.name} (difficulty {difficulty})"
    else:
        train, held_out = dataset_splits(d, seed=seed)
        stop_text = ""
        description = dataset_description(d)
    if d.chat_template:
        wrap = {"system": d.system_prompt, "kwargs": dict(d.chat_template_kwargs)}
        train = apply_chat_template(tokenizer, train, **wrap)
        held_out = apply_chat_template(tokenizer, held_out, **wrap)
    limit, why = d.max_prompt_tokens, None
    if room is not None and room < limit:
        limit, why = room, room_why
    unknown = Unknown()
    train, skipped = limit_prompt_length(tokenizer, train, limit, d.on_long_prompt, where=description,
                                         limit=why, unknown=unknown)
    held_out, skipped_eval = limit_prompt_length(tokenizer, held_out, limit, d.on_long_prompt,
                                                 where=f"{description} (eval)", limit=why, unknown=unknown)
    if unknown.prompts:
        log.warning("%d prompts of %s hold text the tokenizer does not know, which it turns into its unknown "
                    "token: e.g. %s. The model cannot tell those characters apart; extend the tokenizer's "
                    "alphabet, or clean the data", unknown.prompts, description, unknown.example)
    return DataBundle(train=train, eval=held_out[: d.num_eval], stop_text=stop_text,
                      skipped_long_prompts=skipped + skipped_eval, description=description)


def dataset_splits(d: DataSection, *, seed: int = 0, answers: bool = True) -> tuple[list, list]:
    """(train, held-out) examples of ``data.dataset``: held out by ``data.eval_dataset``, or the
    last ``data.num_eval`` rows of a seeded shuffle. ``answers`` False: the answer column is
    optional (image prompts)."""
    columns = {"prompt_column": d.prompt_column, "answer_column": d.answer_column, "answers": answers}
    train = load_examples(d.dataset, **columns)
    if d.eval_dataset:
        return train, load_examples(d.eval_dataset, **columns)
    if len(train) <= d.num_eval:
        raise DataError(
            f"dataset {d.dataset} has {len(train)} rows, not enough to hold out "
            f"data.num_eval={d.num_eval} for evaluation and still train; lower data.num_eval "
            "or give data.eval_dataset"
        )
    rows = list(train)
    random.Random(seed).shuffle(rows)
    return rows[: -d.num_eval], rows[-d.num_eval:]
