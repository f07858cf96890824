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
import dataclasses
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
    from tether.families.flow.evaluate import FlowEvaluator
    from tether.families.flow.model import load_flow_model
    from tether.families.flow.rollout import sampling_of
    from tether.families.flow.sd3_warmstart import latent_flow_batches, latents_of
    from tether.families.flow.task import flow_data, flow_scorer
    from tether.families.flow.warmstart import drawn_images, drawn_scenes, flow_matching_loss
    from tether.train.supervised import warmstart_loop

    cfg = load_config(ns.recipe, [*ns.overrides, *([f"model.path={ns.model}"] if ns.model else [])])
    path = ensure_model(cfg)
    torch.set_num_threads(cfg.train.threads)
    model = load_flow_model(path, cfg)
    data = flow_data(cfg)
    rng, generator = random.Random(f"flow-settle/{ns.seed}"), torch.Generator().manual_seed(ns.seed)
    dropout = cfg.flow.init_cond_dropout
    pipeline = getattr(model, "pipe", None)
    if pipeline is not None:  # a diffusers pipeline: its transformer, on VAE latents, as sd3_warmstart trains
        model.attach_pipeline()
        chosen, images = drawn_scenes(data.train, 4096, rng)
        loss = latent_flow_batches(model, [e.prompt for e in data.train], chosen,
                                   latents_of(pipeline.vae, images), batch_size=ns.batch_size,
                                   generator=generator, cond_dropout=dropout)
        trained = model.transformer
    else:  # the built-in DiT, on pixels
        images, words = drawn_images(data.train, 8192, rng)
        trained = model

        def loss() -> torch.Tensor:
            idx = torch.randint(0, len(images), (ns.batch_size,), generator=generator)
            return flow_matching_loss(model, images[idx], words[idx], generator, dropout)

    evaluator = FlowEvaluator(model, data.eval, flow_scorer(cfg), eval_steps=cfg.flow.eval_steps,
                              sampling=sampling_of(cfg, model), seed=cfg.run.seed,
                              negative_prompt=cfg.flow.negative_prompt)

    def show(step: int, metrics: dict[str, float]) -> None:
        if "reward" in metrics and not ns.json:
            print(f"step {step:5d}  held-out reward {metrics['reward']:.3f}  "
                  f"pass@1 {metrics['pass_at_1']:.1%}", flush=True)

    evaluations = 0

    def evaluate() -> dict[str, float]:
        nonlocal evaluations
        m = evaluator(0)
        figures = {"pass_at_1": m["eval/pass_at_1"], "reward": m["eval/reward_mean"]}
        if evaluations == 0:  # the loop's first call, before any step; the later ones reach show()
            show(0, figures)
        evaluations += 1
        return figures

    # the warm start's own loop at a constant --lr, evaluated every --every steps and never stopped early
    settings = dataclasses.replace(cfg.warmstart, max_steps=ns.steps, eval_every=ns.every, lr=ns.lr,
                                   batch_size=ns.batch_size, target_pass_rate=1.0, lr_schedule="constant",
                                   min_lr_ratio=0.0)
    trained.requires_grad_(True)
    optimizer = torch.optim.AdamW(trained.parameters(), lr=ns.lr, weight_decay=0.0)
    result = warmstart_loop(trained, optimizer, lambda step: loss(), evaluate, settings, data="flow_settle",
                            on_progress=show)
    trained.requires_grad_(False)
    if ns.save:
        (model if pipeline is None else pipeline).save_pretrained(ns.save)
        record = Path(path) / "warmstart.json"
        if record.is_file():  # what the model was built with, so a recipe's build keys still compare
            (Path(ns.save) / "warmstart.json").write_text(record.read_text())
    if ns.json:
        rows = [{"step": 0, **result.before}, *({k: h[k] for k in ("step", "reward", "pass_at_1")}
                                                for h in result.history)]
        print(json.dumps({"model": str(path), "lr": ns.lr, "evaluations": rows}))


if __name__ == "__main__":
    main()
