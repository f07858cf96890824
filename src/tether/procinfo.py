"""Facts about the running process, and how it ends with the process that started it."""

from __future__ import annotations

import os
import select
import threading


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def exit_when_closed(fd: int) -> None:
    """End this process (``os._exit``) the moment ``fd`` — the read end of a pipe whose only write
    end another process holds — reaches end of file: that process closed it, exited or was
    killed. Checked at once first, so a process started after the other one already left does
    nothing more; then a daemon thread waits for it, even while the main thread is busy."""

    def closed() -> bool:
        while True:
            try:
                if not os.read(fd, 4096):
                    return True
            except OSError:
                return True

    if select.select([fd], [], [], 0)[0] and closed():  # nothing is ever written: readable = EOF
        os._exit(0)
    threading.Thread(target=lambda: closed() and os._exit(0), name="tether-lifeline", daemon=True).start()
