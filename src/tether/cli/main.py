"""The ``tether`` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence

from tether import __version__
from tether.cli import config_cmd, data_cmds, env_cmd, eval_cmd, export_cmd, plan, sweep, train_cmd
from tether.errors import TetherError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tether",
        description="Asynchronous RL post-training with a staleness budget in rollout batches.",
    )
    parser.add_argument("--version", action="version", version=f"tether {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train_cmd.add_parser(sub)
    train_cmd.add_report_parser(sub)
    train_cmd.add_compare_parser(sub)
    eval_cmd.add_parser(sub)
    export_cmd.add_parser(sub)
    plan.add_parser(sub)
    sweep.add_parser(sub)
    config_cmd.add_parser(sub)
    data_cmds.add_parsers(sub)
    env_cmd.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    # `tether train recipe.yaml --run-dir X key=value`: overrides after a flag are still overrides
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(ns, "args")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        ns.args = [*ns.args, *extra]
    ns.argv = list(sys.argv[1:] if argv is None else argv)  # as given, for a supervised child
    if not getattr(ns, "func", None):
        parser.print_help()
        return 2
    try:
        return ns.func(ns)
    except TetherError as exc:
        print(f"tether {ns.command}: error: {exc}", file=sys.stderr)
        for note in getattr(exc, "__notes__", ()):  # what to do next, added where it is known
            print(f"tether {ns.command}: {note}", file=sys.stderr)
        return 2


def console() -> None:
    """The ``tether`` console script: ``main``, then out of the process without the interpreter's
    teardown, which frees every module's objects one by one (about 2 s of CPU once torch and
    transformers' modeling are imported, after a run has long finished). What a normal exit does
    that matters runs first, in its order: other threads are waited for (``threading._shutdown``,
    as the interpreter's exit does, waking idle thread-pool workers first), the exit handlers run
    (logging's flush, multiprocessing's and tempfile's clean-up), and the standard streams are
    flushed. An exception other than a Tether error takes the normal way out, with its traceback."""
    code = main() or 0  # a command that returns nothing succeeded, as sys.exit(None) says
    import atexit
    import os
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream: nothing can reach it
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    console()
