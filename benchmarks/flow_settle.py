"""A control for a flow model's RL gain: what more flow matching at a lower learning rate, with no
reward at all, does to the held-out reward of the warm start RL would begin from.

A warm start that ends at a high constant rate (``warmstart.lr_schedule: constant``) stops at a
noisy point of its optimisation: any later training at a smaller rate may lift its held-out
figures, RL or not. This continues the warm start's own objective (the drawn scenes of the train
split's prompts, the recipe's condition dropout) for ``--steps`` AdamW steps at ``--lr`` and
prints the held-out reward and pass@1 of the recipe's evaluation (ODE images of the held-out
prompts, the recipe's guidance) every ``--every`` steps. An RL gain no larger than this one is not
RL's. ``--save DIR`` writes the settled model (a pipeline folder or the built-in model), from
which RL can be run as from any model.

    python benchmarks/flow_settle.py recipes/flow-sd3.yaml [--lr 3e-4] [--steps 200] [--every 50]
    python benchmarks/flow_settle.py recipes/flow-demo.yaml --lr 2e-4     # the built-in DiT

The model is the recipe's ``model.path`` (built first if missing), or ``--model``; ``KEY=VALUE``
words after the recipe override it as on ``tether train``'s command line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    parser.add_argument("--model", help="the model to continue (default: the recipe's model.path)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--save", help="write the settled model here")
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args(argv)

    sys.path.insert(0, str(ROOT / "src"))
    from tether.config import load_config
    from tether.data.prepare import ensure_model
    from tether.families.flow import scenes
    from tether.families.flow.evaluate import FlowEvaluator
    from tether.families.flow.model import load_flow_model
    from tether.families.flow.rollout import sampling_of
    from tether.families.flow.sd3_warmstart import latent_flow_loss, latents_of
    from tether.families.flow.task import flow_data, flow_scorer
    from tether.families.flow.warmstart import drawn_images, flow_matching_loss

    cfg = load_config(ns.recipe, [*ns.overrides, *([f"model.path={ns.model}"] if ns.model else [])])
    path = ensure_model(cfg)
    torch.set_num_threads(cfg.train.threads)
    model = load_flow_model(path, cfg)
    data = flow_data(cfg)
    rng, generator = random.Random(f"flow-settle/{ns.seed}"), torch.Generator().manual_seed(ns.seed)
    dropout = cfg.flow.init_cond_dropout
    if getattr(model, "pipe", None) is not None:  # a diffusers pipeline: its transformer, on VAE latents
        model.attach_pipeline()
        chosen = [rng.choice(data.train).prompt for _ in range(4096)]
        images = torch.stack([scenes.from_pixels(scenes.render(scenes.Scene.parse(p), rng)) for p in chosen])
        latents = latents_of(model.pipe.vae, images)
        prompts = sorted(set(chosen))
        encoded, empty = model.encode_prompts(prompts), model.encode_prompts([""])
        rows = torch.tensor([prompts.index(p) for p in chosen])
        trained = list(model.transformer.parameters())

        def loss() -> torch.Tensor:
            idx = torch.randint(0, len(chosen), (ns.batch_size,), generator=generator)
            return latent_flow_loss(model, latents[idx], {k: v[rows[idx]] for k, v in encoded.items()}, empty,
                                    generator, dropout)
    else:  # the built-in DiT, on pixels
        images, words = drawn_images(data.train, 8192, rng)
        trained = list(model.parameters())

        def loss() -> torch.Tensor:
            idx = torch.randint(0, len(images), (ns.batch_size,), generator=generator)
            return flow_matching_loss(model, images[idx], words[idx], generator, dropout)

    evaluator = FlowEvaluator(model, data.eval, flow_scorer(cfg), eval_steps=cfg.flow.eval_steps,
                              sampling=sampling_of(cfg, model), seed=cfg.run.seed,
                              negative_prompt=cfg.flow.negative_prompt)
    rows_out = []

    def evaluate(step: int) -> None:
        with torch.no_grad():
            m = evaluator(step)
        rows_out.append({"step": step, "reward": m["eval/reward_mean"], "pass_at_1": m["eval/pass_at_1"]})
        if not ns.json:
            print(f"step {step:5d}  held-out reward {m['eval/reward_mean']:.3f}  "
                  f"pass@1 {m['eval/pass_at_1']:.1%}", flush=True)

    for p in trained:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(trained, lr=ns.lr, weight_decay=0.0)
    model.train()
    evaluate(0)
    for step in range(1, ns.steps + 1):
        optimizer.zero_grad(set_to_none=True)
        loss().backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        if step % ns.every == 0 or step == ns.steps:
            model.eval()
            evaluate(step)
            model.train()
    for p in trained:
        p.requires_grad_(False)
    if ns.save:
        if getattr(model, "pipe", None) is not None:
            model.pipe.save_pretrained(ns.save)
        else:
            model.save_pretrained(ns.save)
        record = Path(path) / "warmstart.json"
        if record.is_file():  # what the model was built with, so a recipe's build keys still compare
            (Path(ns.save) / "warmstart.json").write_text(record.read_text())
    if ns.json:
        print(json.dumps({"model": str(path), "lr": ns.lr, "evaluations": rows_out}))


if __name__ == "__main__":
    main()
