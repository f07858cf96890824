"""Where environment calls run: ``EnvThreads``, daemon threads beside the generation path (or inline,
for the baseline), and ``is_stop``, what in a call's exception stops the run rather than failing
its episode. ``episodes.Player`` submits every environment call (construction, ``reset``,
``step``) here and waits on the futures with its own deadlines."""

from __future__ import annotations

import queue
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


def is_stop(exc: BaseException, *, inline: bool = False) -> bool:
    """``exc`` stops the run rather than failing an episode: the run's own ``StopRequested``, or,
    for a call run ``inline`` in the main thread while SIGINT has Python's default handler, a
    ``KeyboardInterrupt`` that may be a real Ctrl-C. A ``KeyboardInterrupt`` raised on an
    environment thread (signals reach only the main thread) or where SIGINT is handled otherwise
    (a rollout worker ignores it; a run raises ``StopRequested``) is the environment's own."""
    from tether.errors import StopRequested

    if isinstance(exc, StopRequested):
        return True
    return (inline and isinstance(exc, KeyboardInterrupt)
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler)


class EnvThreads:
    """``workers`` daemon threads running environment calls; 0 runs each call inline, in the
    caller (the baseline ``benchmarks/agent.py`` compares against; no timeout can apply)."""

    JOIN_S = 1.0
    """How long ``close`` waits for the threads to end (a hung call's thread is left to the exit)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.abandoned = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        for _ in range(workers):
            self._start()

    def _start(self) -> None:
        thread = threading.Thread(target=self._work, name="tether-env", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)

    def submit(self, fn: Callable[[], Any]) -> Future:
        """The call's future; whatever it raises (``SystemExit`` and ``KeyboardInterrupt``
        included) is its result, except a stop of the run (``is_stop``)."""
        future: Future = Future()
        if self.workers == 0:
            future.set_running_or_notify_cancel()
            try:
                future.set_result(fn())
            except BaseException as exc:
                if is_stop(exc, inline=True):
                    raise
                future.set_exception(exc)
        else:
            self._queue.put((future, fn))
        return future

    def abandon(self) -> None:
        """A call overran: leave its thread to finish or hang, and start another in its place."""
        self.abandoned += 1
        if self.workers:
            self._start()

    def close(self) -> None:
        """Stop the threads and wait a little for them to end, so none is still unwinding when the
        process exits; a thread held by an abandoned call is not waited for beyond ``JOIN_S``."""
        for _ in range(self.workers):
            self._queue.put(None)
        deadline = time.monotonic() + self.JOIN_S
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


__all__ = ["EnvThreads", "is_stop"]
