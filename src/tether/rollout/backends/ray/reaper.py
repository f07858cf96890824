"""A watchdog that takes a local Ray instance down with the run that started it.

Ray's processes (GCS, raylet, dashboard and runtime-env agents, actors) outlive a driver killed
with SIGKILL by up to a minute while they notice it is gone. ``Reaper`` marks every process the
instance starts with an environment variable and starts a small process of its own in a new
session that waits on a pipe whose only write end the run holds. When the pipe reaches end of
file (the run closed the instance, exited, or was killed) it kills every process still carrying
the mark. It never touches a cluster Tether only connected to. Ray starts its dashboard and
runtime-env agents from the raylet and then rewrites their process titles over the memory /proc
shows as their environment, so the mark cannot be read from them; while the run lives the reaper
therefore also remembers every descendant of a marked process (with its start time, so a reused
pid is never mistaken for one) and kills those too.

When the instance's temp dir sits under /tmp because the run directory's path is too long for
Ray's sockets (``cluster.ray_temp_dir``), the reaper then moves what the instance left there (its
logs) into the run's ``ray`` folder, which linked to it until then, and removes the /tmp folder:
after a run that was killed as after one that ended.

Run as ``python -m tether.rollout.backends.ray.reaper FD MARK [TEMP_DIR HOME]``.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

ENV = "TETHER_RAY_INSTANCE"
REMEMBER_EVERY_S = 0.5  # how often the living instance's process tree is read


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time in clock ticks since boot) of ``pid``, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[19])


def _has_mark(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in f.read().split(b"\0")
    except OSError:
        return False


def instance(mark: str, known: dict[int, int]) -> list[int]:
    """Live pids of the instance: those carrying ``TETHER_RAY_INSTANCE=<mark>``, their
    descendants, and those remembered in ``known`` (pid -> start time) that still are the process
    remembered. Adds what it finds to ``known``."""
    needle = f"{ENV}={mark}".encode()
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid() and (stat := _stat(int(entry))):
            stats[int(entry)] = stat
    live = {pid for pid, (state, _, _) in stats.items() if state not in ("Z", "X")}  # Z: dead, unreaped
    found = {pid for pid in live if known.get(pid) == stats[pid][2] or _has_mark(pid, needle)}
    children: dict[int, list[int]] = {}
    for pid, (_, parent, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    frontier = list(found)
    while frontier:
        kids = [k for p in frontier for k in children.get(p, ()) if k in live and k not in found]
        found.update(kids)
        frontier = kids
    known.update((pid, stats[pid][2]) for pid in found)
    return sorted(found)


def _not_copied(folder: str, names: list[str]) -> list[str]:
    """Sockets, links and anything else that is neither a plain file nor a folder."""
    paths = ((n, os.path.join(folder, n)) for n in names)
    return [n for n, p in paths if os.path.islink(p) or not (os.path.isfile(p) or os.path.isdir(p))]


def bring_home(temp_dir: str | Path, home: str | Path) -> bool:
    """Move what an ended instance left in ``temp_dir`` (its session folders: logs, events) into
    ``home``, the run's ``ray`` folder, replacing the link from ``home`` to ``temp_dir``; then
    remove ``temp_dir``. Sockets and links stay out; sessions an earlier attempt of the run brought
    home stay. On an error (a full disk) nothing is removed and the link still leads to the logs.
    Returns whether ``temp_dir`` is gone."""
    src, dst = Path(temp_dir), Path(home)
    if not src.is_dir():
        return True
    staging = dst.with_name(dst.name + ".partial")
    try:
        if dst.is_symlink() or not dst.exists():
            shutil.rmtree(staging, ignore_errors=True)
            shutil.copytree(src, staging, ignore=_not_copied)
            if dst.is_symlink():
                dst.unlink()
            staging.rename(dst)
        else:
            shutil.copytree(src, dst, ignore=_not_copied, dirs_exist_ok=True)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        return False
    shutil.rmtree(src, ignore_errors=True)
    return not src.exists()


class Reaper:
    """Use as: ``reaper = Reaper(); with reaper.marking(): ray.init(...)``; ``reaper.close()``
    once the instance is shut down (it then kills only what shutdown left behind, brings the
    instance's logs home when ``home`` = (temp dir, the run's ``ray`` link) is given, and returns
    once it has)."""

    WAIT_S = 60.0  # close() waits this long at most for the sweep and the move

    def __init__(self, home: tuple[str, Path] | None = None) -> None:
        self.mark = uuid.uuid4().hex
        self._write: int | None = None
        self._proc: subprocess.Popen | None = None
        if not os.path.isdir("/proc"):
            return  # no way to find the processes; Ray's own fate sharing applies
        read, self._write = os.pipe()  # not inherited by anything the run starts
        extra = [str(home[0]), str(home[1])] if home is not None else []
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tether.rollout.backends.ray.reaper", str(read), self.mark, *extra],
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
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=self.WAIT_S)  # past it, the reaper finishes on its own
            self._proc = None


def main(argv: list[str]) -> int:
    read, mark = int(argv[0]), argv[1]
    home = argv[2:4] if len(argv) >= 4 else None
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    known: dict[int, int] = {}
    while True:  # nothing is ever written: readable means end of file
        if select.select([read], [], [], REMEMBER_EVERY_S)[0] and not os.read(read, 1):
            break
        instance(mark, known)
    # a process may start another while the first are being killed (a raylet prestarting a
    # worker): sweep until two sweeps in a row find nothing, for at most 10 s
    quiet, deadline = 0, time.monotonic() + 10
    while quiet < 2 and time.monotonic() < deadline:
        pids = instance(mark, known)
        quiet = 0 if pids else quiet + 1
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    if home is not None:
        bring_home(*home)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
