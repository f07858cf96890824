"""The rollout-batch FIFO: a bounded, thread-safe queue of whole batches in completion order.

Producers (a pool's collector threads) ``put`` complete batches; the driver ``get``s them. A
producer that fails calls ``report_error``: the first error is kept and every later ``get`` or
``put`` re-raises it with the original traceback, so an error in a worker reaches whoever waits
instead of leaving them blocked. ``close`` wakes every waiter; errors take precedence over
closed. Items are never split or merged here: atomicity is the producer's contract (a batch is
either complete or never put).
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from typing import Generic, TypeVar

from tether.errors import ConfigError, QueueClosedError, QueueTimeoutError, RolloutError

T = TypeVar("T")


class BatchQueue(Generic[T]):
    """Bounded FIFO with blocking get/put, timeouts, close, and first-error propagation."""

    def __init__(self, maxsize: int, *, name: str = "rollout-batches") -> None:
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize <= 0:
            raise ConfigError(f"maxsize must be a positive integer, got {maxsize!r}")
        self.maxsize = maxsize
        self.name = name
        self._items: deque[T] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        self._error_tb: str | None = None

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    # -- producer side ------------------------------------------------------------------------

    def put(self, item: T, timeout: float | None = None) -> None:
        """Append ``item``; block while full. ``timeout=None`` waits forever."""
        with self._cond:
            self._wait_until(lambda: len(self._items) < self.maxsize, timeout, "put")
            self._items.append(item)
            self._cond.notify_all()

    def report_error(self, exc: BaseException) -> None:
        """Record a producer's failure. Only the first error is kept; every waiter wakes."""
        with self._cond:
            if self._error is None:
                self._error = exc
                self._error_tb = "".join(traceback.format_exception(exc))
            self._cond.notify_all()

    def close(self) -> None:
        """Refuse further use and wake every waiter."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- consumer side ------------------------------------------------------------------------

    def get(self, timeout: float | None = None) -> T:
        """Pop the oldest item; block while empty. ``timeout=None`` waits forever."""
        with self._cond:
            self._wait_until(lambda: bool(self._items), timeout, "get")
            item = self._items.popleft()
            self._cond.notify_all()
            return item

    def drain(self) -> list[T]:
        """Pop every item present now, oldest first, without blocking."""
        with self._cond:
            self._raise_if_failed()
            items = list(self._items)
            self._items.clear()
            self._cond.notify_all()
            return items

    # -- internals ----------------------------------------------------------------------------

    def _raise_if_failed(self) -> None:
        exc = self._error
        if exc is not None:
            if isinstance(exc, RolloutError):
                raise exc
            raise RolloutError(
                f"{type(exc).__name__}: {exc}", remote_traceback=self._error_tb
            ) from exc

    def _wait_until(self, ready, timeout: float | None, op: str) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._raise_if_failed()
            if self._closed:
                raise QueueClosedError(f"{self.name} queue is closed ({op})")
            if ready():
                return
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise QueueTimeoutError(f"{self.name} queue: {op} timed out after {timeout:.3g}s")
            self._cond.wait(remaining)
