"""A supervising parent for runs whose driver another system can end without a word.

Ray ends the process that drives it at once when its raylet dies (status 1, no message, no
Python code run), so that process cannot report it. For ``rollout.backend=ray`` ``tether train``
therefore runs the training in a child process and stays as its parent: it forwards SIGINT and
SIGTERM to the child (which runs in its own process group, so a terminal's Ctrl-C reaches it
once, through here), passes Tether's own exit statuses through, and turns any other end into an
error that says what happened and how to continue. The child dies with the parent: it watches a
pipe whose only write end the parent holds and exits when the pipe closes, so
``kill -9`` of ``tether train`` still ends the whole run (a local Ray instance goes with it, see
``tether.rollout.backends.ray.reaper``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD_ENV = "TETHER_SUPERVISED_FD"
OWN_STATUSES = (0, 2, 130, 143)  # success, a Tether error, stopped by SIGINT / SIGTERM


def supervised() -> bool:
    """True in the child a supervisor started (which then trains in place)."""
    return CHILD_ENV in os.environ


def die_with_supervisor() -> None:
    """In the child: exit when the supervisor's pipe closes (it exited or was killed); the
    child's own workers and Ray instance then go the same way, and so does the folder of phase
    marks the supervisor made for it."""
    from tether.procinfo import MARKS_ENV, exit_when_closed

    exit_when_closed(int(os.environ.pop(CHILD_ENV)), orphaned=os.environ.get(MARKS_ENV))


def supervise(argv: list[str], run_dir: Path) -> int:
    """Run ``tether ARGV`` (the ``train`` command line as given) in a child and return the status
    ``tether train`` should exit with."""
    from tether.procinfo import MARKS_ENV, killed, oom_kills

    read, write = os.pipe()
    marks = tempfile.mkdtemp(prefix="tether-phases-")  # where the child's learner marks its phase
    kills = oom_kills()
    env = {**os.environ, CHILD_ENV: str(read), MARKS_ENV: marks}
    child = subprocess.Popen([sys.executable, "-m", "tether.cli.main", *argv], env=env,
                             pass_fds=(read,), process_group=0)
    os.close(read)

    def forward(signum, frame) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = child.wait()
        cause = killed(child.pid, marks, kills) if code == -signal.SIGKILL else ""
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.close(write)
        shutil.rmtree(marks, ignore_errors=True)
    if code in OWN_STATUSES:
        return code
    from tether.runtime.rundir import where_to_resume

    how = (f"was killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals()
           else f"ended with status {code}")
    print(f"tether train: error: the run's process (pid {child.pid}) {how} without a Tether error{cause}. "
          "With rollout.backend=ray this is how Ray ends a driver whose raylet died (the node's Ray "
          f"processes were killed, or ran out of memory); Ray's logs are in {run_dir / 'ray'} for a local "
          f"instance. For this run, {where_to_resume(run_dir)}.", file=sys.stderr)
    return 2

