"""A reward that never returns: a generation that outlives async.wait_timeout_s."""

import time


def reward(prompt, completion, answer, fields):
    time.sleep(3600)
    return 0.0
