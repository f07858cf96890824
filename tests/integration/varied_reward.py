"""A reward for tests that varies within a group even for an untrained model."""


def reward(prompt, completion, answer, fields):
    return float(len(completion) % 2)
