"""Helpers for tests that start processes: is a pid still running, wait until it is not."""

import os
import time


def running(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids, timeout: float = 15.0) -> list[int]:
    """Wait until none of ``pids`` runs; return those still running at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if running(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in pids if running(p)]


def children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, …): a run's process tree."""
    out, frontier = [], [pid]
    while frontier:
        kids = [c for p in frontier for c in children(p)]
        out += kids
        frontier = kids
    return out


def shm_segments(pids) -> set[str]:
    """Names of the /dev/shm segments that any of ``pids`` has mapped."""
    names = set()
    for p in pids:
        try:
            with open(f"/proc/{p}/maps") as f:
                text = f.read()
        except OSError:
            continue
        for line in text.splitlines():
            if "/dev/shm/" in line:
                names.add(line.split("/dev/shm/", 1)[1].split()[0])
    return names


def shm_left(names, timeout: float = 15.0) -> list[str]:
    """Those of ``names`` still in /dev/shm after waiting up to ``timeout`` seconds (a killed
    run's resource tracker unlinks them once the run's last process is gone)."""
    deadline = time.monotonic() + timeout
    while True:
        left = [n for n in names if os.path.exists(f"/dev/shm/{n}")]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


MARK = "TETHER_TEST_RUN"


def marked(mark: str) -> list[int]:
    """Pids whose environment carries ``TETHER_TEST_RUN=<mark>``: every process a run started
    inherits it, so this finds the run's whole tree even after a parent died and its children
    were re-parented (which a walk down from the parent would miss)."""
    needle = f"{MARK}={mark}".encode()
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                continue
            if needle in env.split(b"\0") and running(int(entry)):
                out.append(int(entry))
    return out
