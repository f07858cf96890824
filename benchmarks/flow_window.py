"""The SDE window (``flow.sde_window``) against full SDE sampling, side by side in one run.

Timing: the flow demo's batch (``recipes/flow-demo.yaml``: 8 prompts × 8 images × T = 8 steps,
the grpo preset with its KL reference) on a model of the demo's size (its weights do not change
the cost). For each window K (0 = every step an SDE step), in interleaved repeats, medians: the
rollout worker's generation (``FlowSampler.generate``: sampling, decoding, scoring) in samples/s,
and the learner's time a batch (``TorchLearner.train``, one update: the policy's and the KL
reference's forwards and the backward over the N·K recorded steps), with its share of full SDE's
beside K/T.

With ``--batches N``: also the flow demo itself from its warm-started model (built by the recipe
when missing), N batches with each window one after another, reporting each run's held-out reward
before and after (ODE images of the held-out prompts) and its wall time and samples/s.

    python benchmarks/flow_window.py [--windows 0,4,2,1] [--range 0] [--repeats 5] [--threads 2]
    python benchmarks/flow_window.py --batches 100 --windows 0,2 --range 4 [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def demo(*overrides: str):
    from tether.config import load_config

    return load_config(ROOT / "recipes" / "flow-demo.yaml", list(overrides))


def timed(fn) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of ``fn()``: on a shared machine the CPU time
    is the work done, the wall time also the waits for a core."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def median(runs: list[tuple[float, float]], which: int) -> float:
    """The median of the wall (``which`` 0) or CPU (1) seconds of ``timed`` runs."""
    return statistics.median(x[which] for x in runs)


def interleaved(arms: dict, item, repeats: int) -> tuple[dict, dict]:
    """({arm: [(wall, CPU) of each generation]}, {arm: [(wall, CPU) of each update]}): each arm's
    ``(FlowSampler, TorchLearner)`` generates ``item`` and trains one update on it, the arms in
    turn, ``repeats`` rounds after a first that warms up. The rewards are set so that every group
    varies (an update's cost does not depend on them)."""
    from tether.vocabulary import RolloutBatch

    b, g = len(item.examples), item.group_size
    gen: dict = {k: [] for k in arms}
    learn: dict = {k: [] for k in arms}
    for r in range(repeats + 1):
        for k, (sampler, learner) in arms.items():
            out = {}
            generate = timed(lambda s=sampler, o=out: o.update(batch=s.generate(item)))
            batch = out["batch"]
            batch.rewards = [float((i * 7) % 5 == 0) for i in range(b * g)]  # variance in every group
            rollout = RolloutBatch(index=0, behavior_version=0, num_groups=b, group_size=g, payload=batch)
            update = timed(lambda lrn=learner, ro=rollout: lrn.train(ro, train_version=0))
            if r:
                gen[k].append(generate)
                learn[k].append(update)
    return gen, learn


def measure(windows: list[int], span: int, repeats: int, threads: int) -> dict:
    """Generation samples/s and the learner's seconds a batch for each window, interleaved."""
    from tether.families.flow import scenes
    from tether.families.flow.model import FlowModel, FlowModelConfig
    from tether.families.flow.rollout import FlowSampler
    from tether.families.flow.task import SHAPES
    from tether.train.learner import TorchLearner
    from tether.vocabulary import SamplingParams, WorkItem

    torch.set_num_threads(threads)
    base = demo()
    torch.manual_seed(0)
    model = FlowModel(FlowModelConfig(vocab=scenes.WORDS, width=base.flow.init_width,
                                      depth=base.flow.init_depth, patch=4))
    path = Path(tempfile.mkdtemp()) / "model"
    model.save_pretrained(path)
    b, g = base.rollout.batch_size, base.rollout.group_size
    examples = SHAPES.examples("train", b, seed=0)
    item = WorkItem(batch_index=0, version=0, examples=list(enumerate(examples)), group_size=g,
                    params=SamplingParams(max_new_tokens=1), seed=0)
    arms = {}
    for k in windows:
        cfg = demo(f"model.path={path}", f"flow.sde_window={k}", f"flow.sde_window_range={span if k else 0}",
                   f"train.threads={threads}")
        arms[k] = (FlowSampler(cfg, str(path), device=torch.device("cpu")), TorchLearner(str(path), cfg))
    gen, learn = interleaved(arms, item, repeats)
    steps, first = base.flow.steps, windows[0]
    rows = []
    for k in windows:
        gs, ls, gc, lc = median(gen[k], 0), median(learn[k], 0), median(gen[k], 1), median(learn[k], 1)
        rows.append({"sde_window": k, "trained_steps": k or steps, "steps": steps,
                     "k_over_t": (k or steps) / steps,
                     "gen_s": gs, "learner_s": ls, "gen_cpu_s": gc, "learner_cpu_s": lc,
                     "gen_samples_per_s": b * g / gs, "gen_samples_per_cpu_s": b * g / gc,
                     "learner_cpu_vs_first": lc / median(learn[first], 1),
                     "gen_cpu_vs_first": gc / median(gen[first], 1),
                     "sync_samples_per_cpu_s": b * g / (gc + lc),
                     "overlapped_samples_per_cpu_s": b * g / max(gc, lc)})
    return {"threads": threads, "repeats": repeats, "range": span, "samples_per_batch": b * g, "rows": rows}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def demo_runs(windows: list[int], span: int, batches: int) -> list[dict]:
    """The flow demo for ``batches`` batches with each window: held-out reward, wall time."""
    from tether.data.prepare import ensure_model
    from tether.runtime.run import train

    out = []
    for k in windows:
        cfg = demo(f"flow.sde_window={k}", f"flow.sde_window_range={span if k else 0}",
                   f"train.num_batches={batches}", f"eval.interval={batches}",
                   f"checkpoint.interval={batches}")
        ensure_model(cfg)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            train(cfg, Path(tmp) / "run", progress_plain=True)
            wall = time.perf_counter() - t0
            evals, metrics = (_rows(Path(tmp) / "run" / name) for name in ("eval.jsonl", "metrics.jsonl"))
        out.append({"sde_window": k, "batches": batches, "wall_s": wall,
                    "samples_per_s": batches * cfg.rollout.batch_size * cfg.rollout.group_size / wall,
                    "reward_before": evals[0]["eval/reward_mean"],
                    "reward_after": evals[-1]["eval/reward_mean"],
                    "pass_before": evals[0]["eval/pass_at_1"], "pass_after": evals[-1]["eval/pass_at_1"],
                    "generate_s": statistics.mean(m["time/generate"] for m in metrics),
                    "train_s": statistics.mean(m["time/train"] for m in metrics)})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", default="0,4,2,1",
                        help="flow.sde_window values; the first is the baseline")
    parser.add_argument("--range", type=int, default=0, dest="span",
                        help="flow.sde_window_range of the windows")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", type=int, default=0,
                        help="also run the flow demo this many batches with each window")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    windows = [int(k) for k in args.windows.split(",")]
    out = {"timing": measure(windows, args.span, args.repeats, args.threads)}
    if args.batches:
        out["runs"] = demo_runs(windows, args.span, args.batches)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    t = out["timing"]
    print(f"flow demo batch ({t['samples_per_batch']} trajectories × {t['rows'][0]['steps']} steps), "
          f"{t['threads']} threads, medians of {t['repeats']}, window range {t['range'] or 'all'}; "
          "CPU seconds (wall in brackets):")
    print("  K (0 = full SDE) | generation s (samples/s) | learner s | learner vs first | K/T | "
          "samples/s: gen + learn / overlapped")
    for r in t["rows"]:
        print(f"  {r['sde_window']:>16} | {r['gen_cpu_s']:6.3f} [{r['gen_s']:6.3f}] "
              f"({r['gen_samples_per_cpu_s']:5.1f}) | {r['learner_cpu_s']:6.3f} [{r['learner_s']:6.3f}] | "
              f"{r['learner_cpu_vs_first']:16.2f} | {r['k_over_t']:.2f} | "
              f"{r['sync_samples_per_cpu_s']:.1f} / {r['overlapped_samples_per_cpu_s']:.1f}")
    for r in out.get("runs", []):
        print(f"  demo, K={r['sde_window']}, {r['batches']} batches: held-out reward "
              f"{r['reward_before']:.3f} → {r['reward_after']:.3f} (pass@1 {r['pass_before']:.1%} → "
              f"{r['pass_after']:.1%}), "
              f"{r['wall_s']:.0f} s, {r['samples_per_s']:.1f} samples/s, generate / train a batch "
              f"{r['generate_s']:.3f} / {r['train_s']:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
