"""How far each denoising step of the flow demo's policy moves in a number of updates.

The staleness of a flow batch is not spread evenly over its steps: a step's log-probability is a
Gaussian's with std σ_t·√|dt|, and a small std (the last, low-noise steps) makes the density
sensitive to any move of the step's mean. This trains the flow demo's warm-started model
on-policy (S = 0, two updates per batch, a constant learning rate) for ``--batches`` batches,
then samples fresh trajectories from the warm start (μ) and reports, per step, the std of its
Gaussian, the mean log-ratio log π/μ of the trained model against it, and the spread and minimum
of π/μ — the weight a batch that many updates stale gets at each step under the proximal anchor
(π_old/μ), and what the behavior anchor's ratio sees.

    python benchmarks/flow_step_drift.py [--batches 11] [--prompts 32] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=11, help="batches trained (two updates each)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts of the measured trajectories (× 8)")
    parser.add_argument("--model", default=str(ROOT / "runs" / "models" / "flow-shapes"),
                        help="the warm-started flow model (built by the demo recipe when missing)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from tether.config import load_config
    from tether.data.prepare import ensure_model
    from tether.families.flow import scenes
    from tether.families.flow.model import FlowModel
    from tether.families.flow.policy import sample, step_logprobs
    from tether.families.flow.rollout import sampling_of
    from tether.families.flow.task import SHAPES
    from tether.runtime.run import train

    cfg = load_config(ROOT / "recipes" / "flow-demo.yaml", [
        f"model.path={args.model}", "async.max_staleness=0", "async.max_inflight=1",
        "train.updates_per_batch=2", f"train.num_batches={args.batches}", "train.lr_schedule=constant",
        "train.min_lr_ratio=0", f"eval.interval={args.batches}", f"checkpoint.interval={args.batches}"])
    ensure_model(cfg)
    sampling = sampling_of(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        train(cfg, Path(tmp) / "run", progress_plain=True)
        trained = FlowModel.from_pretrained(Path(tmp) / "run" / "checkpoints" / f"step-{args.batches:06d}"
                                            / "learner" / "model").eval()
    behavior = FlowModel.from_pretrained(args.model).eval()
    words = torch.tensor([scenes.encode(e.prompt) for e in SHAPES.examples("train", args.prompts, seed=3)])
    words = words.repeat_interleave(8, 0)
    cond = {"words": words}
    latents = sample(behavior, cond, sampling, generator=torch.Generator().manual_seed(0)).latents
    with torch.no_grad():
        mu, _, stds = step_logprobs(behavior, latents, cond, sampling.times(), sampling.noise_level,
                                    sde_type=sampling.sde_type)
        pi, _, _ = step_logprobs(trained, latents, cond, sampling.times(), sampling.noise_level,
                                 sde_type=sampling.sde_type)
    log_ratio = pi - mu  # (N, T)
    ratio = log_ratio.exp()
    rows = [{"step": k, "std": float(stds[0, k]), "mean_log_ratio": float(log_ratio[:, k].mean()),
             "ratio_std": float(ratio[:, k].std()), "ratio_min": float(ratio[:, k].min())}
            for k in range(sampling.steps)]
    if args.json:
        print(json.dumps({"updates": 2 * args.batches, "steps": rows}, indent=2))
        return 0
    print(f"after {2 * args.batches} updates, on {len(words)} trajectories of the warm start")
    print(f"{'step':>4}{'std':>8}{'mean log π/μ':>15}{'π/μ std':>10}{'π/μ min':>10}")
    for r in rows:
        print(f"{r['step']:>4}{r['std']:>8.3f}{r['mean_log_ratio']:>15.4f}{r['ratio_std']:>10.4f}"
              f"{r['ratio_min']:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
