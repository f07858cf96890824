"""The two guidance gradients of the flow family side by side: ``flow.cfg_grad`` full against
conditional.

With classifier-free guidance the training forward computes v = v_u + w·(v_c − v_u). ``full``
differentiates both branches (the gradient of the guided velocity the sampler used; Flow-GRPO's
newer upstream); ``conditional`` detaches v_u (the reference at ac4c86e). Both give the same
log-probabilities; only the update differs. This measures, on the flow demo's model warm-started
with condition dropout (``flow.init_cond_dropout=0.1``, so the unconditional branch is learned),
the policy gradient of guided trajectories' GRPO loss at ratio 1, −Σ A·log π / (N·T), under each:
their cosine and norms, per batch of fresh trajectories (8 prompts × 8 images × 8 SDE steps,
scored by the shapes verifier). With ``--learn N`` it also trains the demo recipe, guided, for N
batches under each and reports the held-out reward (guided ODE images) before and after.

    python benchmarks/flow_cfg_grad.py [--batches 4] [--guidance 4.5] [--learn 0] [--json] [KEY=VALUE ...]

KEY=VALUE settings go on top of the demo recipe (``warmstart.max_steps=5`` builds a model in
seconds, for a smoke test).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BUILD = ("flow.init_cond_dropout=0.1",)  # the demo's model, with a learned unconditional branch


def gradients(model, batch, cfg_grad: str, advantages: torch.Tensor) -> torch.Tensor:
    """The flattened gradient of −mean(A·log π) over every step, under ``cfg_grad``."""
    from tether.families.flow.learn import FlowPolicy

    model.zero_grad()
    logp = FlowPolicy(cfg_grad=cfg_grad).forward(model, batch)[0]  # (N, T)
    (-(advantages[:, None] * logp).mean()).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def guided_batch(model, cfg, prompts: list[str], seed: int):
    """Fresh guided trajectories of ``prompts`` × G images, their rewards and GRPO advantages."""
    from tether.families.flow import scenes
    from tether.families.flow.learn import to_flow_batch
    from tether.families.flow.policy import sample
    from tether.families.flow.rollout import FlowBatch, sampling_of

    g, sampling = cfg.rollout.group_size, sampling_of(cfg)
    words = torch.tensor([scenes.encode(p) for p in prompts])
    negative = model.encode_prompts([cfg.flow.negative_prompt])
    drawn = sample(model, {"words": words.repeat_interleave(g, 0)}, sampling,
                   generator=torch.Generator().manual_seed(seed), negative=negative)
    latents, logps = drawn.latents, drawn.logprobs
    images = model.decode(latents[:, -1])
    rewards = torch.tensor([scenes.verify(prompts[i // g], image, "", {}) for i, image in enumerate(images)])
    grouped = rewards.view(-1, g)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()
    batch = to_flow_batch(FlowBatch(
        positions=list(range(len(prompts))), prompts=prompts, cond={"words": words.numpy()},
        latents=latents.numpy(), logprobs=logps.numpy(), versions=[[0] * sampling.steps] * len(rewards),
        rewards=rewards.tolist(), times=sampling.times().numpy(), noise_level=sampling.noise_level,
        group_size=g, negative={k: v.numpy() for k, v in negative.items()},
        guidance_scale=sampling.guidance_scale))
    return batch, rewards, advantages


def learn(model: str, guidance: float, batches: int, threads: int,
          overrides: tuple[str, ...] = ()) -> dict[str, dict[str, float]]:
    from tether.config import load_config
    from tether.runtime.run import train

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("full", "conditional"):
            cfg = load_config(ROOT / "recipes" / "flow-demo.yaml", [
                f"model.path={model}", f"flow.guidance_scale={guidance}", f"flow.cfg_grad={mode}", *BUILD,
                f"train.num_batches={batches}", f"eval.interval={batches}", "checkpoint.interval=0",
                f"train.threads={threads}", *overrides])
            summary = train(cfg, Path(tmp) / mode, progress_plain=True)
            evals = summary["evals"]
            out[mode] = {"eval_reward_first": evals[0]["eval/reward_mean"],
                         "eval_reward_last": evals[-1]["eval/reward_mean"], "wall_s": summary["wall_s"]}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=4, help="batches of fresh trajectories measured")
    parser.add_argument("--guidance", type=float, default=4.5, help="flow.guidance_scale w")
    parser.add_argument("--learn", type=int, default=0, help="also train this many batches under each")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default=str(ROOT / "runs" / "models" / "flow-shapes-cfg"),
                        help="the warm-started flow model (built by the demo recipe with condition "
                             "dropout 0.1 when missing)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="settings on top of the recipe")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from tether.config import load_config
    from tether.data.prepare import ensure_model
    from tether.families.flow.model import FlowModel
    from tether.families.flow.task import SHAPES

    cfg = load_config(ROOT / "recipes" / "flow-demo.yaml",
                      [f"model.path={args.model}", f"flow.guidance_scale={args.guidance}", *BUILD,
                       f"train.threads={args.threads}", *args.overrides])
    ensure_model(cfg)
    model = FlowModel.from_pretrained(args.model)
    rows = []
    for b in range(args.batches):
        prompts = [e.prompt for e in SHAPES.examples("train", cfg.rollout.batch_size, seed=100 + b)]
        batch, rewards, advantages = guided_batch(model, cfg, prompts, seed=b)
        full = gradients(model, batch, "full", advantages)
        cond = gradients(model, batch, "conditional", advantages)
        rows.append({"batch": b, "reward_mean": float(rewards.mean()),
                     "cosine": float(torch.nn.functional.cosine_similarity(full, cond, dim=0)),
                     "norm_full": float(full.norm()), "norm_conditional": float(cond.norm())})
    result = {"guidance": args.guidance, "batches": rows,
              "learn": learn(args.model, args.guidance, args.learn, args.threads, tuple(args.overrides))
                       if args.learn else None}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"w = {args.guidance:g}: policy gradient at ratio 1, full (both branches) against conditional "
          f"(v_u detached)")
    print(f"{'batch':>5} {'reward':>7} {'cosine':>7} {'‖g‖ full':>10} {'‖g‖ conditional':>16}")
    for r in rows:
        print(f"{r['batch']:>5} {r['reward_mean']:>7.3f} {r['cosine']:>7.3f} {r['norm_full']:>10.4f} "
              f"{r['norm_conditional']:>16.4f}")
    keys = ("reward_mean", "cosine", "norm_full", "norm_conditional")
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
    print(f"{'mean':>5} {mean['reward_mean']:>7.3f} {mean['cosine']:>7.3f} {mean['norm_full']:>10.4f} "
          f"{mean['norm_conditional']:>16.4f}")
    for mode, r in (result["learn"] or {}).items():
        print(f"learn {mode}: held-out reward {r['eval_reward_first']:.3f} → {r['eval_reward_last']:.3f} "
              f"({r['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
