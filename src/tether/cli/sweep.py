"""``tether sweep``: a recipe over a grid of key values and seeds (``tether.runtime.sweep``)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sweep", help="train a recipe over a grid of key values and seeds, resumable, and plot held-out "
        "reward against the values",
        description="Train RECIPE once per combination of the --set values and per seed, one run after "
        "another (each its own `tether train`), then write OUT/sweep.json and OUT/sweep.png (held-out "
        "reward and samples/s against the values, mean and spread over seeds). Run the same command "
        "again to go on: finished runs are kept, stopped ones resume from their last checkpoint.")
    p.add_argument("args", nargs="*", metavar="RECIPE|KEY=VALUE",
                   help="an optional YAML recipe, then section.key=value overrides for every run")
    p.add_argument("--set", action="append", default=[], metavar="KEY=V1,V2,...", dest="sets",
                   help="a key and its values to sweep (repeat for more keys: their product is the grid)")
    p.add_argument("--seeds", type=int, default=1, help="runs per grid point, seeds run.seed + 0 … N−1")
    p.add_argument("--out", default=None, help="where the runs go (default: runs/sweep-<recipe>)")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from tether.cli.plan import split_recipe_args
    from tether.config import load_config
    from tether.errors import ConfigError
    from tether.paths import check_folder_to_write
    from tether.runtime.sweep import parse_grid, run_sweep

    if ns.seeds < 1:
        raise ConfigError(f"--seeds must be 1 or more, got {ns.seeds}")
    recipe, overrides = split_recipe_args(ns.args)
    grid = parse_grid(ns.sets)
    base = load_config(recipe, overrides).run.seed
    stem = Path(recipe).stem if recipe else "train"
    given = ns.out if ns.out is not None else Path("runs") / f"sweep-{stem}"
    check_folder_to_write(given, "--out")  # as given: an empty --out is refused, not read as "."
    out = Path(given)
    rows = run_sweep(recipe, overrides, grid, [base + i for i in range(ns.seeds)], out)
    done = [r for r in rows if r["held_out"] is not None]
    for r in done:
        values = ", ".join(f"{k}={v}" for k, v in r["values"].items())
        print(f"{values} seed {r['seed']}: {r['held_out_key']} {r['held_out']:.3f}, "
              f"{r['samples_per_s']:.1f} samples/s, staleness mean {r['staleness_mean']:.2f} batches")
    print(f"sweep: {out / 'sweep.json'}" + (f", {out / 'sweep.png'}" if done else ""))
    return 0
