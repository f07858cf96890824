"""``tether tasks``, ``tether init-model`` and ``tether warmstart``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tether.errors import ConfigError


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tasks", help="list the built-in tasks with a sample prompt and answer each")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_tasks)

    from tether.data.tiny_model import ARCHES, SIZES

    p = sub.add_parser("init-model", help="build a character-level tokenizer and a model with random "
                       "weights, or import a GGUF file (--from-gguf) as a model folder")
    p.add_argument("out", metavar="OUT", help="directory to write (must not exist or be empty)")
    p.add_argument("--from-gguf", metavar="FILE", help="write the model and tokenizer of this GGUF file "
                   "(llama.cpp's format), dequantized to --dtype, instead of building a model")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the imported weights' dtype (--from-gguf)")
    p.add_argument("--arch", default="qwen3", choices=list(ARCHES))
    p.add_argument("--size", default="small", choices=list(SIZES),
                   help="tiny ≈ 0.1M, small ≈ 3M, base ≈ 25M parameters; 0.5b and 1.5b: the shapes of "
                        "Qwen2-0.5B and -1.5B (Qwen2's vocabulary, the tokenizer padded with filler tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty directory")
    p.set_defaults(func=_init_model)

    p = sub.add_parser(
        "warmstart",
        help="supervised fine-tuning on a recipe's demonstrations until held-out pass@1 reaches a target",
        description="Fine-tune a model on the recipe's data (demonstrations or answers) and save it, "
        "with warmstart.json holding held-out pass@1 before and after.",
    )
    p.add_argument("args", nargs="*", metavar="RECIPE|KEY=VALUE")
    p.add_argument("--model", help="model directory to start from (default: model.path)")
    p.add_argument("--out", required=True, help="directory to write the warm-started model to")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    p.set_defaults(func=_warmstart)


def _tasks(ns: argparse.Namespace) -> int:
    from tether import registry

    rows = []
    for name in registry.tasks.names():
        task = registry.tasks.get(name)
        ex = task.examples("train", 1, seed=0)[0]
        rows.append({"name": task.name, "family": task.family, "description": task.description,
                     "difficulties": list(task.difficulties), "default_difficulty": task.default_difficulty,
                     "sample_prompt": ex.prompt, "sample_answer": ex.answer,
                     "sample_demonstration": ex.target})
    if ns.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        print(f"{r['name']}  (model.family={r['family']}; difficulty {r['difficulties'][0]}.."
              f"{r['difficulties'][-1]}, default {r['default_difficulty']})")
        print(f"  {r['description']}")
        line = f"  e.g. {r['sample_prompt']!r} → {r['sample_demonstration']!r}"
        if r["sample_demonstration"] != r["sample_answer"]:
            line += f"  (reference answer {r['sample_answer']!r})"
        print(line)
    return 0


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _init_model(ns: argparse.Namespace) -> int:
    _quiet_transformers()
    from tether.paths import check_folder_to_write

    check_folder_to_write(ns.out, "OUT")  # before a build that may take minutes
    if ns.from_gguf:
        return _import_gguf(ns)
    from tether.data.tiny_model import init_model

    info = init_model(ns.out, arch=ns.arch, size=ns.size, seed=ns.seed, overwrite=ns.overwrite)
    print(f"wrote a {info.size} {info.arch} model ({info.parameters:,} parameters, vocabulary "
          f"{info.vocab_size}) and its tokenizer to {ns.out}")
    return 0


def _import_gguf(ns: argparse.Namespace) -> int:
    from tether.data.gguf_import import import_gguf

    if ns.overwrite:
        raise ConfigError("--overwrite does not apply to --from-gguf: the import writes a new folder only; "
                          "remove the old one first")
    info = import_gguf(ns.from_gguf, ns.out, dtype=ns.dtype)
    template = "with its chat template" if info.chat_template else "(no chat template)"
    print(f"wrote a {info.architecture} model ({info.parameters:,} parameters, {info.dtype}, vocabulary "
          f"{info.vocab_size}) and its tokenizer {template} to {ns.out}")
    return 0


def _warmstart(ns: argparse.Namespace) -> int:
    _quiet_transformers()
    from dataclasses import replace

    from tether.cli.plan import split_recipe_args
    from tether.config import load_config
    from tether.paths import check_folder_to_write
    from tether.runtime.progress import Progress

    recipe, overrides = split_recipe_args(ns.args)
    cfg = load_config(recipe, overrides)
    model = Path(ns.model or cfg.model.path)
    if not (model / "config.json").is_file():
        raise ConfigError(f"{model} is not a model directory (no config.json); run `tether init-model` first")
    out = Path(ns.out)
    check_folder_to_write(out, "--out")
    if out.exists() and any(out.iterdir()) and not ns.overwrite and out.resolve() != model.resolve():
        raise ConfigError(f"--out {out} exists and is not empty; choose another path or pass --overwrite")
    cfg = replace(cfg, model=replace(cfg.model, path=str(model)))
    family = cfg.family()
    with Progress(cfg.warmstart.max_steps, "warmstart", fields=family.warmstart_fields,
                  eta_label="at most") as progress:
        result = family.warmstart(cfg, model, out, progress.update)
    print(f"warm start on {result.data}: held-out pass@1 {result.pass_at_1_before:.1%} → "
          f"{result.pass_at_1_after:.1%} in {result.steps} steps, {result.seconds:.0f}s "
          f"(stopped: {result.stopped_because}); saved to {out}")
    return 0
