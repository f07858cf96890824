"""The records data flows in: one example (a prompt and its reference answer) and a reward."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Example:
    """One prompt with its reference answer and whatever other fields its row had."""

    prompt: str
    answer: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    """The row's other columns (passed to reward functions); built-in tasks put their inputs here."""
    demonstration: str | None = None
    """A correct completion for supervised warm start (defaults to the answer)."""

    @property
    def target(self) -> str:
        return self.answer if self.demonstration is None else self.demonstration
