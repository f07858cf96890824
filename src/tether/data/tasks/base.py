"""The task seam: a deterministic prompt source with disjoint splits, and a verifier.

A task generates examples from a seed and a difficulty. Train and eval splits are disjoint by
construction: a problem belongs to the eval split exactly when a stable hash of its prompt falls
in the eval bucket, so no seed, size or difficulty can put one prompt in both.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from tether.errors import ConfigError
from tether.vocabulary import Example

Split = Literal["train", "eval"]
EVAL_BUCKET_PERCENT = 10
"""Share of the problem space reserved for the eval split, in percent."""
MAX_CONSECUTIVE_MISSES = 20_000
"""Draws in a row that find no new problem before a task is judged exhausted."""


def split_of(prompt: str) -> Split:
    """The split a prompt belongs to, from a stable hash (the same on every machine and run)."""
    h = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "big")
    return "eval" if h % 100 < EVAL_BUCKET_PERCENT else "train"


@dataclass(frozen=True)
class Task:
    """A built-in verifiable task."""

    name: str
    description: str
    difficulties: tuple[int, ...]
    default_difficulty: int
    draw: Callable[[random.Random, int], Example]
    """Draw one random example at a difficulty."""
    verify: Callable[[str, Example], float]
    """Reward in [0, 1] for a completion of an example (partial credit for the format)."""
    stop: str = "\n"
    """Text that ends an answer, besides the tokenizer's end-of-sequence token."""
    family: str = "text"
    """The policy family whose samples it verifies (``model.family``)."""

    def examples(self, split: Split, n: int, *, seed: int = 0,
                 difficulty: int | None = None) -> list[Example]:
        """``n`` distinct examples of ``split``, deterministic in ``seed`` and ``difficulty``."""
        d = self.default_difficulty if difficulty is None else difficulty
        if d not in self.difficulties:
            raise ConfigError(
                f"task {self.name!r} has difficulties {list(self.difficulties)}, got {d}"
            )
        if split not in ("train", "eval"):
            raise ConfigError(f"split must be 'train' or 'eval', got {split!r}")
        rng = random.Random(f"{self.name}/{d}/{split}/{seed}")
        out: list[Example] = []
        seen: set[str] = set()
        misses = 0
        while len(out) < n:
            ex = self.draw(rng, d)
            if ex.prompt in seen or split_of(ex.prompt) != split:
                misses += 1
                if misses > MAX_CONSECUTIVE_MISSES:
                    raise ConfigError(
                        f"task {self.name!r} at difficulty {d} has only about {len(out)} distinct "
                        f"{split} problems, fewer than the {n} asked for; lower data.num_train / "
                        "data.num_eval or raise data.difficulty"
                    )
                continue
            misses = 0
            seen.add(ex.prompt)
            out.append(ex)
        return out


def strip_answer(completion: str, stop: str = "\n") -> str:
    """The answer part of a completion: up to the stop text, surrounding space removed."""
    return completion.split(stop, 1)[0].strip() if stop else completion.strip()
