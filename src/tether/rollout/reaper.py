"""A watchdog that takes a local Ray instance down with the run that started it.

Ray's processes (GCS, raylet, dashboard and runtime-env agents, actors) outlive a driver killed
with SIGKILL by up to a minute while they notice it is gone. ``Reaper`` marks every process the
instance starts with an environment variable and starts a small process of its own in a new
session that waits on a pipe whose only write end the run holds. When the pipe reaches end of
file (the run closed the instance, exited, or was killed) it kills every process still carrying
the mark. It never touches a cluster Tether only connected to. Ray's dashboard and runtime-env
agents do not always carry the mark (their environment as /proc shows it sometimes lacks it), so
they can escape and linger until they notice the raylet is gone.

Run as ``python -m tether.rollout.reaper FD MARK``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid

ENV = "TETHER_RAY_INSTANCE"


def marked(mark: str) -> list[int]:
    """Pids of processes whose environment holds ``TETHER_RAY_INSTANCE=<mark>``."""
    needle = f"{ENV}={mark}".encode()
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle not in f.read().split(b"\0"):
                        continue
                with open(f"/proc/{entry}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):  # dead, not yet reaped
                        continue
            except (OSError, IndexError):
                continue
            out.append(int(entry))
    return out


class Reaper:
    """Use as: ``reaper = Reaper(); with reaper.marking(): ray.init(...)``; ``reaper.close()``
    once the instance is shut down (it then kills only what shutdown left behind)."""

    def __init__(self) -> None:
        self.mark = uuid.uuid4().hex
        self._write: int | None = None
        if not os.path.isdir("/proc"):
            return  # no way to find the processes; Ray's own fate sharing applies
        read, self._write = os.pipe()  # not inherited by anything the run starts
        subprocess.Popen([sys.executable, "-m", "tether.rollout.reaper", str(read), self.mark],
                         pass_fds=(read,), start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(read)

    def marking(self):
        """While in this block, processes started from here carry the mark."""

        @contextlib.contextmanager
        def block():
            os.environ[ENV] = self.mark
            try:
                yield
            finally:
                os.environ.pop(ENV, None)

        return block()

    def close(self) -> None:
        if self._write is not None:
            os.close(self._write)
            self._write = None


def main(argv: list[str]) -> int:
    read, mark = int(argv[0]), argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while os.read(read, 1):
        pass
    # a process may start another while the first are being killed (a raylet prestarting a
    # worker): sweep until two sweeps in a row find nothing, for at most 10 s
    quiet, deadline = 0, time.monotonic() + 10
    while quiet < 2 and time.monotonic() < deadline:
        pids = marked(mark)
        quiet = 0 if pids else quiet + 1
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
