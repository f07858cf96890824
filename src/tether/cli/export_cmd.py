"""``tether export``: a run's trained model as a folder other tools load.

A run that trained every weight checkpoints a Hugging Face model folder already; export copies
it. A LoRA run (``train.lora_rank``) checkpoints adapters: export writes them as a PEFT adapter
directory (``PeftModel.from_pretrained(base, OUT)``, vLLM's LoRA requests), or with ``--merge``
the base with the adapters merged into its weights, a plain model folder transformers and vLLM
load like the base.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from tether.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="write a run's trained model (or its LoRA adapters) as a folder other tools load",
        description="Export the model of RUN's newest good checkpoint (or --checkpoint step-N): a "
        "model folder as it is; LoRA adapters as a PEFT adapter directory, or with --merge merged into "
        "their base as a plain model folder.",
    )
    p.add_argument("run", metavar="RUN", help="a run directory")
    p.add_argument("--out", required=True, help="the folder to write (must not exist, or be empty)")
    p.add_argument("--checkpoint", help="a checkpoint of the run (step-N; default: the newest good one)")
    p.add_argument("--merge", action="store_true",
                   help="LoRA adapters: merge them into the base model's weights")
    p.set_defaults(func=run)


def checkpoint_model(run_dir: Path, name: str | None) -> Path:
    from tether.cli.eval_cmd import newest_checkpoint_model

    if name is None:
        return newest_checkpoint_model(run_dir)
    folder = run_dir / "checkpoints" / name / "learner" / "model"
    if not folder.is_dir():
        have = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
        raise ConfigError(f"{run_dir} has no checkpoint {name!r}; it has {', '.join(have) or 'none'}")
    return folder


def export(run_dir: Path, out: Path, *, checkpoint: str | None = None, merge: bool = False) -> Path:
    from tether.config import load_config
    from tether.train import lora

    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty; choose another --out")
    model_dir = checkpoint_model(run_dir, checkpoint)
    staging = out.parent / f".{out.name}.exporting"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        if not lora.is_adapter_dir(model_dir):
            if merge:
                raise ConfigError(f"{model_dir} holds every weight of the model (the run trained without "
                                  "LoRA): there is nothing to merge; drop --merge")
            shutil.copytree(model_dir, staging)
        elif merge:
            cfg = load_config(run_dir / "config.yaml")
            policy = cfg.family().policy(cfg)
            model, tokenizer = lora.load_merged(model_dir, policy)
            policy.save(model, tokenizer, staging)
        else:
            lora.write_peft(model_dir, staging)
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            out.rmdir()
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def run(ns: argparse.Namespace) -> int:
    out = export(Path(ns.run), Path(ns.out), checkpoint=ns.checkpoint, merge=ns.merge)
    print(out)
    return 0
