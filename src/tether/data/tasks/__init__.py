"""Verifiable tasks of the text family: built-in ones, and any a plug-in registers."""

from tether.data.tasks.base import EVAL_BUCKET_PERCENT, Split, Task, split_of, strip_answer
from tether.data.tasks.builtin import (
    ARITHMETIC,
    CHAT_SUM,
    COUNTDOWN,
    FORMAT_CREDIT,
    QUESTION,
    REPEAT,
    REVERSE,
    SORT,
    evaluate_expression,
)
from tether.registry import tasks


def get_task(name: str) -> Task:
    """The task called ``name`` (``tether.registry.tasks``: built in, or registered by a
    plug-in); an unknown name lists the valid ones."""
    return tasks.get(name)


__all__ = ["ARITHMETIC", "CHAT_SUM", "COUNTDOWN", "EVAL_BUCKET_PERCENT", "FORMAT_CREDIT", "QUESTION",
           "REPEAT", "REVERSE", "SORT",
           "Split", "Task", "evaluate_expression", "get_task", "split_of", "strip_answer"]
