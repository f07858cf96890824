"""A reward that varies within a group for about half of the prompts only: the others score 0
whatever the completion, so their groups have no reward variance (for dynamic sampling tests)."""

import hashlib


def _digest(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16)


def reward(prompt, completion, answer, fields):
    if _digest(prompt) % 2:
        return 0.0
    return _digest(completion) % 1000 / 1000
