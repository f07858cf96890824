"""``tether train``: the main job."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from tether.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a model with asynchronous GRPO-family RL under a staleness budget",
        description="Train from a recipe: generation and training overlap under async.max_staleness "
        "(0 = synchronous). Writes a run directory with config.yaml, metrics.jsonl, eval.jsonl, "
        "TensorBoard events, checkpoints, summary.json and plots.",
    )
    p.add_argument("args", nargs="*", metavar="RECIPE|KEY=VALUE",
                   help="a YAML recipe, then section.key=value overrides (with --resume: overrides only)")
    p.add_argument("--run-dir", help="where to write the run (default: runs/<recipe>-<time>)")
    p.add_argument("--resume", metavar="RUN", help="continue the run in RUN from its newest good checkpoint")
    p.add_argument("--force", action="store_true",
                   help="with --resume: accept overrides (or changed data) that change the run, "
                   "such as run.seed or rollout.batch_size; they are recorded in starts.jsonl")
    p.add_argument("--plain", action="store_true", help="plain progress lines even on a terminal")
    p.add_argument("--no-report", action="store_true", help="skip writing the plots at the end")
    p.set_defaults(func=run)


def _logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("tether: %(message)s"))
    root = logging.getLogger("tether")
    if not root.handlers:
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def resolve(ns: argparse.Namespace):
    """(config, run directory, overrides) from the command line."""
    from tether.cli.plan import split_recipe_args
    from tether.config import load_config, load_resumed
    from tether.paths import check_folder_to_write

    if ns.force and not ns.resume:
        raise ConfigError("--force only applies with --resume RUN")
    if ns.resume:
        run_dir = Path(ns.resume)
        if ns.run_dir and Path(ns.run_dir) != run_dir:
            raise ConfigError("--resume RUN continues RUN in place; drop --run-dir")
        overrides = list(ns.args)
        if overrides and "=" not in overrides[0]:
            raise ConfigError(f"with --resume the recipe is {run_dir / 'config.yaml'}; give only "
                              f"key=value overrides, not {overrides[0]!r}")
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
        cfg, dropped = load_resumed(run_dir / "config.yaml", overrides)
        for key in dropped:
            logging.getLogger("tether").info("resume drops %s", key)
        return cfg, run_dir, overrides
    if ns.run_dir is not None:  # before the recipe loads: "" would otherwise mean the default
        check_folder_to_write(ns.run_dir, "--run-dir")
    recipe, overrides = split_recipe_args(ns.args)
    cfg = load_config(recipe, overrides)
    stem = Path(recipe).stem if recipe else "train"
    run_dir = Path(ns.run_dir) if ns.run_dir else Path("runs") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    return cfg, run_dir, overrides


def run(ns: argparse.Namespace) -> int:
    from tether.runtime import supervise

    cfg, run_dir, overrides = resolve(ns)
    if supervise.supervised():
        supervise.die_with_supervisor()
    elif cfg_backend_supervised(cfg) and ns.argv is not None:
        # Ray can end its driver without a word (a dead raylet): train in a child, report here
        argv = list(ns.argv)
        if not ns.resume and not ns.run_dir:
            argv += ["--run-dir", str(run_dir)]  # the child must not pick another timestamp
        return supervise.supervise(argv, run_dir)
    _logging()
    from tether.errors import NothingLearnedError, RunBusyError, StopRequested, TetherError
    from tether.runtime.run import train
    from tether.runtime.rundir import where_to_resume

    try:
        summary = train(cfg, run_dir, resume=bool(ns.resume), force=ns.force, overrides=overrides,
                        progress_plain=True if ns.plain else None)
    except KeyboardInterrupt as exc:
        stopped = exc if isinstance(exc, StopRequested) else StopRequested("SIGINT")
        print(f"tether train: stopped by {stopped.signal_name}; {where_to_resume(run_dir)}", file=sys.stderr)
        return stopped.exit_code
    except NothingLearnedError:
        _report(ns, run_dir)  # the run is complete: its plots show why
        raise
    except TetherError as exc:
        if not isinstance(exc, ConfigError | RunBusyError):  # a run that failed while running
            exc.add_note(where_to_resume(run_dir))
        raise
    _report(ns, run_dir)
    first, last = summary["eval_pass_at_1_first"], summary["eval_pass_at_1_last"]
    print(f"trained {summary['trained_batches']} batches in {summary['wall_s']:.0f}s "
          f"({summary['samples_per_s']:.0f} samples/s); max staleness "
          f"{summary['staleness_batches_max']:g} batches")
    numeric, overall = summary.get("numeric_logprob_abs_diff_max"), summary.get("logprob_abs_diff_max")
    if overall is not None:
        print(f"engine vs trainer log-probs: max |Δ| {overall:.3g} over all tokens (staleness included)"
              + (f", {numeric:.2g} on tokens sampled with the trained weights (numerics)"
                 if numeric is not None else ""))
    if first is not None:
        print(f"held-out pass@1: {first:.1%} → {last:.1%} ({(last - first) * 100:+.1f} points)")
        first_k, last_k = summary["evals"][0], summary["evals"][-1]
        if "eval/pass_at_k" in first_k and first_k.get("eval/num_samples") == last_k.get("eval/num_samples"):
            print(f"held-out pass@{int(last_k['eval/num_samples'])} (sampled): "
                  f"{first_k['eval/pass_at_k']:.1%} → {last_k['eval/pass_at_k']:.1%}")
    print(f"run directory: {run_dir}")
    return 0


def _report(ns: argparse.Namespace, run_dir: Path) -> None:
    if not ns.no_report:
        from tether.runtime.report import write_report

        plots = write_report(run_dir)
        print(f"plots: {', '.join(str(p) for p in plots)}")


def cfg_backend_supervised(cfg) -> bool:
    """Whether the recipe's rollout backend trains in a supervised child (``BackendPlugin``)."""
    from tether import registry

    return registry.backends.get(cfg.rollout.backend).supervised


def add_report_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="write PNG plots of a run (reward, eval, staleness, ratios, timeline, "
                       "the in-run staleness study, image grids of flow runs)")
    p.add_argument("run", help="a run directory")
    p.add_argument("--study-low", type=float, metavar="S",
                   help="with --study-high: compare batches at most S batches stale against those at "
                        "least --study-high stale, the middle left out (the seed compared 2 with 7); "
                        "default: the median")
    p.add_argument("--study-high", type=float, metavar="S")
    p.set_defaults(func=report)


def report(ns: argparse.Namespace) -> int:
    from tether.runtime.report import write_report

    for path in write_report(Path(ns.run), study_low=ns.study_low, study_high=ns.study_high):
        print(path)
    import json

    from tether.runtime.study import summary_lines

    study = Path(ns.run) / "plots" / "study.json"
    for line in summary_lines(json.loads(study.read_text())):
        print(line)
    from tether.cli.plan import closed_form_lines
    from tether.runtime.report import staleness_forms

    lengths = Path(ns.run) / "plots" / "lengths.json"
    if lengths.is_file():
        from tether.runtime.lengths import summary_lines as length_lines

        for line in length_lines(json.loads(lengths.read_text())):
            print(line)
    forms = staleness_forms(Path(ns.run))
    if forms is not None:
        for line in closed_form_lines(forms["closed_form"], forms["simulated_batches"],
                                      forms["measured_batches"]):
            print(line)
    return 0


FIGURE_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")
"""What ``tether compare --out`` may end in: formats matplotlib writes without extra packages."""


def add_compare_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="several runs side by side: a table and compare.png",
                       description="Compare runs (e.g. synchronous against asynchronous): held-out "
                       "pass@1 against wall time and batches, training reward and samples trained "
                       "against wall time, in one PNG; and a table of throughput, staleness and accuracy.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="two or more run directories")
    p.add_argument("--out", default="compare.png",
                   help="where to write the figure: .png, .pdf, .svg or .jpg (default: compare.png)")
    p.set_defaults(func=compare)


def compare(ns: argparse.Namespace) -> int:
    from tether.paths import check_file_to_write
    from tether.runtime.compare import format_table, write_comparison

    check_file_to_write(ns.out, "--out", FIGURE_SUFFIXES)
    path, rows, notes = write_comparison([Path(r) for r in ns.runs], Path(ns.out))
    for note in notes:
        print(f"tether compare: {note}", file=sys.stderr)
    print(format_table(rows))
    print(f"figure: {path}")
    return 0
