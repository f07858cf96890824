"""A reward for tests that varies within a group even for an untrained model: a fraction derived
from the completion's text, so two different samples of a prompt (almost surely) score apart
and every group has something to learn from. Deterministic across processes (no salted hash)."""

import hashlib


def reward(prompt, completion, answer, fields):
    return int(hashlib.sha256(completion.encode()).hexdigest()[:8], 16) % 1000 / 1000
