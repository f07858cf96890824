"""Imported first by the fork server that rollout workers and learner ranks start from
(``tether.procinfo.CHILD_PRELOAD``): there, and only there, it makes the server ignore SIGTERM and
SIGHUP, as multiprocessing already makes it ignore SIGINT. A signal to the run's whole process
group (``kill -TERM -PGID``, a scheduler's preemption, a closed terminal) then leaves the server
serving while the driver stops the run in order; had the server died, multiprocessing would report
every child it forked as exited (status 255) while they still ran. The server still ends with the
driver (multiprocessing ends it when the driver's end of its pipe closes), at once, without the
interpreter's teardown. Each child starts with both signals as a program the driver started would
have them: ignored where the driver ignores them (a run under ``nohup``), else at their defaults
(``tether.procinfo.start_child``)."""

from __future__ import annotations

import atexit
import os
import signal
import sys


def _in_fork_server() -> bool:
    """Whether this import runs inside ``multiprocessing.forkserver.main`` (its preload)."""
    from multiprocessing import forkserver

    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


def _exit_at_once() -> None:
    """The server's last exit handler (registered first, so run last): end the process before the
    interpreter's teardown, which with torch and transformers imported takes seconds of CPU
    (``benchmarks/startup.py``) while the run that ended waits on the server to go. A forked child
    never runs it: multiprocessing ends each with ``os._exit``."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if _in_fork_server():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    atexit.register(_exit_at_once)
