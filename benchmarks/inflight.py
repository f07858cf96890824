"""Publishing without draining (``async.inflight_update``), measured side by side in one run.

Each setting runs ``--repeats`` times, the settings taking turns, and reports its median run.

The same model and workload are trained with drain (the default), drain with idle syncs, keep,
recompute and abort, at S = 1 and S = 2, one core for training and one for generation. The
workload has a long tail of completion lengths: the `small` model untrained, sampling at
temperature 1 until the task's stop text or ``--max-new-tokens``, so lengths are roughly
geometric; a synthetic reward that varies within each group (the model is untrained and would
never be right) makes every update commit, so weights change at every step.

Reported per setting: samples/s and its ratio to drain at the same S, the trainer's idle
fraction (time waiting for a rollout batch / step time), the mean staleness of the batches (their
oldest token) and of their tokens, the share of sequences that span versions, tokens wasted by
abort, and ``tether plan``'s prediction of the step time from the drain run's own measured
generation and training times (drain and keep; the planner does not model recompute's prefill or
abort's regeneration yet, and says so). Target (issue 16): keep ≥ 1.25× drain's samples/s where
the planner predicts ≥ 1.3×, measured within 10% of the prediction.

    python benchmarks/inflight.py [--quick] [--batches N] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REWARD = '''
def reward(prompt, completion, answer, fields):
    """Varies within a group whatever the model: every update has something to learn from."""
    return float(len(completion) % 3 == 0)
'''

SETTINGS = [("drain", False), ("drain", True), ("keep", False), ("recompute", False), ("abort", False)]


def run_one(model_dir: Path, reward: Path, s: int, mode: str, idle: bool, batches: int, max_new: int,
            out: Path) -> dict:
    from tether.config import load_config
    from tether.runtime.run import train

    cfg = load_config(None, [
        f"model.path={model_dir}", "data.task=arithmetic", "data.difficulty=2", "data.num_eval=20",
        f"reward.function={reward}:reward", "rollout.batch_size=4", "rollout.group_size=8",
        f"rollout.max_new_tokens={max_new}", f"async.max_staleness={s}", f"async.max_inflight={s + 1}",
        f"train.num_batches={batches}", "train.lr=1e-4", "eval.interval=0", "checkpoint.interval=0",
        f"async.sync_when_idle={str(idle).lower()}", f"async.inflight_update={mode}",
    ])
    train(cfg, out, progress_plain=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][2:]
    mean = lambda key, default=0.0: statistics.fmean(r.get(key, default) for r in rows)  # noqa: E731
    gens = [r["time/generate"] for r in rows]
    steps = [r["time/step"] for r in rows]
    return {
        "samples_per_s": sum(32 for _ in rows) / sum(steps), "step_s": statistics.fmean(steps),
        "gen_s": statistics.fmean(gens), "gen_cv": statistics.pstdev(gens) / statistics.fmean(gens),
        "train_s": mean("time/train"), "publish_s": mean("sync/publish_s"),
        "trainer_idle_fraction": sum(r["time/generate_wait"] for r in rows) / sum(steps),
        "staleness_batches": mean("staleness/batches"),
        "token_staleness_updates": mean("staleness/token_mean_updates"),
        "multi_version_seq_frac": mean("staleness/multi_version_seq_frac"),
        "wasted_tokens_per_batch": mean("rollout/wasted_tokens"),
        "length_mean": mean("response/length_mean"), "truncated_frac": mean("response/truncated_frac"),
        "cfg": cfg,
    }


def planned_step(cfg, timings_from: dict) -> float:
    from tether.loop import Timings, simulate, summarize

    t = timings_from
    sim = simulate(cfg.budget(), Timings(gen_time=t["gen_s"], gen_jitter=t["gen_cv"], train_time=t["train_s"],
                                         sync_time=t["publish_s"], seed=0))
    return summarize(sim)["mean_step_time_s"]


def measure(batches: int, max_new: int, repeats: int) -> dict:
    from transformers.utils import logging as hf_logging

    from tether.data.tiny_model import init_model

    hf_logging.disable_progress_bar()
    tmp = Path(tempfile.mkdtemp())
    init_model(tmp / "model", size="small", seed=0)
    (tmp / "reward.py").write_text(REWARD)
    out: dict = {"batches": batches, "max_new_tokens": max_new, "repeats": repeats, "settings": {}}
    for s in (1, 2):
        # the settings take turns, ``repeats`` rounds: the shared machine's drift reaches them alike;
        # each setting's figures are those of its median run by samples/s
        tries: dict[str, list[dict]] = {}
        for round_ in range(repeats):
            for mode, idle in SETTINGS:
                key = f"S={s} {mode}{'+idle' if idle else ''}"
                where = tmp / f"{key.replace(' ', '-').replace('=', '')}-{round_}"
                tries.setdefault(key, []).append(run_one(tmp / "model", tmp / "reward.py", s, mode, idle,
                                                         batches, max_new, where))
        runs = {key: sorted(t, key=lambda m: m["samples_per_s"])[len(t) // 2] for key, t in tries.items()}
        drain = runs[f"S={s} drain"]
        plan_drain = planned_step(drain["cfg"], drain)
        for key, m in runs.items():
            cfg = m.pop("cfg")
            plan = planned_step(cfg, drain) if cfg.async_.inflight_update in ("drain", "keep") else None
            out["settings"][key] = m | {
                "samples_per_s_all": [t["samples_per_s"] for t in tries[key]],
                "vs_drain": m["samples_per_s"] / drain["samples_per_s"],
                "plan_step_s": plan,
                "plan_vs_drain": plan_drain / plan if plan else None,
                "plan_error": abs(plan - m["step_s"]) / m["step_s"] if plan else None,
            }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="40 batches per setting")
    ap.add_argument("--batches", type=int, default=120)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of every setting, interleaved")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    r = measure(40 if a.quick else a.batches, a.max_new_tokens, 1 if a.quick else a.repeats)
    if a.json:
        print(json.dumps(r))
        return 0
    print(f"{r['batches']} batches per setting, median of {r['repeats']} interleaved runs, 4 prompts × 8 "
          f"samples, up to {r['max_new_tokens']} new tokens, 1 thread each side")
    print(f"{'setting':>18}{'samples/s':>11}{'vs drain':>10}{'plan':>8}{'plan err':>10}{'T idle':>8}"
          f"{'stale':>7}{'tok stale':>10}{'spanning':>10}{'wasted':>8}{'gen s':>7}{'train s':>8}"
          f"{'length':>8}")
    for key, m in r["settings"].items():
        plan = f"{m['plan_vs_drain']:.2f}×" if m["plan_vs_drain"] else "—"
        err = f"{m['plan_error']:.1%}" if m["plan_error"] is not None else "—"
        print(f"{key:>18}{m['samples_per_s']:>11.1f}{m['vs_drain']:>9.2f}×{plan:>8}{err:>10}"
              f"{m['trainer_idle_fraction']:>8.0%}{m['staleness_batches']:>7.2f}"
              f"{m['token_staleness_updates']:>10.2f}"
              f"{m['multi_version_seq_frac']:>10.0%}{m['wasted_tokens_per_batch']:>8.0f}{m['gen_s']:>7.3f}"
              f"{m['train_s']:>8.3f}{m['length_mean']:>8.1f}")
    print("plan: tether plan's speed-up over drain from the drain run's measured times (drain and keep "
          "only); tok stale: mean staleness of the tokens, in updates; spanning: sequences generated "
          "under more than one version; length: mean completion tokens (abort favours short ones: a "
          "long sequence is the likeliest to be cut by a publication and sampled again)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
