"""Facts about the running process, how its children start, and how each ends with the process
that started it."""

from __future__ import annotations

import contextlib
import functools
import os
import select
import shutil
import signal
import sys
import threading
from pathlib import Path

MARKS_ENV = "TETHER_PHASE_MARKS"
"""A folder where each learner process keeps a file named by its pid saying which phase it is in
(``tether.train.memory.phase``), so that whoever outlives it can say where a process the kernel
killed was (``killed``)."""


CHILD_PRELOAD = ("tether.fork_server", "torch", "transformers", "transformers.modeling_utils",
                 "tether.rollout.worker", "tether.rollout.engines.torch.engine", "tether.data.rewards",
                 "tether.train.ranks")
"""What the fork server imports once for every rollout worker and learner rank it forks; each child
then imports only its model's own module. Importing torch and transformers' modeling takes a
process seconds of CPU (``benchmarks/startup.py``), paid once per process that starts runs instead
of once per child. ``tether.fork_server`` comes first: it makes the server outlive a SIGTERM or
SIGHUP to the run's process group."""


def child_context():
    """The multiprocessing context rollout workers and learner ranks start from: a fork server that
    has imported ``CHILD_PRELOAD`` and runs no torch op (so no thread pool exists to be forked),
    shared by every child this process starts; spawn where there is no fork server. A child gets
    this process's working directory and ``sys.path`` at its start from multiprocessing, and its
    environment from ``start_child``."""
    import multiprocessing as mp

    try:
        ctx = mp.get_context("forkserver")
    except ValueError:
        return mp.get_context("spawn")
    ctx.set_forkserver_preload(list(CHILD_PRELOAD))
    return ctx


def start_child_server() -> None:
    """Start ``child_context``'s fork server now, without waiting for it: it imports
    ``CHILD_PRELOAD`` on another core while this process builds the learner, instead of after."""
    ctx = child_context()
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


_SERVER_IGNORES = (signal.SIGTERM, signal.SIGHUP)
"""The signals ``tether.fork_server`` makes the server ignore, which a child must not inherit from it."""


def start_child(ctx, target, args: tuple, *, name: str):
    """Start ``target(*args)`` as a daemon process of ``ctx`` (``child_context``) named ``name``
    (its first 15 characters are also the kernel's name for it: what ``ps -o comm`` and ``top``
    show), with this process's environment as it is now: a forked child would otherwise have the
    fork server's, as it was when the server started (a variable set since, such as a user's
    ``NCCL_*`` or a test's, would be missing). SIGTERM and SIGHUP start as a program this process
    started would have them: ignored where this process ignores them (a run under ``nohup``), else
    at their defaults (the server ignores both: ``tether.fork_server``)."""
    ignored = tuple(s for s in _SERVER_IGNORES if signal.getsignal(s) == signal.SIG_IGN)
    proc = ctx.Process(target=_as_child, args=(dict(os.environ), ignored, target, *args), daemon=True,
                       name=name)
    proc.start()
    return proc


def _as_child(environ: dict[str, str], ignored: tuple[int, ...], target, *args) -> None:
    for sig in _SERVER_IGNORES:
        signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
    if environ != os.environ:
        os.environ.clear()
        os.environ.update(environ)
    import multiprocessing

    _name_process(multiprocessing.current_process().name)
    target(*args)


def _name_process(name: str) -> None:
    """Set the kernel's name for this process (Linux's ``prctl(PR_SET_NAME)``); elsewhere, nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # 15 = PR_SET_NAME


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def exit_when_closed(fd: int, *, orphaned: str | None = None) -> None:
    """End this process (``os._exit``) the moment ``fd`` — the read end of a pipe whose only write
    end another process holds — reaches end of file: that process closed it, exited or was
    killed. Checked at once first, so a process started after the other one already left does
    nothing more; then a daemon thread waits for it, even while the main thread is busy.
    ``orphaned``: a folder the other process made for this one and would have removed; it is
    removed on the way out."""
    exit_now = functools.partial(_exit_now, orphaned)

    def closed() -> bool:
        while True:
            try:
                if not os.read(fd, 4096):
                    return True
            except OSError:
                return True

    if select.select([fd], [], [], 0)[0] and closed():  # nothing is ever written: readable = EOF
        exit_now()
    threading.Thread(target=lambda: closed() and exit_now(), name="tether-lifeline", daemon=True).start()


def remove_marks(folder: str) -> None:
    """Remove a folder of phase marks that a thread of this process may still be writing to: it is
    renamed first (atomic), so a mark written after that finds no folder and is dropped, where
    removing it in place could lose the race (a file written between the listing and the ``rmdir``
    leaves the folder behind)."""
    gone = f"{folder}.gone"
    try:
        os.rename(folder, gone)
    except OSError:
        return  # already removed
    shutil.rmtree(gone, ignore_errors=True)


def _exit_now(orphaned: str | None = None) -> None:
    """``os._exit(0)``, after unlinking the named semaphores this process made (a library's lock,
    such as the one tqdm makes for diffusers' loading bars): their clean-up is an exit handler that
    ``os._exit`` skips, and the resource tracker that unlinks them in its place warns the user of a
    leak. Nothing else of the exit handlers runs: another one could wait on the busy main thread.
    The clean-up tells the tracker through a lock the main thread may hold, so a timer ends the
    process after a second whatever it is doing: the lifeline's exit is never held up."""
    deadline = threading.Timer(1.0, os._exit, (0,))
    deadline.daemon = True
    deadline.start()
    try:
        if orphaned:
            remove_marks(orphaned)
        made = sys.modules.get("multiprocessing.synchronize")  # not imported: no semaphore made
        if made is not None:
            from multiprocessing import util

            for finalizer in list(util._finalizer_registry.values()):
                if finalizer._callback is made.SemLock._cleanup:  # an AttributeError still exits
                    with contextlib.suppress(Exception):  # one gone already, or internals that differ
                        finalizer()  # sem_unlink, then the tracker is told it is gone
    finally:
        os._exit(0)


@contextlib.contextmanager
def stop_signals_deferred():
    """Hold SIGINT and SIGTERM back for the ``with`` block (main thread only): a resource that
    must not leak — a shared-memory block between its creation and the attribute that owns it —
    is made whole before a stop signal's handler can raise. Python runs signal handlers in the
    main thread, so the block swaps in handlers that only note what arrived; as it ends, the
    previous handlers return and each noted signal is raised again, in order, for them. Wrap the
    owner's clean-up ``try`` around the ``with``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: arrived.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():  # None: a handler set outside Python
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for sig in arrived:
            signal.raise_signal(sig)


class Sealed:
    """An object pickled now and unpickled only by ``open()``. A child process's arguments are
    unpickled before its entry point runs, where an error (a recipe's plug-in that fails to import
    in that process) would end it with a bare traceback; sealed, they are opened inside the entry
    point, whose error handling reports the failure to the process that started it."""

    def __init__(self, obj: object) -> None:
        import pickle

        self.data = pickle.dumps(obj)

    def open(self):
        import pickle

        return pickle.loads(self.data)


def failure_traceback(exc: BaseException) -> str:
    """What a process's failure report carries besides its message, called in its ``except``: the
    traceback, except for a recipe's mistake (``ConfigError``: a plug-in that fails to import in a
    worker, a rank or an actor), whose message says it all."""
    import traceback

    from tether.errors import ConfigError

    return "" if isinstance(exc, ConfigError) else traceback.format_exc()


def oom_kills() -> int | None:
    """Processes the kernel's out-of-memory killer has ended since boot (``/proc/vmstat``);
    None where the kernel does not say."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return None


def killed(pid: int, folder: str | Path, kills_before: int | None) -> str:
    """What to add to "killed by SIGKILL" for process ``pid``: whether the out-of-memory killer
    ended a process meanwhile, and the learner phase ``pid`` had marked in ``folder``."""
    kills = oom_kills()
    oom = kills is not None and kills_before is not None and kills > kills_before
    where = explanation = ""
    with contextlib.suppress(OSError, ValueError):  # no mark, or an empty one: outside every phase
        where, explanation = Path(folder, str(pid)).read_text().split("\n", 1)
    if oom and where:
        return f"; the kernel's out-of-memory killer ended a process meanwhile, and {explanation}"
    if oom:
        return ("; the kernel's out-of-memory killer ended a process meanwhile (this one outside the "
                "learner's phases: loading, evaluating, or another process)")
    return f", in {where}" if where else ""
