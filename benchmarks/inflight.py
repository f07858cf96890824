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
generation and training times and mean completion length, each sequence's length modeled
(plan.mean_length), with recompute's prefill priced by a measurement on the built-in engine in the
same run (plan.prefill_cost). Target (issue 16): keep ≥ 1.25× drain's samples/s where
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


def planned(cfg, timings_from: dict, prefill_cost: float) -> dict:
    """``tether plan``'s summary for ``cfg`` from a drain run's measured times and mean completion
    length (each sequence modeled: plan.mean_length, plan.prefill_cost)."""
    from tether.loop import Timings, simulate, summarize

    t = timings_from
    timings = Timings(gen_time=t["gen_s"], train_time=t["train_s"], sync_time=t["publish_s"], seed=0,
                      mean_length=t["length_mean"], max_length=cfg.rollout.max_new_tokens,
                      prefill_cost=prefill_cost)
    return summarize(simulate(cfg.budget(), timings, num_groups=cfg.rollout.batch_size,
                              group_size=cfg.rollout.group_size))


def measure_prefill_cost(model_dir: Path, max_new: int, repeats: int = 5) -> float:
    """recompute's price in the planner's unit: the built-in engine samples 4 prompts × 8 to
    ``max_new`` tokens (no stop token), with and without a switch (the same weights bound again)
    at step k = max_new / 2; the extra time over k decode steps is what one prefix token costs,
    in decode steps (plan.prefill_cost)."""
    import time

    import torch

    from tether.control.inflight import RECOMPUTE
    from tether.modeling import load_causal_lm, unique_parameters
    from tether.rollout.engines.torch.engine import TorchEngine
    from tether.vocabulary import SamplingParams

    torch.set_num_threads(1)
    model, tok = load_causal_lm(model_dir)
    engine = TorchEngine(model, pad_id=tok.pad_token_id, stop_ids=[])
    weights = {k: v.clone() for k, v in unique_parameters(model).items()}
    prompts = [tok.encode(f"{a}+{a + 7}=") for a in range(10, 14)]
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0)
    k = max_new // 2

    def timed(switch_at: int | None) -> float:
        calls = [0]

        def poll():
            calls[0] += 1
            if calls[0] != switch_at:
                return None
            engine.bind(weights, engine.version + 1)
            return engine.version

        engine.watch(poll, RECOMPUTE)
        t0 = time.perf_counter()
        engine.generate(prompts, samples_per_prompt=8, params=params, seed=0)
        return time.perf_counter() - t0

    timed(None)  # warm up
    base = statistics.median(timed(None) for _ in range(repeats))
    switched = statistics.median(timed(k) for _ in range(repeats))
    return max(0.0, (switched - base) / (k * base / max_new))


def measure(batches: int, max_new: int, repeats: int) -> dict:
    from transformers.utils import logging as hf_logging

    from tether.data.tiny_model import init_model

    hf_logging.disable_progress_bar()
    tmp = Path(tempfile.mkdtemp())
    init_model(tmp / "model", size="small", seed=0)
    (tmp / "reward.py").write_text(REWARD)
    prefill_cost = measure_prefill_cost(tmp / "model", max_new)
    out: dict = {"batches": batches, "max_new_tokens": max_new, "repeats": repeats,
                 "prefill_cost": prefill_cost, "settings": {}}
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
        plan_drain = planned(drain["cfg"], drain, prefill_cost)["mean_step_time_s"]
        for key, m in runs.items():
            plan = planned(m.pop("cfg"), drain, prefill_cost)
            step = plan["mean_step_time_s"]
            out["settings"][key] = m | {
                "samples_per_s_all": [t["samples_per_s"] for t in tries[key]],
                "vs_drain": m["samples_per_s"] / drain["samples_per_s"],
                "plan_step_s": step,
                "plan_vs_drain": plan_drain / step,
                "plan_error": abs(step - m["step_s"]) / m["step_s"],
                "plan_token_staleness_updates": plan["mean_token_staleness_updates"],
                "plan_wasted_tokens_per_batch": plan.get("wasted_tokens_per_batch", 0.0),
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
          f"samples, up to {r['max_new_tokens']} new tokens, 1 thread each side; recompute's prefill "
          f"measured at {r['prefill_cost']:.3f} decode steps per prefix token")
    print(f"{'setting':>18}{'samples/s':>11}{'vs drain':>10}{'plan':>8}{'plan err':>10}{'T idle':>8}"
          f"{'stale':>7}{'tok stale':>10}{'spanning':>10}{'wasted':>8}{'gen s':>7}{'train s':>8}"
          f"{'length':>8}")
    for key, m in r["settings"].items():
        plan, err = f"{m['plan_vs_drain']:.2f}×", f"{m['plan_error']:.1%}"
        print(f"{key:>18}{m['samples_per_s']:>11.1f}{m['vs_drain']:>9.2f}×{plan:>8}{err:>10}"
              f"{m['trainer_idle_fraction']:>8.0%}{m['staleness_batches']:>7.2f}"
              f"{m['token_staleness_updates']:>10.2f}"
              f"{m['multi_version_seq_frac']:>10.0%}{m['wasted_tokens_per_batch']:>8.0f}{m['gen_s']:>7.3f}"
              f"{m['train_s']:>8.3f}{m['length_mean']:>8.1f}")
    print("plan: tether plan's speed-up over drain from the drain run's measured times and mean "
          "completion length, each sequence modeled; plan err: its step time against the measured; "
          "tok stale: mean staleness of the tokens, in updates; spanning: sequences generated "
          "under more than one version; length: mean completion tokens (abort favours short ones: a "
          "long sequence is the likeliest to be cut by a publication and sampled again)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
