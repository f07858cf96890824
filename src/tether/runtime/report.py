"""``tether report RUN``: the PNG plots of a run, drawn from its metrics, evals and events.

- ``reward.png``: training reward and held-out pass@1 against trained batches and wall time;
- ``staleness.png``: staleness of every batch, with the publications marked;
- ``ratios.png``: clip fractions and importance-ratio spread against staleness;
- ``timeline.png``: generation, training and sync over wall time, showing the overlap;
- ``study.png`` and ``study.json``: the staleness study the run contains (``tether.runtime.study``):
  clip fraction and ratio spread per staleness, low against high staleness, the reward trend;
- and the family's own (``Family.report``): for flow runs ``samples.png``, the fixed held-out
  prompts' images at evaluations across the run, first to last.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tether.errors import ConfigError


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
    return rows


def _col(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [float("nan") if r.get(key) is None else r[key] for r in rows]


def _moving_mean(values: list[float], window: int) -> list[float]:
    """The mean of the last ``window`` values at each point (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def write_report(run_dir: Path, *, study_low: float | None = None,
                 study_high: float | None = None) -> list[Path]:
    """Write the plots into ``RUN/plots/``; returns their paths. ``study_low``/``study_high``
    group the staleness study as the seed did (≤ low against ≥ high) instead of at the median."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    metrics = _read_jsonl(run_dir / "metrics.jsonl")
    if not metrics:
        if (run_dir / "config.yaml").is_file():
            raise ConfigError(f"{run_dir} has trained no batch yet (metrics.jsonl has no rows): there is "
                              "nothing to plot; run `tether report` once a batch has trained")
        raise ConfigError(f"{run_dir} has no metrics.jsonl rows to plot, and no config.yaml: it is not a run "
                          "directory")
    evals = _read_jsonl(run_dir / "eval.jsonl")
    events = _read_jsonl(run_dir / "events.jsonl")
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    steps, wall = _col(metrics, "step"), _col(metrics, "wall_s")
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    views = ((axes[0], steps, "step", "trained batches"), (axes[1], wall, "wall_s", "wall time (s)"))
    for ax, x, ex, label in views:
        ax.plot(x, _col(metrics, "reward/mean"), lw=0.8, alpha=0.6, label="train reward (mean)")
        if evals:
            ax.plot(_col(evals, ex), _col(evals, "eval/pass_at_1"), "o-", color="C3", label="held-out pass@1")
            if "eval/reward_mean" in evals[-1]:  # a flow run: its reward is partial credit
                ax.plot(_col(evals, ex), _col(evals, "eval/reward_mean"), "^-", color="C2",
                        label="held-out reward (ODE)")
            if "eval/pass_at_k" in evals[-1]:
                k = int(evals[-1]["eval/num_samples"])
                ax.plot(_col(evals, ex), _col(evals, "eval/pass_at_k"), "s--", color="C4",
                        label=f"held-out pass@{k} (sampled)")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("reward / accuracy")
    axes[0].legend(loc="lower right")
    fig.suptitle("Reward and held-out accuracy")
    paths.append(_save(fig, out / "reward.png"))

    parts = ("at_launch", "generating", "queued")
    split = all(f"staleness/{p}_updates" in metrics[-1] for p in parts)  # older runs lack it
    fig, axes = plt.subplots(2 if split else 1, 1, figsize=(11, 6.5 if split else 3.5), sharex=True,
                             squeeze=False)
    ax = axes[0][0]
    ax.step(steps, _col(metrics, "staleness/batches"), where="mid", label="staleness (batches)")
    ax.plot(steps, _col(metrics, "async/publish_lag"), lw=0.6, alpha=0.5,
            label="publish lag (updates, after sync)")
    syncs = [e["step"] for e in events if e.get("kind") == "sync" and e.get("published")]
    for i, s in enumerate(syncs):
        ax.axvline(s, color="C2", lw=0.6, alpha=0.5, label="publication" if i == 0 else None)
    ax.set_xlabel("trained batches")
    ax.set_ylabel("staleness")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    ax.set_title("Staleness per batch and weight publications")
    if split:
        window = max(1, min(20, len(metrics) // 10))
        labels = {"at_launch": "engines' publish lag at launch", "generating": "while generating",
                  "queued": "waiting to be trained"}
        ax = axes[1][0]
        ax.stackplot(steps, *[_moving_mean(_col(metrics, f"staleness/{p}_updates"), window) for p in parts],
                     labels=[labels[p] for p in parts], alpha=0.8)
        ax.set_xlabel("trained batches")
        ax.set_ylabel("updates")
        ax.legend(loc="upper right")
        ax.grid(alpha=0.3)
        ax.set_title(f"Where staleness accrued (moving mean of {window} batches)")
    paths.append(_save(fig, out / "staleness.png"))

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    stale = _col(metrics, "staleness/batches")
    axes[0].scatter(stale, _col(metrics, "ratio/clip_frac_high"), s=8, label="clip fraction (high)")
    axes[0].scatter(stale, _col(metrics, "ratio/clip_frac_low"), s=8, label="clip fraction (low)")
    axes[0].set_xlabel("staleness (batches)")
    axes[0].legend()
    axes[0].set_title("Clipping against staleness")
    axes[1].scatter(stale, _col(metrics, "ratio/max"), s=8, label="ratio max")
    axes[1].scatter(stale, _col(metrics, "ratio/min"), s=8, label="ratio min")
    axes[1].scatter(stale, _col(metrics, "ratio/is_weight_max"), s=8, label="IS weight max (π_prox/μ)")
    axes[1].set_xlabel("staleness (batches)")
    axes[1].legend()
    axes[1].set_title("Ratios against staleness")
    # |log π_old − log μ|: all tokens (staleness and numerics) and only the tokens sampled with
    # the trained weights themselves (numerics alone, where a batch has any)
    mismatch = _col(metrics, "mismatch/logprob_abs_diff_max")
    numeric = _col(metrics, "mismatch/numeric_logprob_abs_diff_max")
    axes[2].scatter(stale, mismatch, s=8, label="all tokens")
    axes[2].scatter(stale, numeric, s=8, label="same weights (numerics)")
    if any(v > 0 for v in mismatch + numeric):  # NaN or exactly 0 throughout has no log scale
        axes[2].set_yscale("log")
    axes[2].set_xlabel("staleness (batches)")
    axes[2].legend()
    axes[2].set_title("max |log π_old − log μ|")
    for ax in axes:
        ax.grid(alpha=0.3)
    paths.append(_save(fig, out / "ratios.png"))

    paths.append(_timeline(plt, events, out / "timeline.png"))
    paths += _study(plt, metrics, out, low=study_low, high=study_high)
    from tether.runtime import lengths

    bias = lengths.length_bias(run_dir)
    if bias is not None:
        (out / "lengths.json").write_text(json.dumps(bias, indent=2) + "\n")
        paths.append(lengths.plot(bias, out / "lengths.png"))
    paths += _family(run_dir).report(run_dir, evals, out)
    return paths


def _family(run_dir: Path):
    """The run's policy family (its own plots), from the run's config."""
    from tether.config import load_config

    return load_config(run_dir / "config.yaml").family()


def _study(plt, metrics: list[dict[str, Any]], out: Path, *, low: float | None,
           high: float | None) -> list[Path]:
    from tether.runtime.study import staleness_study

    study = staleness_study(metrics, low=low, high=high)
    (out / "study.json").write_text(json.dumps(study, indent=2) + "\n")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    levels = list(study["by_staleness"])
    for ax, name, title in ((axes[0], "clip_frac", "clip fraction (low + high)"),
                            (axes[1], "ratio_std", "ratio spread (std)"),
                            (axes[2], "is_weight_std", "IS weight spread π_old/μ (std)")):
        rows = [study["by_staleness"][lv][name] for lv in levels]
        xs = [float(lv) for lv, r in zip(levels, rows, strict=True) if r.get("n")]
        ax.errorbar(xs, [r["mean"] for r in rows if r.get("n")], yerr=[r["std"] for r in rows if r.get("n")],
                    fmt="o-", capsize=3)
        ax.set_xlabel("staleness (batches)")
        ax.set_title(title + " per staleness, mean ± std")
        ax.grid(alpha=0.3)
    r = study["reward_trend"]
    if "t" in r:
        fig.suptitle(f"In-run staleness study; reward trend {r['slope']:+.2e}/batch, t = {r['t']:.2f}")
    return [out / "study.json", _save(fig, out / "study.png")]


def _timeline(plt, events: list[dict[str, Any]], path: Path) -> Path:
    """Lanes: generation, training, sync, eval — in the loop's clock. A batch's generation is
    drawn solid for the worker's own work (generate + score, ending when the pool received it)
    and faint from launch to ready around it (queued behind other batches, or finished and
    waiting to be reaped)."""
    fig, ax = plt.subplots(figsize=(11, 3))
    launched = {e["batch"]: e["t"] for e in events if e.get("kind") == "launch"}
    lanes = {"generate": 3, "train": 2, "sync": 1, "eval": 0}
    colors = {"generate": "C0", "train": "C1", "sync": "C2", "eval": "C3"}
    t0 = min((e["t"] for e in events), default=0.0)

    def bar(start: float, end: float, lane: str, alpha: float) -> None:
        ax.broken_barh([(start - t0, max(end - start, 1e-3))], (lanes[lane] - 0.4, 0.8),
                       color=colors[lane], alpha=alpha, linewidth=0)

    for e in events:
        kind = e.get("kind")
        if kind == "ready" and e.get("batch") in launched:
            start, end = launched[e["batch"]], e["t"]
            done, work = e.get("completed_at"), e.get("work_s")  # the event's detail, flattened
            if done is not None and work is not None and start <= done <= end + 1e-6:
                bar(start, end, "generate", 0.15)
                bar(max(start, done - work), done, "generate", 0.6)
            else:
                bar(start, end, "generate", 0.5)
        elif kind in ("train", "sync", "eval") and e.get("end") is not None:
            bar(e["t"], e["end"], kind, 0.5)
    ax.set_yticks(list(lanes.values()), list(lanes))
    ax.set_xlabel("time since start (s)")
    ax.set_title("Timeline: generation (solid: the worker's work; faint: launch → ready) and training")
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def staleness_forms(run_dir: Path) -> dict[str, Any] | None:
    """A run's mean staleness three ways, in batches: measured (its ``staleness/batches``),
    simulated (``tether plan`` with the run's recipe and its measured mean timings: a batch's
    ``time/generate``, an update's share of ``time/train``, a publication's ``time/sync``) and in
    closed form (``tether.loop.closed_form``); None for a run with no trained batch."""
    from dataclasses import replace

    from tether.config import load_config
    from tether.loop.closed_form import closed_forms
    from tether.loop.virtual import plan_document, simulate, timings_of

    metrics = [r for r in _read_jsonl(Path(run_dir) / "metrics.jsonl") if "staleness/batches" in r]
    if not metrics:
        return None
    cfg = load_config(Path(run_dir) / "config.yaml")

    def mean(key: str, rows=metrics) -> float:
        values = [float(r[key]) for r in rows if key in r and math.isfinite(float(r[key]))]
        return sum(values) / len(values) if values else 0.0

    syncs = [r for r in metrics if float(r.get("time/sync", 0.0)) > 0]
    gen = mean("time/generate")
    train = mean("time/train") / cfg.train.updates_per_batch
    sync = mean("time/sync", syncs) if syncs else 0.0
    n = len(metrics)
    from tether.control import inflight_mode

    # the run's own commits (skipped updates stretch its periods); lengths where the mode's work needs them
    commits = [int(r.get("async/optimizer_updates", cfg.train.updates_per_batch)) for r in metrics]
    length = mean("response/length_mean") if inflight_mode(cfg.async_.inflight_update).extra_work else 0.0
    cfg = replace(cfg, train=replace(cfg.train, num_batches=n),
                  plan=replace(cfg.plan, gen_time=gen, train_time=train, sync_time=sync, gen_jitter=0.0,
                               mean_length=length, turns=0.0, env_time=0.0, commits=commits,
                               train_time_steps=0))
    sim = simulate(cfg.budget(), timings_of(cfg), num_groups=cfg.rollout.batch_size,
                   group_size=cfg.rollout.group_size, anchor=cfg.train.anchor)
    return {"measured_batches": mean("staleness/batches"), "batches": n,
            "simulated_batches": plan_document(sim)["summary"]["mean_staleness_batches"],
            "timings": {"gen_time": gen, "train_time": train, "sync_time": sync},
            "closed_form": closed_forms(cfg, gen_time=gen, train_time=train, sync_time=sync)}
