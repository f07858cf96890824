"""The ``tether`` command keeps freed host memory for reuse (tether.hostmem): a freed block stays
in the process, the settings reach the processes it starts, and ``TETHER_MALLOC`` opts out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator settings")

_PROBE = r"""
import os, subprocess, sys
from tether.hostmem import keep_freed_memory
applied = keep_freed_memory()
import torch

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before = rss()
block = torch.ones(32 * 2**20)  # 128 MB, above glibc's largest mmap threshold
block = None
kept = rss() - before
child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('MALLOC_MMAP_MAX_'))"],
                       capture_output=True, text=True).stdout.strip()
print(applied, kept // 2**20, child)
"""

_OWN = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "TETHER_MALLOC")


def _probe(**env: str) -> tuple[str, int, str]:
    clean = {k: v for k, v in os.environ.items() if k not in _OWN}
    out = subprocess.run([sys.executable, "-c", _PROBE], env={**clean, **env}, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    return out[0], int(out[1]), out[2]


@pytest.mark.timeout(240)
def test_a_freed_block_stays_for_reuse_and_the_settings_reach_child_processes():
    applied, kept_mb, child = _probe()
    assert applied == "True" and child == "0"
    assert kept_mb >= 100, f"freed 128 MB but the process kept {kept_mb} MB"


@pytest.mark.timeout(240)
def test_system_leaves_the_allocator_alone():
    applied, kept_mb, child = _probe(TETHER_MALLOC="system")
    assert applied == "False" and child == "None"
    assert kept_mb < 64, f"the system allocator kept {kept_mb} MB of a freed 128 MB block"


@pytest.mark.timeout(240)
def test_the_users_own_allocator_settings_are_kept():
    applied, _, child = _probe(MALLOC_MMAP_MAX_="7")
    assert applied == "False" and child == "7"


@pytest.mark.timeout(120)
def test_a_bad_switch_is_refused_by_the_command_naming_it():
    tether = Path(sys.executable).with_name("tether")
    proc = subprocess.run([str(tether), "config", "show"], env={**os.environ, "TETHER_MALLOC": "fast"},
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2
    assert "TETHER_MALLOC='fast'" in proc.stderr and "reuse" in proc.stderr and "system" in proc.stderr


_RANK_PROBE = r"""
import os, subprocess, sys
from tether import hostmem
hostmem.keep_freed_memory()
released = hostmem.release_freed_memory()
import torch

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before = rss()
block = torch.ones(32 * 2**20)
block = None
kept = rss() - before
child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('MALLOC_MMAP_MAX_'))"],
                       capture_output=True, text=True).stdout.strip()
print(released, kept // 2**20, child)
"""


@pytest.mark.timeout(240)
def test_a_learner_rank_gives_large_freed_blocks_back():
    clean = {k: v for k, v in os.environ.items() if k not in _OWN}
    out = subprocess.run([sys.executable, "-c", _RANK_PROBE], env=clean, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out[0] == "True" and out[2] == "None"
    assert int(out[1]) < 64, f"a rank kept {out[1]} MB of a freed 128 MB block"
    # the user's own settings are theirs: nothing to release
    mine = subprocess.run([sys.executable, "-c", _RANK_PROBE], env={**clean, "MALLOC_MMAP_MAX_": "0"},
                          capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert mine[0] == "False" and mine[2] == "0"
