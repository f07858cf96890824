"""``tether compare RUN RUN ...``: several runs side by side, in one table and one figure.

The question it answers is the one an asynchronous run is for: did overlapping generation and
training reach the same accuracy sooner, and at what staleness? Each run is labelled with its
directory name and its staleness budget and updates per batch (from its ``config.yaml``).

``compare.png`` has four panels: held-out pass@1 against wall time and against trained batches,
the training reward (a moving mean over 20 batches) against wall time, and the samples trained
against wall time (the slope is the throughput).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tether.errors import ConfigError
from tether.runtime.report import _col, _moving_mean, _read_jsonl, _save

SMOOTH = 20


@dataclass
class RunView:
    """What the comparison reads from one run directory."""

    label: str
    metrics: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    samples_per_batch: int

    @classmethod
    def read(cls, path: Path) -> RunView | None:
        """The run in ``path``; None when it has trained no batch yet (started, or stopped or failed
        before its first batch: no row in its metrics.jsonl). Not a run directory: ConfigError."""
        if not (path / "config.yaml").is_file():
            raise ConfigError(f"{path} is not a run directory (it has no config.yaml)")
        metrics = _read_jsonl(path / "metrics.jsonl")
        if not metrics:
            return None
        cfg = yaml.safe_load((path / "config.yaml").read_text()) or {}
        s = cfg.get("async", {}).get("max_staleness", "?")
        u = cfg.get("train", {}).get("updates_per_batch", "?")
        rollout = cfg.get("rollout", {})
        per_batch = int(rollout.get("batch_size", 0)) * int(rollout.get("group_size", 0))
        return cls(f"{path.name} (S={s}, U={u})", metrics, _read_jsonl(path / "eval.jsonl"), per_batch)

    def row(self) -> dict[str, Any]:
        """One line of the table."""
        wall = self.metrics[-1]["wall_s"]
        stale = [m["staleness/batches"] for m in self.metrics]
        first = self.evals[0]["eval/pass_at_1"] if self.evals else None
        last = self.evals[-1]["eval/pass_at_1"] if self.evals else None
        return {"run": self.label, "batches": len(self.metrics), "wall_s": wall,
                "samples_per_s": len(self.metrics) * self.samples_per_batch / wall if wall > 0 else None,
                "staleness_mean": sum(stale) / len(stale), "staleness_max": max(stale),
                "pass_at_1_first": first, "pass_at_1_last": last}


def write_comparison(run_dirs: list[Path], out: Path) -> tuple[Path, list[dict[str, Any]], list[str]]:
    """Draw ``out`` (a PNG) for ``run_dirs``; returns its path, the table's rows and notes on the
    runs left out: a run that has trained no batch yet is left out, named, as long as two runs
    remain to compare (else the comparison is refused, naming it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if len(run_dirs) < 2:
        raise ConfigError("tether compare needs at least two run directories")
    read = [(Path(p), RunView.read(Path(p))) for p in run_dirs]
    untrained = [p for p, run in read if run is None]
    runs = [run for _, run in read if run is not None]
    if len(runs) < 2:
        raise ConfigError(
            f"fewer than two runs to compare: {', '.join(map(str, untrained))} "
            f"{'has' if len(untrained) == 1 else 'have'} trained no batch yet (no row in metrics.jsonl: "
            "the run is starting, or stopped or failed before its first batch); compare runs that have "
            "trained, or wait for the first rows")
    notes = [f"{p} is left out: it has trained no batch yet (no row in its metrics.jsonl)" for p in untrained]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (acc_t, acc_b), (rew_t, samples_t) = axes
    for i, run in enumerate(runs):
        color = f"C{i}"
        wall = _col(run.metrics, "wall_s")
        if run.evals:
            acc_t.plot(_col(run.evals, "wall_s"), _col(run.evals, "eval/pass_at_1"), "o-", ms=3, color=color)
            acc_b.plot(_col(run.evals, "step"), _col(run.evals, "eval/pass_at_1"), "o-", ms=3, color=color)
        rew_t.plot(wall, _moving_mean(_col(run.metrics, "reward/mean"), SMOOTH), lw=1, color=color,
                   label=run.label)  # every run has trained batches; not every one evaluated
        samples_t.plot(wall, [m["step"] * run.samples_per_batch for m in run.metrics], lw=1, color=color)
    for ax, title, xlabel in ((acc_t, "held-out pass@1", "wall time (s)"),
                              (acc_b, "held-out pass@1", "trained batches"),
                              (rew_t, f"train reward (mean of {SMOOTH} batches)", "wall time (s)"),
                              (samples_t, "samples trained", "wall time (s)")):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    rew_t.legend(loc="lower right", fontsize=8)
    fig.suptitle("Runs compared")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, out), [run.row() for run in runs], notes


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as aligned text."""
    def pct(x: float | None) -> str:
        return "—" if x is None else f"{100 * x:.1f}%"

    head = ("run", "batches", "wall s", "samples/s", "staleness mean/max", "pass@1 first → last")
    body = [(r["run"], str(r["batches"]), f"{r['wall_s']:.0f}",
             "—" if r["samples_per_s"] is None else f"{r['samples_per_s']:.0f}",
             f"{r['staleness_mean']:.2f} / {r['staleness_max']:g}",
             f"{pct(r['pass_at_1_first'])} → {pct(r['pass_at_1_last'])}") for r in rows]
    widths = [max(len(line[i]) for line in (head, *body)) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
                     for line in (head, *body))
