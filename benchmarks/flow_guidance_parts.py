"""Classifier-free guidance with its two branches from different models: which branch carries RL's gain.

Guided sampling computes v = v_u + w·(v_c − v_u) from one network, the unconditional velocity
v_u (the empty prompt's) and the conditional v_c. RL moves both, since they share every weight.
This evaluates the guided ODE sampler with v_c from one model folder or checkpoint (``--cond``) and
v_u from another (``--uncond``), on ODE images of the trained and the held-out prompts, scored by
the shapes verifier as the run's evaluation scores them, with the share of each split's images
that pass each of the verifier's checks (which words a model misses, and whether it misses them
more on the held-out prompts than on those it trained on). ``--cond`` and ``--uncond`` the same
folder is the model's own guided reward.

    python benchmarks/flow_guidance_parts.py RECIPE --cond A --uncond B [--guidance 4.5] [--json] \
        [KEY=VALUE ...]

A and B: a model folder (``model.path``) or a run's checkpoint (``runs/x/checkpoints/step-000200``,
whose learner's weights are read: its EMA's where it holds them, as ``tether eval`` reads them).
KEY=VALUE settings go on top of RECIPE (its ``model.path`` is the base a checkpoint's weights
apply to). docs/benchmarks.md, "A tiny SD3 pipeline that learns",
has what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


class TwoBranches(torch.nn.Module):
    """A flow model whose guided forward takes its unconditional half from ``uncond`` and its
    conditional half from ``cond`` (``conditioning.velocity`` stacks [unconditional; conditional])."""

    def __init__(self, cond, uncond) -> None:
        super().__init__()
        self.cond, self.uncond = cond, uncond

    def forward(self, x: torch.Tensor, t: torch.Tensor, conditioning) -> torch.Tensor:
        n = x.shape[0] // 2
        first = {k: v[:n] for k, v in conditioning.items()}
        second = {k: v[n:] for k, v in conditioning.items()}
        return torch.cat([self.uncond(x[:n], t[:n], first), self.cond(x[n:], t[n:], second)])

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # latent_shape, times, encode_prompts, decode: the conditional model's
            return getattr(super().__getattr__("cond"), name)


def load(path: str, cfg):
    from tether.families.flow.model import load_flow_model
    from tether.train.learner_state import model_folder

    folder = Path(path)
    if (folder / "learner").is_dir():  # a run's checkpoint: its EMA's weights where it holds them
        folder = model_folder(folder / "learner")
    if not folder.is_dir():
        raise SystemExit(f"{path}: neither a model folder nor a checkpoint (no learner/model inside)")
    return load_flow_model(folder, cfg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("--cond", required=True, help="the model or checkpoint of the conditional branch")
    parser.add_argument("--uncond", required=True, help="the model or checkpoint of the unconditional branch")
    parser.add_argument("--guidance", type=float, default=None, help="w (default: the recipe's)")
    parser.add_argument("--examples", type=int, default=256, help="ODE images per split")
    parser.add_argument("--json", action="store_true")
    args, overrides = parser.parse_known_args(argv)
    torch.set_num_threads(1)

    from tether.config import load_config
    from tether.families.flow import scenes
    from tether.families.flow.evaluate import FlowEvaluator
    from tether.families.flow.rollout import sampling_of
    from tether.families.flow.task import SHAPES, flow_scorer

    cfg = load_config(args.recipe, overrides)
    if cfg.data.task != "shapes":
        raise SystemExit(f"data.task={cfg.data.task}: this benchmark scores the shapes task's prompts")
    w = cfg.flow.guidance_scale if args.guidance is None else args.guidance
    if w == 1.0:
        raise SystemExit("--guidance 1 uses no unconditional branch: give w above 1 (the conditional branch "
                         "alone: tether eval RECIPE flow.guidance_scale=1 --model MODEL)")
    model = TwoBranches(load(args.cond, cfg), load(args.uncond, cfg)).eval()
    sampling = dataclasses.replace(sampling_of(cfg, model.cond), guidance_scale=w)
    record = {"cond": args.cond, "uncond": args.uncond, "guidance": w, "eval_steps": cfg.flow.eval_steps,
              "checks": {}}
    score = flow_scorer(cfg)
    for split in ("train", "eval"):
        examples = SHAPES.examples(split, args.examples, seed=0)
        evaluator = FlowEvaluator(model, examples, score, eval_steps=cfg.flow.eval_steps, sampling=sampling,
                                  seed=0, negative_prompt=cfg.flow.negative_prompt)
        with torch.no_grad():  # the ODE images of the run's evaluation: the same noises
            images = evaluator.images(evaluator.cond, evaluator.seed)
        rewards = [score(e, x) for e, x in zip(examples, images, strict=True)]
        name = "held_out" if split == "eval" else "trained"
        record[name] = sum(rewards) / len(rewards)
        passed = [scenes.checks(scenes.Scene.parse(e.prompt), x)
                  for e, x in zip(examples, images, strict=True)]
        record["checks"][name] = {check: sum(c[check] for c in passed) / len(passed)
                                  for check in scenes.CHECKS}
    if args.json:
        print(json.dumps(record))
    else:
        print(f"v_c from {args.cond}, v_u from {args.uncond}, w = {w}, {args.examples} ODE images "
              f"({cfg.flow.eval_steps} steps) a split: trained prompts {record['trained']:.3f}, "
              f"held-out {record['held_out']:.3f}")
        for name, shares in record["checks"].items():
            print(f"  {name.replace('_', '-')} images passing each check: "
                  + ", ".join(f"{check} {100 * share:.1f}%" for check, share in shares.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
