"""A reward that never returns: a generation that outlives async.wait_timeout_s. ``holding_a_lock``
first makes a multiprocessing lock in the worker, as a library may on first use (tqdm's write lock
for diffusers' bars): a named semaphore, registered with the resource tracker until the process's
exit handlers unlink it. Made in a forkserver context, as the worker itself was: in the default
context of Linux's Python 3.11 (fork) a lock is unlinked at once and never registered. It then
creates the file ``$HANG_LOCK_MADE`` names, if set, so a test knows the lock exists."""

import multiprocessing
import os
import time
from pathlib import Path

LOCKS = []


def reward(prompt, completion, answer, fields):
    time.sleep(3600)
    return 0.0


def holding_a_lock(prompt, completion, answer, fields):
    LOCKS.append(multiprocessing.get_context("forkserver").RLock())
    if os.environ.get("HANG_LOCK_MADE"):
        Path(os.environ["HANG_LOCK_MADE"]).touch()
    return reward(prompt, completion, answer, fields)
