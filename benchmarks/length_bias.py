"""Is what trains biased in length by staleness? The long-tail task under keep and under drain.

``recipes/longtail.yaml`` (the ``repeat`` task: answer lengths geometric with mean 6 letters, up to
48) trains for ``--batches`` batches with ``async.inflight_update`` keep and drain at S = 2. For
each run, from its per-sample records (``tether report``'s ``lengths.json``,
``tether.runtime.lengths``): the mean length at each staleness level (a sample's oldest token),
and, for each cutoff k, what dropping the samples staler than k updates (as prime-rl, TRL's async
trainer and verl's drop mode do) would have kept and the mean length of it against all. Tether
itself drops nothing: admission keeps every launch within the budget, so what trains is what was
generated.

    python benchmarks/length_bias.py [--batches 60] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(mode: str, batches: int, model: Path, out: Path) -> dict:
    from tether.config import load_config
    from tether.runtime.lengths import length_bias
    from tether.runtime.run import train

    cfg = load_config(ROOT / "recipes" / "longtail.yaml", [
        f"model.path={model}", f"async.inflight_update={mode}", f"train.num_batches={batches}",
        "eval.interval=0", "checkpoint.interval=0", "metrics.attribution=false"])
    train(cfg, out, progress_plain=True)
    return length_bias(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--model", default=str(ROOT / "runs" / "models" / "longtail-small"),
                    help="the long-tail model (built and warm-started on first use)")
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("keep", "drain"):
            results[mode] = run(mode, ns.batches, Path(ns.model), Path(tmp) / mode)
    if ns.json:
        print(json.dumps(results, indent=2))
        return
    for mode, bias in results.items():
        print(f"\n{mode}, S = 2, {bias['samples']} samples: trained mean {bias['trained_mean']:.2f} tokens, "
              f"generated mean {bias['generated_mean']:.2f} ({bias['dropped_batches']} batches dropped)")
        print("  staleness (updates)  samples  mean length  p90")
        for k, v in bias["by_staleness"].items():
            print(f"  {k:>19s}  {v['samples']:7d}  {v['mean']:11.2f}  {v['p90']:4g}")
        for c in bias["cutoffs"]:
            print(f"  dropping samples staler than {c['max_staleness_updates']}: {c['kept_frac']:.0%} kept, "
                  f"mean length {c['mean']:.2f} ({c['bias']:+.1%} against all)")


if __name__ == "__main__":
    main()
