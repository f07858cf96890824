"""Does ``tether plan --optimize`` choose right? Its prediction against real runs.

1. Runs the recipe as given for ``--batches`` batches and reads its per-phase timings from
   metrics.jsonl (mean ``time/generate``, ``time/train`` / U, ``time/sync`` of publishing steps),
   as a user would before asking the planner.
2. Asks the search (``tether.loop.optimize.search``, what ``tether plan --optimize`` prints) for the
   best recipe within ``--cores`` and ``--staleness-cap``, given those timings.
3. Runs the chosen recipe, and the synchronous one (S = 0, one engine: the loop a user leaves when
   adopting Tether) as a control whose throughput differs by more than the noise.

It prints, for each, predicted and measured samples/s (steady state: the samples of the batches
after ``--warmup`` over the sum of their ``time/step``) and whether the measured ranking is the
predicted one. The planner's prediction is the simulated loop at the measured timings; what it
cannot know (contention between the engine and the learner for memory bandwidth) shows here.

    python benchmarks/optimize_check.py recipes/demo.yaml --batches 120
    python benchmarks/optimize_check.py recipes/longtail.yaml --batches 80 --staleness-cap 4
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

FIXED = ("eval.interval=0", "checkpoint.interval=0")


def train(recipe: str, overrides: list[str], batches: int, run_dir: Path) -> list[dict]:
    """One ``tether train`` run; its metrics rows."""
    argv = [sys.executable, "-m", "tether.cli.main", "train", recipe, *overrides, *FIXED,
            f"train.num_batches={batches}", "--run-dir", str(run_dir), "--plain"]
    done = subprocess.run(argv, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode != 0:
        raise SystemExit(f"tether train failed ({done.returncode}): {' '.join(argv)}\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "time/step" in r]


def timings(rows: list[dict], warmup: int, updates_per_batch: int) -> dict[str, float]:
    steady = rows[warmup:]
    syncs = [r["time/sync"] for r in steady if r.get("time/sync", 0.0) > 0]
    return {"gen_time": statistics.fmean(r["time/generate"] for r in steady),
            "train_time": statistics.fmean(r["time/train"] for r in steady) / updates_per_batch,
            "sync_time": statistics.fmean(syncs) if syncs else 0.0}


def throughput(rows: list[dict], warmup: int, samples_per_batch: int) -> float:
    steady = rows[warmup:]
    return len(steady) * samples_per_batch / sum(r["time/step"] for r in steady)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--batches", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=10, help="batches left out of the steady state")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--staleness-cap", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from tether.config import load_config
    from tether.loop.optimize import TIE, evaluate, priced, search

    base = load_config(args.recipe, list(args.overrides))
    samples = base.rollout.batch_size * base.rollout.group_size
    out = Path(tempfile.mkdtemp(prefix="optimize-check-"))
    given_rows = train(args.recipe, list(args.overrides), args.batches, out / "given")
    measured = timings(given_rows, args.warmup, base.train.updates_per_batch)
    plan = [f"plan.{k}={v:.5f}" for k, v in measured.items()]
    overrides = [*args.overrides, *plan, f"train.num_batches={args.batches}"]
    chosen, _, given = search(args.recipe, overrides, cores=args.cores, staleness_cap=args.staleness_cap)

    sync_extra = ("async.max_staleness=0", "async.max_inflight=1", "rollout.num_workers=1",
                  "async.inflight_update=drain", "async.sync_when_idle=false")
    fixed = [f"train.num_batches={args.batches}", *FIXED]
    sync_cfg = priced(load_config(args.recipe, [*overrides, *sync_extra, *fixed]),
                      load_config(args.recipe, overrides))
    sync = evaluate(sync_cfg, sync_extra, args.batches)

    arms = {"as given": (given, given_rows),
            "chosen": (chosen, train(args.recipe, [*args.overrides, *chosen.overrides], args.batches,
                                     out / "chosen"))}
    arms["synchronous"] = (sync, train(args.recipe, [*args.overrides, *sync_extra], args.batches,
                                       out / "sync"))

    table = []
    for name, (cand, rows) in arms.items():
        got = throughput(rows, args.warmup, samples)  # the search keeps the batch's shape (no --vary-*)
        table.append({"arm": name, "predicted": cand.samples_per_s, "measured": got,
                      "error": got / cand.samples_per_s - 1.0, "overrides": list(cand.overrides)})

    predicted_order = [r["arm"] for r in sorted(table, key=lambda r: -r["predicted"])]
    measured_order = [r["arm"] for r in sorted(table, key=lambda r: -r["measured"])]
    # a pair whose predictions differ by less than the search's tie is predicted equal: not ranked
    pairs = [(a["arm"], b["arm"], (a["measured"] > b["measured"]) == (a["predicted"] > b["predicted"]))
             for a, b in itertools.combinations(table, 2)
             if abs(a["predicted"] / b["predicted"] - 1.0) > TIE]
    report = {"recipe": args.recipe, "measured_timings": measured, "arms": table,
              "predicted_order": predicted_order, "measured_order": measured_order,
              "ranked_pairs": pairs, "ranking_agrees": all(ok for *_, ok in pairs), "run_dirs": str(out)}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{args.recipe}: timings measured on the recipe as given (after {args.warmup} batches): "
          + ", ".join(f"{k} {v:.4f} s" for k, v in measured.items()))
    print(f"{'arm':<12} {'predicted':>10} {'measured':>10} {'error':>7}  overrides")
    for r in table:
        print(f"{r['arm']:<12} {r['predicted']:10.1f} {r['measured']:10.1f} {r['error']:+7.1%}  "
              f"{' '.join(r['overrides'])}")
    print(f"ranking predicted {' > '.join(predicted_order)}; measured {' > '.join(measured_order)}")
    for a, b, ok in pairs:
        print(f"  {a} against {b} (predicted apart by more than {TIE:.0%}): {'agrees' if ok else 'DIFFERS'}")
    if not pairs:
        print(f"  every prediction within {TIE:.0%} of the others: predicted equal")
    print(f"runs in {out}")


if __name__ == "__main__":
    main()
