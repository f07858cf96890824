"""What starting a run's child processes and leaving ``tether train`` cost, side by side in one run.

1. A child that is ready to build a model (torch, transformers' modeling and Tether's worker and
   rank modules imported, as a rollout worker or learner rank needs): started as a fresh interpreter
   (``spawn``), against forked from the shared fork server (``tether.procinfo.child_context``),
   whose first child also waits for the server to import them once.
2. The end of a process that imported them: the interpreter's normal teardown against leaving as
   the ``tether`` console script does (exit handlers, then ``os._exit``).

    .venv/bin/python benchmarks/startup.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import time

MODULES = ("transformers.models.qwen3.modeling_qwen3",)  # the demo model's own module


def _ready(conn) -> None:
    import importlib

    from tether.procinfo import CHILD_PRELOAD

    for name in (*CHILD_PRELOAD, *MODULES):
        importlib.import_module(name)
    conn.send(time.perf_counter())
    conn.close()


def start_s(ctx, start) -> float:
    """Seconds from asking for the child to the child holding every module it needs."""
    ours, theirs = ctx.Pipe(duplex=False)
    t0 = time.perf_counter()
    proc = start(ctx, theirs)
    theirs.close()
    ready = ours.recv()
    proc.join(60)
    return ready - t0


def spawned(ctx, conn):
    proc = ctx.Process(target=_ready, args=(conn,), daemon=True)
    proc.start()
    return proc


def forked(ctx, conn):
    from tether.procinfo import start_child

    return start_child(ctx, _ready, (conn,), name="tether-bench")


END = ("import torch, transformers.modeling_utils\n"
       "from transformers.models.qwen3 import modeling_qwen3\n"
       "import sys, time\nprint(time.time(), flush=True)\n")


def exit_s(fast: bool) -> float:
    """Seconds from the last line of a process that imported the modules to its end."""
    code = END + ("import os, atexit\natexit._run_exitfuncs()\nos._exit(0)\n" if fast else "")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    end = time.time()
    return end - float(proc.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from tether.procinfo import child_context

    spawn = [start_s(mp.get_context("spawn"), spawned) for _ in range(args.repeats)]
    ctx = child_context()
    first = start_s(ctx, forked)
    later = [start_s(ctx, forked) for _ in range(args.repeats)]
    teardown = [exit_s(fast=False) for _ in range(args.repeats)]
    fast = [exit_s(fast=True) for _ in range(args.repeats)]
    out = {
        "child_ready_s": {"spawn": round(statistics.median(spawn), 3),
                          "fork_server_first": round(first, 3),
                          "fork_server_later": round(statistics.median(later), 3)},
        "spawn_over_fork_server_later": round(statistics.median(spawn) / statistics.median(later), 1),
        "exit_s": {"interpreter_teardown": round(statistics.median(teardown), 3),
                   "exit_handlers_then_os_exit": round(statistics.median(fast), 3)},
        "repeats": args.repeats,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
