"""Mean staleness in closed form against the simulated loop and against real runs.

Part 1 sweeps recipes in virtual time (``tether plan``'s loop): the three publication rules (lazy:
drain, the default; idle: ``async.sync_when_idle``; eager: ``async.inflight_update=keep``), both
regimes (ρ from 0.2, rollout-bound, to 12, train-bound: the update's time varied against a batch's
generation time), the concurrency C (1, 2, 4 engines; ``async.max_inflight`` 1, 2, 4, 8) and the
queue q (S = 1, 2, 4, 8). For each rule it prints the mean and largest |closed form − simulated| of
Tether's form and of Applied Compute's queueing forms (``tether.loop.closed_form``), overall and
by regime, Tether's also over the recipes where ``tether plan`` prints it (not withheld), and a few
rows.

Part 2 (``--runs``) trains a tiny model for real under four recipes and prints, for each, the
measured mean staleness beside the simulated one (the run's recipe with its measured timings) and
the closed forms: what ``tether report`` prints for a run.

    python benchmarks/closed_form.py [--runs] [--batches 24] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
from pathlib import Path


def sweep() -> list[dict]:
    from tether.config import load_config
    from tether.loop.closed_form import closed_forms
    from tether.loop.virtual import plan_document, simulate, timings_of

    rules = {"lazy": [], "idle": ["async.sync_when_idle=true"], "eager": ["async.inflight_update=keep"]}
    rows = []
    for (rule, extra), s, w, m, t in itertools.product(rules.items(), [1, 2, 4, 8], [1, 2, 4], [1, 2, 4, 8],
                                                       [0.1, 0.3, 0.6, 1.2, 3.0]):
        cfg = load_config(None, [f"async.max_staleness={s}", f"rollout.num_workers={w}",
                                 f"async.max_inflight={m}", "plan.gen_time=1", f"plan.train_time={t}",
                                 "plan.sync_time=0", "train.num_batches=200", *extra])
        sim = plan_document(simulate(cfg.budget(), timings_of(cfg), num_groups=cfg.rollout.batch_size,
                                     group_size=cfg.rollout.group_size))["summary"]["mean_staleness_batches"]
        form = closed_forms(cfg, gen_time=1.0, train_time=t, sync_time=0.0)
        ac = form["applied_compute"]
        rows.append({"rule": rule, "S": s, "workers": w, "max_inflight": m, "train_time": t,
                     "rho": ac["rho"], "regime": ac["regime"], "C_over_B": ac["C"] / ac["B"], "q": ac["q"],
                     "simulated": sim, "tether": form["mean_staleness_batches"],
                     "tether_printed": form["withheld"]["tether"] is None,
                     "applied_compute": ac["mean_staleness_batches"]})
    return rows


def errors(rows: list[dict], key: str) -> tuple[float, float]:
    gaps = [abs(r[key] - r["simulated"]) for r in rows]
    return statistics.fmean(gaps), max(gaps)


BANDS = (("all", 0.0, float("inf")), ("rho < 0.8", 0.0, 0.8), ("0.8 - 1.5", 0.8, 1.5),
         ("rho >= 1.5", 1.5, float("inf")))
"""Rollout-bound, near balance (where the regime changes), train-bound."""


def print_sweep(rows: list[dict]) -> None:
    print(f"closed form against the simulated loop (mean staleness in batches; {len(rows) // 3} "
          "recipes a rule)")
    print(f"{'rule':6s} {'rho':14s} {'n':>4s}  {'Tether: mean |err|':>19s} {'max':>6s}   "
          f"{'printed: n':>10s} {'mean |err|':>10s} {'max':>6s}   "
          f"{'Applied Compute: mean |err|':>28s} {'max':>6s}")
    for rule in ("lazy", "idle", "eager"):
        for regime, low, high in BANDS:
            part = [r for r in rows if r["rule"] == rule and low <= r["rho"] < high]
            if not part:
                continue
            tm, tx = errors(part, "tether")
            am, ax = errors(part, "applied_compute")
            shown = [r for r in part if r["tether_printed"]]
            pm, px = errors(shown, "tether") if shown else (float("nan"), float("nan"))
            print(f"{rule:6s} {regime:14s} {len(part):4d}  {tm:19.3f} {tx:6.2f}   {len(shown):10d} "
                  f"{pm:10.3f} {px:6.2f}   {am:28.3f} {ax:6.2f}")
    print("\nsome rows (S=4, 2 engines, max_inflight 4):")
    print(f"{'rule':6s} {'rho':>5s} {'C/B':>4s} {'q':>3s}  {'simulated':>9s} {'Tether':>7s} {'AC':>6s}")
    for r in rows:
        if r["S"] == 4 and r["workers"] == 2 and r["max_inflight"] == 4:
            print(f"{r['rule']:6s} {r['rho']:5.2f} {r['C_over_B']:4.0f} {r['q']:3.0f}  {r['simulated']:9.2f} "
                  f"{r['tether']:7.2f} {r['applied_compute']:6.2f}")


REWARD = Path(__file__).resolve()


def varied_reward(prompt: str, completion: str, answer: str, fields) -> float:
    """A reward that varies within a group of a random model's samples (so every batch commits its
    updates and the publication schedule is the recipe's), by the completion's length."""
    return (len(completion) % 3) / 2


RUNS = {
    "lazy S=1": ["async.max_staleness=1", "async.max_inflight=2"],
    "lazy S=3": ["async.max_staleness=3", "async.max_inflight=4"],
    "idle S=2": ["async.max_staleness=2", "async.max_inflight=3", "async.sync_when_idle=true"],
    "keep S=2": ["async.max_staleness=2", "async.max_inflight=3", "async.inflight_update=keep"],
}


def real_runs(batches: int) -> list[dict]:
    import torch

    from tether.config import load_config
    from tether.data.tiny_model import init_model
    from tether.runtime.report import staleness_forms
    from tether.runtime.run import train

    torch.set_num_threads(1)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        init_model(model, arch="qwen3", size="tiny", seed=0)
        for name, extra in RUNS.items():
            cfg = load_config(None, [
                f"model.path={model}", "data.task=arithmetic", f"reward.function={REWARD}:varied_reward",
                "data.num_eval=10", "rollout.batch_size=4",
                "rollout.group_size=8", "rollout.max_new_tokens=6", f"train.num_batches={batches}",
                "train.drop_zero_std=false", "eval.interval=0", "checkpoint.interval=0", *extra])
            run = Path(tmp) / name.replace(" ", "_").replace("=", "")
            train(cfg, run, progress_plain=True)
            forms = staleness_forms(run)
            out.append({"recipe": name, "measured": forms["measured_batches"],
                        "simulated": forms["simulated_batches"],
                        "tether": forms["closed_form"]["mean_staleness_batches"],
                        "rule": forms["closed_form"]["rule"],
                        "applied_compute": forms["closed_form"]["applied_compute"]["mean_staleness_batches"],
                        "rho": forms["closed_form"]["applied_compute"]["rho"], **forms["timings"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", action="store_true", help="also train four real runs and compare them")
    ap.add_argument("--batches", type=int, default=24, help="rollout batches of each real run")
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args()
    rows = sweep()
    runs = real_runs(ns.batches) if ns.runs else []
    if ns.json:
        print(json.dumps({"sweep": rows, "runs": runs}, indent=2))
        return
    print_sweep(rows)
    if runs:
        print("\nreal runs (tiny model, arithmetic prompts, a length reward; timings measured; mean "
              "staleness in batches):")
        print(f"{'recipe':9s} {'rule':5s} {'rho':>5s}  {'measured':>8s} {'simulated':>9s} {'Tether':>7s} "
              f"{'AC':>6s}")
        for r in runs:
            print(f"{r['recipe']:9s} {r['rule']:5s} {r['rho']:5.2f}  {r['measured']:8.2f} "
                  f"{r['simulated']:9.2f} {r['tether']:7.2f} {r['applied_compute']:6.2f}")


if __name__ == "__main__":
    main()
