"""``tether export``: a run's trained model as a folder other tools load.

A run that trained every weight checkpoints a Hugging Face model folder already; export copies
it. A LoRA run (``train.lora_rank``) checkpoints adapters: export writes them as a PEFT adapter
directory (``PeftModel.from_pretrained(base, OUT)``, vLLM's LoRA requests), or with ``--merge``
the base with the adapters merged into its weights, a plain model folder transformers and vLLM
load like the base. A run with ``train.ema_decay`` exports the EMA's weights (what its evaluations
measured) unless ``--trained``.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
from pathlib import Path

from tether.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="write a run's trained model (or its LoRA adapters) as a folder other tools load",
        description="Export the model of RUN's newest good checkpoint (or --checkpoint step-N): a "
        "model folder as it is; LoRA adapters as a PEFT adapter directory, or with --merge merged into "
        "their base as a plain model folder. With train.ema_decay, the EMA's weights unless --trained.",
    )
    p.add_argument("run", metavar="RUN", help="a run directory")
    p.add_argument("--out", required=True, help="the folder to write (must not exist, or be empty)")
    p.add_argument("--checkpoint", help="a checkpoint of the run (step-N; default: the newest good one)")
    p.add_argument("--trained", action="store_true", help="a run with train.ema_decay: export the "
                   "trained weights, not the EMA's (which the run evaluated)")
    p.add_argument("--merge", action="store_true",
                   help="LoRA adapters: merge them into the base model's weights")
    p.set_defaults(func=run)


def checkpoint_model(run_dir: Path, name: str | None, *, trained: bool = False) -> Path:
    """The model folder of ``run_dir``'s checkpoint ``name``, or of its newest good one; either
    verified against its manifest (a damaged one is refused, saying what is wrong). The EMA's
    weights where the checkpoint holds them, unless ``trained``."""
    from tether.runtime.checkpoint import Checkpointer, DamagedCheckpoint
    from tether.train.learner_state import model_folder

    checkpoints = Checkpointer(run_dir / "checkpoints")
    if name is None:
        _state, path = checkpoints.newest_good(doing="export")
        return model_folder(path / "learner", trained=trained)
    have = [p.name for p in checkpoints.list()]
    if name not in have:
        raise ConfigError(f"{run_dir} has no checkpoint {name!r}; it has {', '.join(have) or 'none'}")
    path = checkpoints.root / name
    try:
        checkpoints.verify(path)
    except DamagedCheckpoint as exc:
        others = [n for n in have if n != name]
        raise DamagedCheckpoint(f"--checkpoint {name} is damaged: {exc}; export another "
                                f"({', '.join(others) or 'the run has no other'})") from exc
    return model_folder(path / "learner", trained=trained)


def _writable(out: Path) -> list[Path]:
    """Refuse an ``--out`` that is not a folder to create (or an empty one), before anything is
    read; returns the folders above it that are made for it, outermost first (removed again if
    the export fails)."""
    from tether.paths import check_folder_to_write

    check_folder_to_write(out, "--out")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty; choose another --out")
    made, above = [], out.parent
    while not above.exists():
        made.insert(0, above)
        above = above.parent
    try:
        for folder in made:
            folder.mkdir()
        probe = out.parent / f".{out.name}.exporting"
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        _remove(made)
        raise ConfigError(f"cannot make a folder at --out {out} ({exc.strerror or exc}); choose a folder "
                          "you can write to") from exc
    return made


def _remove(made: list[Path]) -> None:
    for folder in reversed(made):
        with contextlib.suppress(OSError):
            folder.rmdir()


def export(run_dir: Path, out: Path, *, checkpoint: str | None = None, merge: bool = False,
           trained: bool = False) -> Path:
    """Write the model of ``run_dir``'s checkpoint to ``out``: whole in a staging folder beside
    it, then renamed into place, so a failure leaves nothing at ``out`` (nor the folders made
    above it)."""
    from tether.config import load_config
    from tether.train import lora

    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
    model_dir = checkpoint_model(run_dir, checkpoint, trained=trained)
    if not lora.is_adapter_dir(model_dir) and merge:
        raise ConfigError(f"{model_dir} holds every weight of the model (the run trained without LoRA): "
                          "there is nothing to merge; drop --merge")
    made = _writable(out)
    staging = out.parent / f".{out.name}.exporting"
    shutil.rmtree(staging, ignore_errors=True)
    done = False
    try:
        if not lora.is_adapter_dir(model_dir):
            shutil.copytree(model_dir, staging)
        elif merge:
            cfg = load_config(run_dir / "config.yaml")
            policy = cfg.family().policy(cfg)
            model, tokenizer = lora.load_merged(model_dir, policy)
            policy.save(model, tokenizer, staging)
        else:
            lora.write_peft(model_dir, staging)
        if out.exists():
            out.rmdir()
        staging.rename(out)
        done = True
    except OSError as exc:
        raise ConfigError(f"cannot export to --out {out}: {exc}; nothing of it was left behind") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if not done:
            _remove(made)
    return out


def run(ns: argparse.Namespace) -> int:
    out = export(Path(ns.run), Path(ns.out), checkpoint=ns.checkpoint, merge=ns.merge, trained=ns.trained)
    print(out)
    return 0
