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
        "run's own config; with train.ema_decay its EMA's weights, as the run did, unless --trained). "
        "Greedy pass@1 and reward, then --samples completions per prompt at the rollout settings: "
        "sampled pass@1, mean reward and pass@k.",
    )
    p.add_argument("args", nargs="*", metavar="TARGET|KEY=VALUE",
                   help="a recipe or a run directory, then section.key=value overrides (no recipe: "
                   "the defaults)")
    p.add_argument("--model", help="evaluate this model directory instead (a checkpoint's "
                   "learner/model, or any Hugging Face model folder)")
    p.add_argument("--trained", action="store_true", help="a run with train.ema_decay: evaluate the "
                   "checkpoint's trained weights, not the EMA's (which the run's evaluations measured)")
    p.add_argument("--samples", type=int, help="completions sampled per prompt (default: eval.num_samples)")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    p.set_defaults(func=run)


def newest_checkpoint_model(run_dir: Path, *, trained: bool = False) -> Path:
    """The model folder of ``run_dir``'s newest checkpoint that passes its manifest check: its EMA's
    weights where it holds them (what the run evaluated), unless ``trained``."""
    from tether.runtime.checkpoint import Checkpointer
    from tether.train.learner_state import model_folder

    _state, path = Checkpointer(run_dir / "checkpoints").newest_good(doing="evaluate (pass --model DIR)")
    return model_folder(path / "learner", trained=trained)


def resolve(ns: argparse.Namespace):
    """(config, model directory, samples per prompt) from the command line."""
    from tether.cli.plan import split_recipe_args
    from tether.config import load_config
    from tether.modeling import is_model_dir

    if ns.args and Path(ns.args[0]).is_dir():
        run_dir, overrides = Path(ns.args[0]), ns.args[1:]
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
        cfg = load_config(run_dir / "config.yaml", overrides)
        model = Path(ns.model) if ns.model else newest_checkpoint_model(run_dir, trained=ns.trained)
    else:
        recipe, overrides = split_recipe_args(ns.args)
        cfg = load_config(recipe, overrides)
        model = Path(ns.model or cfg.model.path)
        if ns.trained:
            raise ConfigError("--trained chooses among a run's checkpoint folders: pass a run directory")
    if not is_model_dir(model) and not (model / "adapter.json").is_file():
        raise ConfigError(f"{model} is not a model directory (no config.json, model_index.json or "
                          "adapter.json)")
    samples = cfg.eval.num_samples if ns.samples is None else ns.samples
    if samples < 1:
        raise ConfigError(f"--samples must be at least 1, got {samples}")
    return cfg, model, samples


def evaluate_model(cfg, model_dir: Path, samples: int) -> tuple[dict[str, float], str]:
    """The held-out metrics of ``model_dir`` and a description of the data."""
    import torch

    from tether.modeling import learner_device
    from tether.train import lora

    torch.set_num_threads(cfg.train.threads)
    family = cfg.family()
    policy = family.policy(cfg)
    # a checkpoint of LoRA adapters: its base with them merged in
    merged = lora.is_adapter_dir(model_dir)
    model, tokenizer = lora.load_merged(model_dir, policy) if merged else policy.load(model_dir)
    model.to(learner_device(cfg.train.device))  # where the run's learner evaluated
    data = family.data(cfg, lora.base_of(model_dir) if merged else model_dir)
    evaluate = family.evaluator(cfg, model, tokenizer, data, family.scorer(cfg), num_samples=samples)
    return dict(evaluate(step=0)), data.description


def run(ns: argparse.Namespace) -> int:
    from tether.cli.train_cmd import _logging

    cfg, model, samples = resolve(ns)
    _logging()
    metrics, data = evaluate_model(cfg, model, samples)
    if ns.json:
        print(json.dumps({"model": str(model), "data": data, **metrics}, indent=2))
        return 0
    print(f"{model} on {int(metrics['eval/examples'])} held-out examples of {data}")
    for line in cfg.family().eval_summary(cfg, metrics, samples):
        print(line)
    return 0
