"""Built-in verifiable tasks, looked up by name."""

from tether.data.tasks.base import EVAL_BUCKET_PERCENT, Split, Task, split_of, strip_answer
from tether.data.tasks.builtin import (
    ARITHMETIC,
    COUNTDOWN,
    FORMAT_CREDIT,
    REPEAT,
    REVERSE,
    SORT,
    evaluate_expression,
)
from tether.errors import ConfigError

TASKS: dict[str, Task] = {t.name: t for t in (ARITHMETIC, COUNTDOWN, REVERSE, SORT, REPEAT)}


def get_task(name: str) -> Task:
    """The built-in task called ``name``; an unknown name lists the valid ones."""
    try:
        return TASKS[name]
    except KeyError:
        raise ConfigError(f"unknown task {name!r}; built-in tasks are: {', '.join(TASKS)}") from None


__all__ = ["EVAL_BUCKET_PERCENT", "FORMAT_CREDIT", "TASKS", "Split", "Task", "evaluate_expression",
           "get_task", "split_of", "strip_answer"]
