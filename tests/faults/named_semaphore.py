"""A plug-in that, like tqdm's write lock, makes a multiprocessing lock in every process that
imports it: in a spawned or forkserver child the lock is a named semaphore, registered with the
resource tracker until the process's exit handlers unlink it."""

import multiprocessing

LOCK = multiprocessing.RLock()
