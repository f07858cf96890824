"""Flow-GRPO at a shallow and a deep staleness budget, with each anchor, side by side in one run.

The flow demo (``recipes/flow-demo.yaml``: the warm-started `shapes` model, 8 prompts × 8 images
× 8 SDE steps) is trained for the same number of batches — the same samples — at S = 1 and
S = 11, each with ``train.anchor: behavior`` (the ratio π_θ/μ clipped against the engine's
log-probabilities: the seed system's "naive PPO" for its image recipe; no weight, as that anchor
needs none) and ``proximal``
(Tether's default: clipped against π_old, weighed by π_old/μ, the recipe's
``correction.tis: token``). Two updates per batch (the seed's
diffusion arms use U = 2), so the second update's ratio is not 1 under either anchor.

Reported per setting, in the seed's terms: the clip fraction against the behaviour policy
(``outside_clip_frac``: the share of steps with |π_θ/μ − 1| > ε whatever the anchor, what the seed
and Flow-GRPO's reference report; ``ratio/behavior_outside_clip_frac``), the importance-weight
spread π_old/μ (``is_weight_std``: the proximal anchor's staleness) and the ratio spread per
staleness of the run's own batches (at S = 11 the trainer is the slower side, so the run sweeps
staleness by itself: the study view of ``tether report``); the seed's grouping, staleness ≤ 2
against ≥ 7 (the median split where a run never reaches 7), with Welch's t and its two-sided p;
the training reward over the last quarter of the batches, and the held-out reward (ODE images of
the held-out prompts) before and after.

    python benchmarks/flow_staleness.py [--batches N] [--seed 0] [--settings 11:behavior,11:proximal] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = [(1, "behavior"), (1, "proximal"), (11, "behavior"), (11, "proximal")]
SEED_LOW, SEED_HIGH = 2, 7  # the seed's grouping: staleness ≤ 2 against ≥ 7, the middle left out


def run_one(model: str, run_dir: Path, s: int, anchor: str, batches: int, threads: int,
            seed: int = 0) -> dict:
    from tether.config import load_config
    from tether.runtime.run import train
    from tether.runtime.study import staleness_study

    cfg = load_config(ROOT / "recipes" / "flow-demo.yaml", [
        f"model.path={model}", f"async.max_staleness={s}", f"async.max_inflight={s + 1}",
        f"train.anchor={anchor}", "train.updates_per_batch=2", f"train.num_batches={batches}",
        f"eval.interval={batches}", "checkpoint.interval=0", f"train.threads={threads}",
        f"rollout.threads_per_worker={threads}", f"run.seed={seed}",
        *(["correction.tis=none"] if anchor == "behavior" else [])])
    summary = train(cfg, run_dir, progress_plain=True)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = summary["evals"]
    deep = max((m.get("staleness/batches") or 0) for m in metrics) >= SEED_HIGH
    study = staleness_study(metrics, **({"low": SEED_LOW, "high": SEED_HIGH} if deep else {}))
    tail = metrics[-max(1, len(metrics) // 4):]
    per_level = study["by_staleness"].items()
    return {"S": s, "anchor": anchor, "seed": seed, "batches": len(metrics), "wall_s": summary["wall_s"],
            "staleness_max": summary["staleness_batches_max"],
            "staleness_mean": summary["staleness_batches_mean"],
            "reward_last_quarter": sum(m["reward/mean"] for m in tail) / len(tail),
            "eval_reward_first": evals[0]["eval/reward_mean"],
            "eval_reward_last": evals[-1]["eval/reward_mean"],
            "outside_clip_frac_by_staleness": {k: v["outside_clip_frac"].get("mean") for k, v in per_level},
            "is_weight_std_by_staleness": {k: v["is_weight_std"].get("mean") for k, v in per_level},
            "ratio_std_by_staleness": {k: v["ratio_std"].get("mean") for k, v in per_level},
            "binding_clip_frac_by_staleness": {k: v["clip_frac"].get("mean") for k, v in per_level},
            "grouping": "≤ 2 vs ≥ 7" if deep else "median split",
            "outside_clip_frac_high_vs_low": study["grouped"]["outside_clip_frac"],
            "is_weight_std_high_vs_low": study["grouped"]["is_weight_std"]}


def _compared(g: dict, fmt: str) -> str:
    """A grouped comparison as 'low → high (t, p)'."""
    low, high = g["low"].get("mean", float("nan")), g["high"].get("mean", float("nan"))
    stats = f" (t {g['t']:.1f}, p {g['p']:.2g})" if "p" in g else ""
    return f"{low:{fmt}} → {high:{fmt}}{stats}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=240)
    parser.add_argument("--threads", type=int, default=1, help="threads for training and for generation")
    parser.add_argument("--model", default=str(ROOT / "runs" / "models" / "flow-shapes"),
                        help="the warm-started flow model (built by the demo recipe when missing)")
    parser.add_argument("--seed", type=int, default=0, help="run.seed of every run")
    parser.add_argument("--settings", default="", help="e.g. 11:behavior,11:proximal (default: all four)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    settings = SETTINGS
    if args.settings:
        settings = [(int(s), anchor) for s, anchor in (item.split(":") for item in args.settings.split(","))]
        unknown = [f"{s}:{a}" for s, a in settings if a not in ("behavior", "proximal")]
        if unknown:
            parser.error(f"--settings: unknown anchor in {unknown}; use behavior or proximal")
    from tether.config import load_config
    from tether.data.prepare import ensure_model

    ensure_model(load_config(ROOT / "recipes" / "flow-demo.yaml", [f"model.path={args.model}"]))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for s, anchor in settings:
            results.append(run_one(args.model, Path(tmp) / f"S{s}-{anchor}", s, anchor, args.batches,
                                   args.threads, args.seed))
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{'S':>3} {'anchor':>9} {'stale max':>9} {'mean':>5} {'reward (last ¼)':>15} "
          f"{'held-out reward':>17} {'grouping':>12}  {'outside clip vs μ, low → high (t, p)':>40}  "
          f"{'IS weight std, low → high':>26}")
    for r in results:
        print(f"{r['S']:>3} {r['anchor']:>9} {r['staleness_max']:>9g} {r['staleness_mean']:>5.2f} "
              f"{r['reward_last_quarter']:>15.3f} {r['eval_reward_first']:>8.3f} → "
              f"{r['eval_reward_last']:.3f} {r['grouping']:>12}  "
              f"{_compared(r['outside_clip_frac_high_vs_low'], '.4f'):>40}  "
              f"{_compared(r['is_weight_std_high_vs_low'], '.2e'):>26}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
