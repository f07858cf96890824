"""``tether eval``: held-out accuracy of a model, a run's newest checkpoint, or a given one.

The same evaluation a run makes at its boundaries (greedy pass@1, then k sampled completions per
prompt), on the held-out split the recipe's data section defines, so its figures compare with a
run's ``eval.jsonl``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tether.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval", help="held-out pass@1 (and pass@k) of a model or of a run's checkpoint",
        description="Evaluate on the held-out split of a recipe's data section. TARGET is a recipe "
        "(evaluates model.path) or a run directory (evaluates its newest good checkpoint, on the "
        "run's own config). Greedy pass@1 and reward, then --samples completions per prompt at the "
        "rollout settings: sampled pass@1, mean reward and pass@k.",
    )
    p.add_argument("args", nargs="*", metavar="TARGET|KEY=VALUE",
                   help="a recipe or a run directory, then section.key=value overrides (no recipe: "
                   "the defaults)")
    p.add_argument("--model", help="evaluate this model directory instead (a checkpoint's "
                   "learner/model, or any Hugging Face model folder)")
    p.add_argument("--samples", type=int, help="completions sampled per prompt (default: eval.num_samples)")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    p.set_defaults(func=run)


def newest_checkpoint_model(run_dir: Path) -> Path:
    """The model folder of ``run_dir``'s newest checkpoint that passes its manifest check."""
    from tether.runtime.checkpoint import Checkpointer

    _state, path = Checkpointer(run_dir / "checkpoints").newest_good(doing="evaluate (pass --model DIR)")
    return path / "learner" / "model"


def resolve(ns: argparse.Namespace):
    """(config, model directory, samples per prompt) from the command line."""
    from tether.cli.plan import split_recipe_args
    from tether.config import load_config

    if ns.args and Path(ns.args[0]).is_dir():
        run_dir, overrides = Path(ns.args[0]), ns.args[1:]
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
        cfg = load_config(run_dir / "config.yaml", overrides)
        model = Path(ns.model) if ns.model else newest_checkpoint_model(run_dir)
    else:
        recipe, overrides = split_recipe_args(ns.args)
        cfg = load_config(recipe, overrides)
        model = Path(ns.model or cfg.model.path)
    if not (model / "config.json").is_file():
        raise ConfigError(f"{model} is not a model directory (no config.json)")
    samples = cfg.eval.num_samples if ns.samples is None else ns.samples
    if samples < 1:
        raise ConfigError(f"--samples must be at least 1, got {samples}")
    return cfg, model, samples


def evaluate_model(cfg, model_dir: Path, samples: int) -> tuple[dict[str, float], str]:
    """The held-out metrics of ``model_dir`` and a description of the data."""
    import torch

    from tether.data.rewards import scorer
    from tether.data.source import resolve_data
    from tether.modeling import learner_device, load_causal_lm
    from tether.runtime.run import evaluator

    torch.set_num_threads(cfg.train.threads)
    if cfg.model.family == "flow":
        return _evaluate_flow(cfg, model_dir, samples)
    model, tokenizer = load_causal_lm(model_dir)
    model.to(learner_device(cfg.train.device))  # where the run's learner evaluated
    data = resolve_data(cfg.data, tokenizer, seed=cfg.run.seed)
    score = scorer(cfg.reward.function, task=cfg.data.task or None)
    evaluate = evaluator(cfg, model, tokenizer, data.eval, score, data.stop_text, num_samples=samples)
    return dict(evaluate(step=0)), data.description


def _evaluate_flow(cfg, model_dir: Path, samples: int) -> tuple[dict[str, float], str]:
    from tether.flow.model import FlowModel
    from tether.flow.task import flow_data, flow_scorer
    from tether.modeling import learner_device
    from tether.runtime.run import evaluator

    model = FlowModel.from_pretrained(model_dir).to(learner_device(cfg.train.device))
    data = flow_data(cfg.data.task, cfg.data.num_train, cfg.data.num_eval, seed=cfg.run.seed)
    score = flow_scorer(cfg.reward.function, task=cfg.data.task)
    evaluate = evaluator(cfg, model, None, data.eval, score, "", num_samples=samples)
    return dict(evaluate(step=0)), data.description


def run(ns: argparse.Namespace) -> int:
    from tether.cli.train_cmd import _logging

    cfg, model, samples = resolve(ns)
    _logging()
    metrics, data = evaluate_model(cfg, model, samples)
    if ns.json:
        print(json.dumps({"model": str(model), "data": data, **metrics}, indent=2))
        return 0
    n = int(metrics["eval/examples"])
    print(f"{model} on {n} held-out prompts of {data}")
    if cfg.model.family == "flow":
        print(f"  ODE ({cfg.flow.eval_steps} steps): pass@1 {metrics['eval/pass_at_1']:.1%}, mean reward "
              f"{metrics['eval/reward_mean']:.3f}")
        print(f"  SDE ({cfg.flow.steps} steps, noise {cfg.flow.noise_level:g}): pass@1 "
              f"{metrics['eval/sampled_pass_at_1']:.1%}, mean reward "
              f"{metrics['eval/sampled_reward_mean']:.3f}  ({samples} per prompt)")
        return 0
    print(f"  greedy:  pass@1 {metrics['eval/pass_at_1']:.1%}, mean reward "
          f"{metrics['eval/greedy_reward_mean']:.3f}")
    line = (f"  sampled: pass@1 {metrics['eval/sampled_pass_at_1']:.1%}, mean reward "
            f"{metrics['eval/sampled_reward_mean']:.3f}")
    if samples > 1:
        line += f", pass@{samples} {metrics['eval/pass_at_k']:.1%}"
    print(line + f"  ({samples} per prompt at temperature {cfg.rollout.temperature:g})")
    return 0
