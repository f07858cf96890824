"""Helpers for tests that start processes: is a pid still running, wait until it is not."""

import os
import time
from pathlib import Path


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


def _process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time) of every live, non-zombie process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, parent, *rest = f.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            continue
        if state not in ("Z", "X"):
            table[int(entry)] = (int(parent), int(rest[17]))
    return table


def environ(pid: int) -> list[bytes]:
    """The ``NAME=value`` entries /proc shows as ``pid``'s environment (none once it is gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def environ_value(pids, name: str) -> str | None:
    """The value of ``name`` in the environment of the first of ``pids`` that has it."""
    prefix = f"{name}=".encode()
    for pid in pids:
        for entry in environ(pid):
            if entry.startswith(prefix):
                return entry[len(prefix):].decode()
    return None


def marked(mark: str, seen: dict[int, int] | None = None) -> list[int]:
    """Pids of a run: those whose environment carries ``TETHER_TEST_RUN=<mark>`` (every process a
    run started inherits it, so this finds them even after a parent died and they were
    re-parented, which a walk down from the parent would miss), everything below them (a process
    may rewrite the memory /proc shows as its environment, as Ray's agents do with their titles),
    and, given ``seen`` (pid -> start time, updated here), whatever was found before and still is
    the same process."""
    needle = f"{MARK}={mark}".encode()
    table = _process_table()
    found = set()
    for pid, (_, started) in table.items():
        if seen is not None and seen.get(pid) == started:
            found.add(pid)
            continue
        if needle in environ(pid):
            found.add(pid)
    below = {}
    for pid, (parent, _) in table.items():
        below.setdefault(parent, []).append(pid)
    stack = list(found)
    while stack:
        for kid in below.get(stack.pop(), ()):
            if kid not in found:
                found.add(kid)
                stack.append(kid)
    if seen is not None:
        seen.update((pid, table[pid][1]) for pid in found)
    return sorted(found)


def kernel_name(pid: int) -> str:
    """The kernel's name for a process (``/proc/PID/comm``: what ``ps -o comm`` shows), "" once gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def describe(pids) -> str:
    """``pid [kernel name]: command line`` for each of ``pids``, for an assertion's message."""
    lines = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
            lines.append(f"{pid} [{kernel_name(pid)}]: {command[:200].rstrip()}")
        except OSError:
            lines.append(f"{pid}: (gone)")
    return "\n".join(lines)
