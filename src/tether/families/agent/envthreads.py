"""Where environment calls run: ``EnvThreads`` gives each episode a ``Lane``, one thread and (for
an async environment) one event loop for the episode's whole life, so its construction, ``reset``,
every ``step`` and ``close`` run on the same thread and loop: a client, lock, subprocess or sqlite
connection opened in ``reset`` works in ``step``. ``workers`` bounds the calls that run at once (a
slot is taken when a call starts and given back when it returns, also after its deadline passed),
and a call's ``started`` time is when it took its slot, so time spent waiting for one is never
counted against it. ``is_stop`` says what in a call's exception stops the run rather than failing
its episode. ``episodes.Player`` submits every environment call to its episode's lane and waits on
the calls with its own deadlines."""

from __future__ import annotations

import asyncio
import inspect
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


class _Current(threading.local):
    lane: Lane | None = None
    """The lane whose call this thread is running, if any."""


_current = _Current()
"""The lane whose call this thread is running (``awaited`` runs coroutines on its loop)."""


def awaited(value: Any) -> Any:
    """``value``, awaited when it is awaitable: on the event loop of the episode whose call is
    running (made at its first awaitable and kept until the episode ends), or, outside any
    episode's call, on a loop of its own."""
    if not inspect.isawaitable(value):
        return value
    lane = _current.lane
    if lane is None:
        return asyncio.run(_await(value))
    if lane.loop is None:
        lane.loop = asyncio.new_event_loop()
    return lane.loop.run_until_complete(_await(value))


async def _await(value: Any) -> Any:
    return await value


class Call(Future):
    """One environment call's future, with when it took a slot (``started``) and returned
    (``ended``), both ``time.monotonic()``; None until then."""

    def __init__(self) -> None:
        super().__init__()
        self.started: float | None = None
        self.ended: float | None = None
        self.abandoned = False
        self.overran = False
        """Abandoned while it ran: it holds a slot past its deadline (``EnvThreads.jammed_since``)."""


class Lane:
    """One episode's thread (started with its first call; none with ``workers=0``, whose calls run
    inline in the caller) and its event loop, which runs that episode's calls in order."""

    def __init__(self, threads: EnvThreads) -> None:
        self.threads = threads
        self.loop: asyncio.AbstractEventLoop | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, fn: Callable[[], Any]) -> Call:
        """The call's future; whatever ``fn`` raises (``SystemExit`` and ``KeyboardInterrupt``
        included) is its result, except a stop of the run (``is_stop``)."""
        call = Call()
        if self.threads.workers == 0:
            call.set_running_or_notify_cancel()
            self._run(call, fn, inline=True)
            return call
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="tether-env", daemon=True)
            self.threads._started(self._thread)
            self._thread.start()
        self._queue.put((call, fn))
        return call

    def close(self) -> None:
        """End the lane once the calls submitted have run (its loop closed on its own thread)."""
        if self._closed:
            return
        self._closed = True
        if self._thread is None:
            self._close_loop()
        else:
            self._queue.put(None)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            call, fn = item
            if self.threads._take(call):
                try:
                    self._run(call, fn)
                finally:
                    self.threads._returned(call)
        self._close_loop()

    def _run(self, call: Call, fn: Callable[[], Any], *, inline: bool = False) -> None:
        before = _current.lane
        _current.lane = self
        call.started = time.monotonic()
        try:
            result = fn()
        except BaseException as exc:
            call.ended = time.monotonic()
            if inline and is_stop(exc, inline=True):
                raise
            call.set_exception(exc)
        else:
            call.ended = time.monotonic()
            call.set_result(result)
        finally:
            _current.lane = before

    def _close_loop(self) -> None:
        loop, self.loop = self.loop, None
        if loop is None:
            return
        try:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        except Exception:  # a task that will not end quietly is the environment's; the lane ends all the same
            pass
        finally:
            loop.close()


class EnvThreads:
    """The lanes of a worker's episodes and the ``workers`` slots their calls share; 0 runs each
    call inline, in the caller (the baseline ``benchmarks/agent.py`` compares against; no timeout
    can apply)."""

    JOIN_S = 1.0
    """How long ``close`` waits for the threads to end (a hung call's thread is left to the exit)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.abandoned = 0
        """Calls that ran past their deadline, since the start."""
        self.jammed_since: float | None = None
        """When every slot came to be held by a call past its deadline (None while one is free or
        held by a call in time): calls waiting for a slot then have their deadlines counted from
        this moment, so a hung environment fails episodes rather than hanging the batch."""
        self._slots = threading.BoundedSemaphore(max(workers, 1))
        self._lock = threading.Lock()
        self._overrun = 0  # abandoned calls still running, each holding a slot
        self._threads: list[threading.Thread] = []

    def lane(self) -> Lane:
        """A new episode's lane."""
        return Lane(self)

    def abandon(self, call: Call) -> None:
        """``call`` ran past its deadline: its episode has ended without it. It keeps its slot
        until it returns (``workers`` stays a bound on what runs at once)."""
        with self._lock:
            self.abandoned += 1
            call.abandoned = True
            if call.started is not None and call.ended is None:
                call.overran = True
                self._overrun += 1
                if self.workers and self._overrun >= self.workers and self.jammed_since is None:
                    self.jammed_since = time.monotonic()

    def _take(self, call: Call) -> bool:
        """Wait for a slot for ``call``; False (no slot held) if it was given up meanwhile."""
        if call.cancelled():  # given up while it waited (every slot held past its deadline)
            return False
        self._slots.acquire()
        if call.set_running_or_notify_cancel():
            return True
        self._slots.release()
        return False

    def _returned(self, call: Call) -> None:
        with self._lock:
            if call.overran:
                self._overrun -= 1
                if self._overrun < self.workers:
                    self.jammed_since = None
        self._slots.release()

    def _started(self, thread: threading.Thread) -> None:
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)

    def close(self) -> None:
        """Wait a little for the lanes' threads to end (each lane was closed by its player), so
        none is still unwinding when the process exits; a thread held by an abandoned call is not
        waited for beyond ``JOIN_S``."""
        deadline = time.monotonic() + self.JOIN_S
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))


__all__ = ["Call", "EnvThreads", "Lane", "awaited", "is_stop"]
