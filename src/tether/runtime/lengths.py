"""Length against staleness in a finished run (``tether report``): is what trained biased in length
by how stale it was, and what would dropping stale samples have done?

Systems that drop or down-weight samples past a staleness limit (prime-rl's
``max_off_policy_steps``, TRL's async ``max_staleness``, verl's ``max_off_policy_threshold`` with
drop) train on fewer long responses where long ones are the stale ones. Tether trains every batch it
generates (admission keeps every launch within the budget; ``async.on_stale: drop`` drops a batch
only where admission failed). From the run's per-sample records (``samples.jsonl`` or
``episodes.jsonl``: each sample's model tokens and the oldest version among them) and its metrics
(the version each batch trained at), this measures:

- lengths by staleness: per staleness level (updates, the sample's oldest token), the samples, the
  mean and the 90th percentile of their lengths;
- generated against trained: every batch the run dropped (``drop`` events carry its mean length)
  against what trained;
- per-sample cutoffs: for each level k, had samples staler than k been dropped, the share kept
  and the mean length of what would have trained, against all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def length_bias(run_dir: Path) -> dict[str, Any] | None:
    """The run's lengths against staleness (module docstring); None when it recorded no samples
    (``metrics.record_every: 0``, or a family that records none)."""
    from tether.config import load_config
    from tether.runtime.report import _read_jsonl

    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml")
    records = cfg.family().records
    trained_at = {m["step"]: int(m["async/behavior_version"]) + int(m["staleness/updates"])
                  for m in _read_jsonl(run_dir / "metrics.jsonl") if "staleness/updates" in m}
    samples = []  # (staleness in updates, length)
    for r in _read_jsonl(run_dir / records):
        length = r.get("tokens", r.get("model_tokens"))
        if length is None or not r.get("versions") or r.get("step") not in trained_at:
            continue
        samples.append((trained_at[r["step"]] - int(r["versions"][0]), int(length)))
    if not samples:
        return None
    u = cfg.train.updates_per_batch
    lengths = [n for _, n in samples]
    mean_all = sum(lengths) / len(lengths)
    levels = sorted({s for s, _ in samples})
    by_staleness = {}
    for k in levels:
        at = [n for s, n in samples if s == k]
        by_staleness[str(k)] = {"batches": k / u, "samples": len(at), "mean": sum(at) / len(at),
                                "p90": _percentile(at, 0.9)}
    cutoffs = []
    for k in levels[:-1]:
        kept = [n for s, n in samples if s <= k]
        mean = sum(kept) / len(kept)
        cutoffs.append({"max_staleness_updates": k, "kept_frac": len(kept) / len(samples), "mean": mean,
                        "bias": mean / mean_all - 1.0})
    drops = [e for e in _read_jsonl(run_dir / "events.jsonl") if e.get("kind") == "drop"]
    dropped_samples = sum(int(e.get("detail", {}).get("samples", 0)) for e in drops)
    dropped_tokens = sum(float(d.get("length_mean", 0.0)) * int(d.get("samples", 0))
                         for d in (e.get("detail", {}) for e in drops))
    generated = (sum(lengths) + dropped_tokens) / (len(lengths) + dropped_samples)
    return {"samples": len(samples), "records": records, "trained_mean": mean_all,
            "trained_p90": _percentile(lengths, 0.9), "generated_mean": generated,
            "dropped_batches": len(drops), "dropped_samples": dropped_samples,
            "by_staleness": by_staleness, "cutoffs": cutoffs}


def summary_lines(bias: dict[str, Any]) -> list[str]:
    out = [f"lengths ({bias['samples']} samples of {bias['records']}): trained mean "
           f"{bias['trained_mean']:.1f} tokens (p90 {bias['trained_p90']:g}); generated mean "
           f"{bias['generated_mean']:.1f}"
           + (f" ({bias['dropped_batches']} batch(es) dropped)" if bias["dropped_batches"] else
              " (nothing dropped)")]
    out.append("  by staleness (updates): " + ", ".join(
        f"{k}: {v['samples']} at mean {v['mean']:.1f}" for k, v in bias["by_staleness"].items()))
    if bias["cutoffs"]:
        out.append("  had samples staler than k updates been dropped: " + ", ".join(
            f"k={c['max_staleness_updates']}: {c['kept_frac']:.0%} kept, mean {c['mean']:.1f} "
            f"({c['bias']:+.1%})" for c in bias["cutoffs"]))
    return out


def plot(bias: dict[str, Any], path: Path) -> Path:
    """``lengths.png``: mean and 90th-percentile length per staleness level, and what each
    per-sample cutoff would have kept."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    levels = [int(k) for k in bias["by_staleness"]]
    stats = list(bias["by_staleness"].values())
    axes[0].bar(levels, [s["mean"] for s in stats], color="C0", alpha=0.7, label="mean length")
    axes[0].plot(levels, [s["p90"] for s in stats], "o-", color="C3", label="90th percentile")
    for x, s in zip(levels, stats, strict=True):
        axes[0].annotate(f"{s['samples']}", (x, s["mean"]), ha="center", va="bottom", fontsize=7)
    axes[0].axhline(bias["trained_mean"], color="k", lw=0.8, ls="--", label="all trained")
    axes[0].set_xlabel("staleness (updates, the sample's oldest token)")
    axes[0].set_ylabel("tokens")
    axes[0].set_title("Length by staleness (labels: samples)")
    axes[0].legend()
    if bias["cutoffs"]:
        ks = [c["max_staleness_updates"] for c in bias["cutoffs"]]
        axes[1].plot(ks, [100 * c["bias"] for c in bias["cutoffs"]], "o-",
                     label="mean length kept vs all (%)")
        axes[1].plot(ks, [100 * c["kept_frac"] for c in bias["cutoffs"]], "s--", label="samples kept (%)")
        axes[1].axhline(0, color="k", lw=0.6)
        axes[1].legend()
    axes[1].set_xlabel("drop samples staler than k updates")
    axes[1].set_title("What per-sample dropping would have kept")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
