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
import contextlib
import os
import signal
import socket
import sys
import time


def _server_frame():
    """``multiprocessing.forkserver.main``'s frame where this import runs inside it (its preload),
    else None."""
    from multiprocessing import forkserver

    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return frame
        frame = frame.f_back
    return None


def _socket_path(fd: int | None) -> str | None:
    """The file of the listening socket ``fd`` (the server's, in its driver's multiprocessing
    temporary folder ``pymp-*``), or None."""
    if fd is None:
        return None
    try:
        with socket.socket(fileno=os.dup(fd)) as listener:
            name = listener.getsockname()
    except OSError:
        return None
    return name if isinstance(name, str) and name else None


_SOCKET: str | None = None
_DRIVER = os.getppid()
_SERVER = os.getpid()


def _driver_gone(wait: float = 1.0) -> bool:
    """Whether the driver (the process that started the server) has ended: the server then has
    another parent. The server sees its pipe close while the driver's exit is still under way, so
    this waits up to ``wait`` seconds for the change."""
    deadline = time.monotonic() + wait
    while os.getppid() == _DRIVER:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _exit_at_once() -> None:
    """The server's exit handler, registered before torch's and transformers' own and so run after
    them: end the process before the interpreter's teardown, which with both imported takes seconds
    of CPU (``benchmarks/startup.py``) while the run that ended waits on the server to go. The
    server ends when its driver has gone, which removes its temporary folder as it exits, unless it
    was killed (SIGKILL, the OOM killer): then the server removes its socket there, and the folder
    if nothing else is left in it (never while the driver runs: it would start its next server
    there). A forked child never runs this: multiprocessing ends each with ``os._exit``; nor does
    a process such a child forks in turn (it inherits the handler, and returns at once)."""
    if os.getpid() != _SERVER:
        return
    if _SOCKET and os.path.exists(_SOCKET) and _driver_gone():  # not an error's exit under a live driver
        with contextlib.suppress(OSError):
            os.unlink(_SOCKET)
            os.rmdir(os.path.dirname(_SOCKET))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


_frame = _server_frame()
if _frame is not None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _SOCKET = _socket_path(_frame.f_locals.get("listener_fd"))
    atexit.register(_exit_at_once)
del _frame
