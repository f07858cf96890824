"""``tether sweep``: one recipe over a grid of key values and seeds, run by run, resumable, and a
figure of held-out reward (and samples/s) against the swept values.

Each grid point is a ``tether train`` of its own (a child process: a Ray recipe is then one Ray job
a run), in ``OUT/<key>=<value>,…/seed<k>``. A point whose run directory holds ``summary.json`` is
done and is not run again; one that stopped with a checkpoint is resumed (``--resume``); one that
stopped before its first checkpoint is started afresh. Every point's recipe is loaded before any
run starts, so a bad key or value is refused before anything trains, and so is a kept run whose
recipe differs from the one the sweep now gives its point (the keys named). ``OUT/sweep.json`` holds a
row a run (its values, seed, held-out figure, samples/s, mean and max staleness) and ``sweep.png``
plots the held-out figure and samples/s against the values, the mean over seeds with the spread.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether.errors import ConfigError, TetherError


class SweepError(TetherError):
    """Runs of the sweep failed (each is named with its log)."""


@dataclass(frozen=True)
class Point:
    values: tuple[tuple[str, str], ...]
    """(key, value) of each swept key, in the order given."""
    seed: int

    @property
    def name(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.values) or "recipe"

    def run_dir(self, out: Path) -> Path:
        return out / self.name / f"seed{self.seed}"

    def overrides(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.values] + [f"run.seed={self.seed}"]


def parse_grid(sets: Sequence[str]) -> list[tuple[str, list[str]]]:
    """``KEY=V1,V2,…`` flags as (key, values); a value may not be empty, a key given twice is refused."""
    grid: list[tuple[str, list[str]]] = []
    for item in sets:
        key, sep, values = item.partition("=")
        key = key.strip()
        parts = [v.strip() for v in values.split(",")] if sep else []
        if not key or not parts or any(not v for v in parts):
            raise ConfigError(f"--set {item!r} must look like section.key=V1,V2,... (no empty value)")
        if key in (k for k, _ in grid):
            raise ConfigError(f"--set gives {key} twice; list all its values in one --set")
        repeated = sorted({v for v in parts if parts.count(v) > 1})
        if repeated:
            raise ConfigError(f"--set {key} lists {', '.join(repeated)} more than once; give each value once "
                              "(more runs of a point: --seeds)")
        if key == "run.seed":
            raise ConfigError("--set run.seed: seeds come from --seeds (run.seed + 0 … N − 1)")
        grid.append((key, parts))
    if not grid:
        raise ConfigError("tether sweep needs at least one --set section.key=V1,V2,...")
    return grid


def points(grid: list[tuple[str, list[str]]], seeds: Sequence[int]) -> list[Point]:
    keys = [k for k, _ in grid]
    return [Point(tuple(zip(keys, combo, strict=True)), seed)
            for combo in itertools.product(*(vals for _, vals in grid)) for seed in seeds]


def check(recipe: str | None, overrides: Sequence[str], grid_points: Sequence[Point],
          out: Path | None = None) -> None:
    """Load every point's recipe (refusing a bad key or value, naming the point) before any run;
    with ``out``, refuse a point whose kept run (finished, or to resume) was trained with another
    recipe than the one the sweep now gives it: it would be reported, or continued, as if it were
    this point's."""
    from tether.config import load_config
    from tether.runtime.rundir import resume_changes

    for p in grid_points:
        try:
            cfg = load_config(recipe, [*overrides, *p.overrides()])
        except ConfigError as exc:
            raise ConfigError(f"sweep point {p.name} (seed {p.seed}): {exc}") from exc
        run_dir = p.run_dir(out) if out is not None else None
        if run_dir is None or state(run_dir) == "fresh" or not (run_dir / "config.yaml").is_file():
            continue
        changes = resume_changes(load_config(run_dir / "config.yaml").to_dict(), cfg.to_dict())
        differ = [*changes.safe, *(change for change, _ in changes.refused)]
        if differ:
            raise ConfigError(
                f"sweep point {p.name} (seed {p.seed}): its run {run_dir} was trained with another recipe "
                "than the sweep now gives it (kept → now):\n  - " + "\n  - ".join(differ)
                + "\nChoose another --out for the new recipe, or delete that run to train it again")


def state(run_dir: Path) -> str:
    """``done`` (summary.json), ``resume`` (a checkpoint to go on from), ``fresh`` (nothing kept)."""
    if (run_dir / "summary.json").is_file():
        return "done"
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir() and any(ckpts.iterdir()):
        return "resume"
    return "fresh"


def _run_child(argv: list[str], log: Path) -> int:
    """Run ``tether`` with ``argv`` in a process group of its own, output to ``log``; a Ctrl-C or
    SIGTERM here stops it (its whole group) before it is passed on."""
    with open(log, "a") as out:
        child = subprocess.Popen([sys.executable, "-m", "tether.cli.main", *argv], stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return child.wait()
        except BaseException:
            os.killpg(child.pid, signal.SIGINT)  # tether train checkpoints nothing partial on SIGINT
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
            raise


def run_sweep(recipe: str | None, overrides: Sequence[str], grid: list[tuple[str, list[str]]],
              seeds: Sequence[int], out: Path, *, say: Callable[[str], None] = print,
              runner: Callable[[list[str], Path], int] = _run_child) -> list[dict[str, Any]]:
    """Run every point not yet done, in order; returns the rows of ``sweep.json`` (written, with
    ``sweep.png``, also when some runs failed: ``SweepError`` then names them)."""
    grid_points = points(grid, seeds)
    check(recipe, overrides, grid_points, out)
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for i, p in enumerate(grid_points, 1):
        run_dir = p.run_dir(out)
        log = run_dir.with_suffix(".log")
        status = state(run_dir)
        head = f"[{i}/{len(grid_points)}] {p.name} seed {p.seed}"
        if status == "done":
            say(f"{head}: done already")
            continue
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        if status == "resume":
            say(f"{head}: resuming {run_dir}")
            argv = ["train", "--resume", str(run_dir), "--plain", "--no-report"]
        else:
            if run_dir.exists():
                shutil.rmtree(run_dir)  # stopped before its first checkpoint: nothing to keep
            say(f"{head}: training in {run_dir}")
            argv = ["train", *([recipe] if recipe else []), *overrides, *p.overrides(),
                    "--run-dir", str(run_dir), "--plain", "--no-report"]
        code = runner(argv, log)
        if code != 0 or state(run_dir) != "done":
            failed.append(f"{p.name} seed {p.seed} (exit {code}; see {log})")
            say(f"{head}: failed (exit {code}); its output is in {log}")
    rows = collect(out, grid_points)
    (out / "sweep.json").write_text(json.dumps({"keys": [k for k, _ in grid], "rows": rows}, indent=2) + "\n")
    if any(r["held_out"] is not None for r in rows):
        plot(rows, [k for k, _ in grid], out / "sweep.png")
    if failed:
        raise SweepError(f"{len(failed)} of {len(grid_points)} runs failed: {'; '.join(failed)}; run the "
                         "same command again to retry them (finished runs are kept)")
    return rows


def held_out(evals: list[dict[str, Any]]) -> tuple[str, float] | None:
    """The last evaluation's held-out figure: a flow run's mean reward, else greedy pass@1."""
    if not evals:
        return None
    last = evals[-1]
    for key in ("eval/reward_mean", "eval/pass_at_1"):
        if key in last and last[key] is not None:
            return key, float(last[key])
    return None


def collect(out: Path, grid_points: Sequence[Point]) -> list[dict[str, Any]]:
    rows = []
    for p in grid_points:
        run_dir = p.run_dir(out)
        row: dict[str, Any] = {"values": dict(p.values), "seed": p.seed, "run": str(run_dir),
                               "done": state(run_dir) == "done", "held_out": None, "held_out_key": None,
                               "samples_per_s": None, "staleness_mean": None, "staleness_max": None}
        if row["done"]:
            summary = json.loads((run_dir / "summary.json").read_text())
            figure = held_out(summary.get("evals") or [])
            if figure is not None:
                row["held_out_key"], row["held_out"] = figure
            row["samples_per_s"] = summary.get("samples_per_s")
            row["staleness_max"] = summary.get("staleness_batches_max")
            stale = [json.loads(line).get("staleness/batches")
                     for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
            stale = [s for s in stale if s is not None]
            row["staleness_mean"] = sum(stale) / len(stale) if stale else None
        rows.append(row)
    return rows


def plot(rows: list[dict[str, Any]], keys: list[str], path: Path) -> Path:
    """Held-out figure and samples/s against the swept values: the mean over seeds, the spread
    (min–max) shaded, each seed a dot. One swept key of numbers is an axis of its values; otherwise
    each combination is a place on the axis, labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    combos: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["done"]:
            combos.setdefault(tuple(r["values"][k] for k in keys), []).append(r)
    labels = list(combos)
    numeric = len(keys) == 1 and all(_is_number(c[0]) for c in labels)
    xs = [float(c[0]) for c in labels] if numeric else list(range(len(labels)))
    order = sorted(range(len(labels)), key=lambda i: xs[i])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    figure_key = next((r["held_out_key"] for r in rows if r["held_out_key"]), "held-out")
    for ax, field, title in ((axes[0], "held_out", figure_key), (axes[1], "samples_per_s", "samples/s")):
        means, lows, highs, used = [], [], [], []
        for i in order:
            vals = [r[field] for r in combos[labels[i]] if r[field] is not None]
            if not vals:
                continue
            used.append(xs[i])
            means.append(sum(vals) / len(vals))
            lows.append(min(vals))
            highs.append(max(vals))
            ax.scatter([xs[i]] * len(vals), vals, s=12, color="C0", alpha=0.5)
        ax.plot(used, means, "o-", color="C0", label="mean over seeds")
        ax.fill_between(used, lows, highs, color="C0", alpha=0.2, label="spread (min–max)")
        ax.set_title(title)
        ax.set_xlabel(keys[0] if numeric else ", ".join(keys))
        if not numeric:
            ax.set_xticks(xs, ["\n".join(map(str, c)) for c in labels], fontsize=7)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="best")
    seeds = len({r["seed"] for r in rows})
    fig.suptitle(f"{', '.join(keys)} swept, {seeds} seed(s) each")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False
