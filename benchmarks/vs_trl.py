"""Tether against TRL's GRPOTrainer: samples/s and held-out accuracy after the same samples.

Same warm-started model (identical initial weights), tokenizer, prompts (2-digit addition),
group size, prompts per step, maximum completion length, learning rate (constant), loss (DAPO's
token-mean clipped objective, ε 0.2 / 0.28, no KL), one update per batch, and number of steps.
TRL runs in one process with both cores. Tether at S = 0 (nothing overlaps) also gives each phase
both cores. At S = 1 (with idle syncs, ``async.sync_when_idle``, so the generator is never
starved) training and generation run at the same time: ``tether_async`` gives the trainer two
threads and the worker one (the faster split here: the worker is busy for a small part of each
step), ``tether_async_1_1`` one core each. Time is
the training loop's own (TRL: ``trainer.train()``; Tether: the sum of step times less
evaluation), so start-up and evaluation count for neither. Zero-variance groups stay in the loss
on both sides (TRL keeps them).

Targets (issue 7): Tether S = 0 at least 1.0× TRL's samples/s, S = 1 at least 1.8×, with
held-out accuracy after the same samples no worse than TRL's beyond run-to-run noise.

    pip install 'tether[bench]'        # TRL is an optional benchmark dependency
    python benchmarks/vs_trl.py [--quick] [--steps N] [--seeds 0,1] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

PROMPTS_PER_STEP, GROUP, MAX_NEW, LR = 8, 16, 6, 1e-4


def demo_config(model_dir: Path, *extra: str):
    from tether.config import load_config

    return load_config(Path(__file__).resolve().parents[1] / "recipes" / "demo.yaml", [
        f"model.path={model_dir}", f"rollout.batch_size={PROMPTS_PER_STEP}", f"rollout.group_size={GROUP}",
        f"rollout.max_new_tokens={MAX_NEW}", f"train.lr={LR}", "train.algorithm=dapo",
        "train.lr_schedule=constant", "train.min_lr_ratio=0",  # as TRL's side (lr_scheduler_type)
        "train.drop_zero_std=false",
        "checkpoint.interval=0", *extra])


def run_tether(model_dir: Path, s: int, steps: int, seed: int, out: Path, *, train_threads: int,
               worker_threads: int) -> dict:
    from tether.runtime.run import train

    cfg = demo_config(model_dir, f"async.max_staleness={s}", f"async.max_inflight={s + 1}",
                      f"async.sync_when_idle={'true' if s > 0 else 'false'}",
                      f"train.num_batches={steps}", f"eval.interval={steps}", f"run.seed={seed}",
                      f"train.threads={train_threads}", f"rollout.threads_per_worker={worker_threads}")
    summary = train(cfg, out, progress_plain=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # The training loop's own time, like TRL's trainer.train(): no start-up, no evaluation.
    loop_s = sum(r["time/step"] - r["time/eval"] for r in rows)
    return {"samples_per_s": steps * PROMPTS_PER_STEP * GROUP / loop_s,
            "wall_s": loop_s, "pass_at_1": summary["eval_pass_at_1_last"],
            "reward_last": statistics.fmean(r["reward/mean"] for r in rows[-max(1, steps // 5):])}


def run_trl(model_dir: Path, steps: int, seed: int, out: Path) -> dict:
    import datasets
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from tether.data.rewards import scorer
    from tether.data.source import resolve_data
    from tether.families.text.evaluate import Evaluator
    from tether.modeling import load_causal_lm
    from tether.vocabulary import Example, SamplingParams

    torch.set_num_threads(2)
    cfg = demo_config(model_dir, f"run.seed={seed}")
    model, tok = load_causal_lm(model_dir)
    data = resolve_data(cfg.data, tok, seed=seed)
    score = scorer("task", task="arithmetic")
    train_set = datasets.Dataset.from_list([{"prompt": e.prompt, "answer": e.answer} for e in data.train])

    def reward(completions, answer, **_):
        return [score(Example("", a), c) for c, a in zip(completions, answer, strict=True)]

    args = GRPOConfig(
        output_dir=str(out), max_steps=steps, learning_rate=LR, lr_scheduler_type="constant",
        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP, num_generations=GROUP,
        max_completion_length=MAX_NEW, temperature=1.0, loss_type="dapo", beta=0.0, epsilon=0.2,
        epsilon_high=0.28, num_iterations=1, use_cpu=True, bf16=False, report_to="none",
        save_strategy="no", logging_steps=max(1, steps // 5), seed=seed, disable_dropout=True,
    )
    rewards: list[float] = []

    def logged_reward(completions, answer, **kw):
        values = reward(completions, answer, **kw)
        rewards.append(sum(values) / len(values))
        return values

    trainer = GRPOTrainer(model=model, reward_funcs=logged_reward, args=args, train_dataset=train_set,
                          processing_class=tok)
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    evaluator = Evaluator(trainer.model, tok, data.eval, score, stop_text=data.stop_text,
                          params=SamplingParams(max_new_tokens=MAX_NEW), seed=seed)
    return {"samples_per_s": steps * PROMPTS_PER_STEP * GROUP / wall, "wall_s": wall,
            "pass_at_1": evaluator(steps)["eval/pass_at_1"],
            "reward_last": statistics.fmean(rewards[-max(1, steps // 5):])}


def measure(steps: int, seeds: list[int]) -> dict:
    from transformers.utils import logging as hf_logging

    from tether.data.prepare import ensure_model

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    tmp = Path(tempfile.mkdtemp())
    model_dir = ensure_model(demo_config(tmp / "model", "model.create_if_missing=true"))
    systems: dict[str, list[dict]] = {"trl": [], "tether_sync": [], "tether_async": [],
                                      "tether_async_1_1": []}
    for seed in seeds:
        systems["trl"].append(run_trl(model_dir, steps, seed, tmp / f"trl-{seed}"))
        # S = 0: nothing overlaps, so each phase uses both cores, as TRL's does.
        systems["tether_sync"].append(run_tether(model_dir, 0, steps, seed, tmp / f"s0-{seed}",
                                                 train_threads=2, worker_threads=2))
        # S = 1 with idle syncs: the trainer on both cores and the worker on one (the faster
        # split, measured), and the one-core-each split beside it.
        systems["tether_async"].append(run_tether(model_dir, 1, steps, seed, tmp / f"s1-{seed}",
                                                  train_threads=2, worker_threads=1))
        systems["tether_async_1_1"].append(run_tether(model_dir, 1, steps, seed, tmp / f"s1-11-{seed}",
                                                      train_threads=1, worker_threads=1))
    out: dict = {"steps": steps, "seeds": seeds, "samples_per_step": PROMPTS_PER_STEP * GROUP, "systems": {}}
    for name, runs in systems.items():
        out["systems"][name] = {
            "samples_per_s": statistics.fmean(r["samples_per_s"] for r in runs),
            "pass_at_1_mean": statistics.fmean(r["pass_at_1"] for r in runs),
            "pass_at_1_spread": (max(r["pass_at_1"] for r in runs) - min(r["pass_at_1"] for r in runs)),
            "reward_last_mean": statistics.fmean(r["reward_last"] for r in runs),
            "runs": runs,
        }
    trl = out["systems"]["trl"]["samples_per_s"]
    out["speedup_vs_trl"] = {"sync": out["systems"]["tether_sync"]["samples_per_s"] / trl,
                             "async": out["systems"]["tether_async"]["samples_per_s"] / trl}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="40 steps, one seed")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        import trl  # noqa: F401
    except ImportError:
        print("this benchmark needs TRL: pip install 'tether[bench]'", file=sys.stderr)
        return 2
    steps, seeds = (40, [0]) if a.quick else (a.steps, [int(s) for s in a.seeds.split(",")])
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):  # TRL prints its logs; stdout is for the figures
        r = measure(steps, seeds)
    if a.json:
        print(json.dumps(r))
        return 0
    print(f"{steps} steps × {r['samples_per_step']} samples, seeds {seeds}")
    print(f"{'system':<14}{'samples/s':>11}{'vs TRL':>8}{'pass@1':>8}{'spread':>8}{'reward (last 20%)':>19}")
    for name, m in r["systems"].items():
        ratio = m["samples_per_s"] / r["systems"]["trl"]["samples_per_s"]
        print(f"{name:<14}{m['samples_per_s']:>11.1f}{ratio:>7.2f}×{m['pass_at_1_mean']:>8.3f}"
              f"{m['pass_at_1_spread']:>8.3f}{m['reward_last_mean']:>19.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
