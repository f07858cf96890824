"""The scale benchmark's reward: a model with random weights answers nothing a task can verify, so
every group would score the same and the learner would skip its update (nothing to learn from).
This scores a completion by a number read from its text (its CRC-32, spread over [0, 1]): two
different completions almost never score the same, so every group has a spread and each update
does the work a real one does. (The parity of the length, used before, gave every sample of a
batch the same score one time in a few at 1.5B: the update was skipped and timed as 7 ms.)"""

import zlib


def varied(prompt, completion, answer, fields):
    return zlib.crc32(completion.encode()) % 1009 / 1008
