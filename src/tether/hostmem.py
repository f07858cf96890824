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
``MALLOC_TRIM_THRESHOLD_``) to every process it starts: rollout workers, learner ranks, a local
Ray instance and its actors. The cost: a process's resident memory stays at its peak instead of
shrinking between updates (the peak itself moved by 3% at 0.5B). ``TETHER_MALLOC=system`` leaves
the allocator as it is; a setting of the user's own (any of the three variables already set) is
kept. The Python API (``tether.train``) runs in the caller's process and leaves its allocator
alone: export the three variables before starting Python for the same effect.

Only glibc (Linux) has these settings; elsewhere this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import platform

from tether.errors import ConfigError

__all__ = ["SWITCH", "keep_freed_memory"]

SWITCH = "TETHER_MALLOC"
_CHOICES = ("reuse", "system")
# glibc's mallopt parameters (malloc.h) and the environment variables that set them at start-up
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_NEVER_TRIM = 1 << 40
_SETTINGS = ((_M_ARENA_MAX, "MALLOC_ARENA_MAX", 1), (_M_MMAP_MAX, "MALLOC_MMAP_MAX_", 0),
             (_M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", _NEVER_TRIM))


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
    return True
