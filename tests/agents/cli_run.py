"""Running ``tether`` as a user does, for the agent tests."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def tether(*args):
    """``tether ARGS`` in a child process from the repository root; it must succeed."""
    out = subprocess.run([sys.executable, "-m", "tether.cli.main", *map(str, args)], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return out
