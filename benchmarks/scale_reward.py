"""The scale benchmark's reward: a model with random weights answers nothing a task can verify, so
every group would score the same and the learner would skip its update (nothing to learn from).
This scores a completion by a property that varies between samples (the parity of its length in
characters), so each update does the work a real one does."""


def varied(prompt, completion, answer, fields):
    return float(len(completion) % 2)
