"""Host memory of a CPU learner: keep what the allocator frees for the next update.

A training update allocates and frees the same large tensors every time: a real vocabulary's
logits (151,936 columns × a few hundred tokens ≈ 150 MB), the tied embedding's gradient
(vocabulary × hidden: 545 MB at Qwen2-0.5B), every weight's gradient. glibc's allocator serves each
allocation above 32 MB with a fresh ``mmap`` and hands it back to the kernel when freed, so every
update faults all those pages in again, and the kernel zeroes each one. On this project's machines
a 0.5B update spent more time faulting pages than multiplying (a profile: 2.4 s to zero-fill one
545 MB gradient, 0.16 s to write a 35 MB weight gradient that takes 0.05 s once its pages exist).
A GPU's caching allocator never has this cost; on a CPU it is the allocator's setting.

``keep_freed_memory`` makes glibc keep freed memory in the process for reuse: no ``mmap`` for
large blocks (``M_MMAP_MAX`` 0), no trimming of the heap (``M_TRIM_THRESHOLD``), and one arena
shared by every thread (``M_ARENA_MAX`` 1; an arena per thread would keep a freed block where
another thread cannot reuse it). The ``tether`` command calls it first, before any thread starts,
and exports the same settings (``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_MAX_``,
``MALLOC_TRIM_THRESHOLD_``) to every process it starts: rollout workers, a local Ray instance and
its actors. The cost: a process's resident memory stays at its peak instead of shrinking between
updates (the peak itself moved by 3% at 0.5B in one process). Learner ranks (FSDP2) give large
blocks back again (``release_freed_memory``): their buffers fragment a heap that keeps everything.
``TETHER_MALLOC=system`` leaves the allocator as it is; a setting of the user's own (any of the
three variables already set) is kept. The Python API (``tether.train``) runs in the caller's
process and leaves its allocator alone: export the three variables before starting Python for the
same effect.

Only glibc (Linux) has these settings; elsewhere this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import platform

from tether.errors import ConfigError

__all__ = ["SWITCH", "keep_freed_memory", "release_freed_memory"]

SWITCH = "TETHER_MALLOC"
_CHOICES = ("reuse", "system")
# glibc's mallopt parameters (malloc.h) and the environment variables that set them at start-up
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_NEVER_TRIM = 1 << 40
_SETTINGS = ((_M_ARENA_MAX, "MALLOC_ARENA_MAX", 1), (_M_MMAP_MAX, "MALLOC_MMAP_MAX_", 0),
             (_M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", _NEVER_TRIM))
_KEPT = "TETHER_MALLOC_KEPT"  # set where keep_freed_memory applied its settings (not the user's own)
# glibc's defaults for what release_freed_memory puts back
_DEFAULT_MMAP_MAX, _DEFAULT_TRIM = 65536, 128 * 1024


def keep_freed_memory() -> bool:
    """Keep freed host memory in this process and the processes it starts (module docstring).
    Call it before any thread starts. Returns whether it changed anything."""
    choice = os.environ.get(SWITCH, "reuse")
    if choice not in _CHOICES:
        raise ConfigError(f"{SWITCH}={choice!r}: must be one of {', '.join(_CHOICES)} (reuse keeps freed "
                          "host memory for reuse, system leaves the C allocator as it is)")
    if choice == "system" or platform.libc_ver()[0] != "glibc":
        return False
    if any(name in os.environ for _, name, _ in _SETTINGS):
        return False  # the user's own allocator settings
    mallopt = ctypes.CDLL(None).mallopt
    for param, name, value in _SETTINGS:
        mallopt(param, value)
        os.environ[name] = str(value)
    os.environ[_KEPT] = "1"
    return True


def release_freed_memory() -> bool:
    """Give large freed blocks back to the kernel again in this process and those it starts, where
    ``keep_freed_memory`` (not the user) kept them: in a learner rank. FSDP2 gathers and scatters
    every unit's weights and gradients through buffers of many sizes, and kept in one heap they
    fragment it: at Qwen2-0.5B a rank's resident peak was 11.4 GB kept against 7.2 GB released,
    for the same 4–5 GB of live tensors (``benchmarks/rank_memory.py``). One arena stays (it is
    fixed once threads have started). Returns whether it changed anything."""
    if os.environ.pop(_KEPT, None) is None:
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
    mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM)
    os.environ.pop("MALLOC_MMAP_MAX_", None)
    os.environ.pop("MALLOC_TRIM_THRESHOLD_", None)
    return True
