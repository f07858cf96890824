"""Stop signals: SIGINT (Ctrl-C) and SIGTERM (schedulers, ``docker stop``, ``kill``) stop a run
the same way.

The first signal asks the driver loop to stop at the next safe point: at once when it is only
waiting for generation, else after the step in progress (train, sync, eval, save), so the learner
is never saved mid-update; the loop then writes a final checkpoint and every worker is shut down.
Before the loop runs (while the model, the data and the workers are being set up) the first
signal stops at once. A second signal stops at once wherever the run is (no final checkpoint
unless it was already written). Further signals are ignored, so the shutdown itself completes.
The exit status is 128 + the first signal's number (130, 143), as for a process the signal
would have killed.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from tether.errors import StopRequested

log = logging.getLogger("tether.run")

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Installs the handlers for its ``with`` block (main thread only) and restores the old ones."""

    def __init__(self, *, repeat_window_s: float = 0.0) -> None:
        self.driver = None
        self.received: list[str] = []
        self._previous: dict[int, object] = {}
        self.repeat_window_s = repeat_window_s
        """A repeat of the last signal within this many seconds is the same stop delivered twice
        (under a supervisor that forwards what a whole process tree was sent), not a second one."""
        self._last_at = -1e9

    def attach(self, driver) -> None:
        """From now on the first signal stops ``driver`` at its next safe point."""
        self.driver = driver

    def detach(self) -> None:
        self.driver = None

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.received and name == self.received[-1] and now - self._last_at < self.repeat_window_s:
            return
        self._last_at = now
        self.received.append(name)
        first = self.received[0]
        if len(self.received) == 1:
            if self.driver is None:
                log.warning("%s: stopping", name)
                raise StopRequested(name)
            log.warning("%s: stopping at the next safe point (send it again to stop at once)", name)
            if self.driver.request_stop(name):
                raise StopRequested(name)
        elif len(self.received) == 2:
            log.warning("%s again: stopping at once", name)
            raise StopRequested(first)
        else:
            log.warning("%s: already stopping; shutting the workers down", name)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def reinstall(self) -> None:
        """Take the signals back from a library that installed its own handlers meanwhile (Ray's
        core worker installs one that dumps a stack and exits on SIGTERM)."""
        if self._previous:
            for sig in SIGNALS:
                signal.signal(sig, self._handle)

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
