"""Make sure a recipe's model exists: build and warm-start a tiny one when asked to."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path

from tether.config import Config
from tether.errors import ConfigError

log = logging.getLogger("tether.data")


def warmstart_settings(cfg: Config):
    from tether.data.warmstart import WarmstartSettings

    w = cfg.warmstart
    return WarmstartSettings(max_steps=w.max_steps, batch_size=w.batch_size, lr=w.lr,
                             target_pass_rate=w.target_pass_rate, eval_every=w.eval_every,
                             max_seconds=w.max_seconds, seed=cfg.run.seed)


def run_warmstart(cfg: Config, model_dir: Path, out_dir: Path,
                  on_progress: Callable[[int, Mapping[str, float]], None] | None = None):
    """Warm-start ``model_dir`` on the recipe's data and reward; write the result to ``out_dir``."""
    from transformers import AutoTokenizer

    from tether.data.rewards import scorer
    from tether.data.source import resolve_data
    from tether.data.warmstart import warmstart

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = resolve_data(cfg.data, tokenizer, seed=cfg.run.seed)
    score = scorer(cfg.reward.function, task=cfg.data.task or None)
    return warmstart(model_dir, data.train, data.eval, score, stop_text=data.stop_text,
                     description=data.description, out_dir=out_dir,
                     settings=warmstart_settings(cfg), on_progress=on_progress)


def build_flow_model(cfg: Config, out: Path,
                     on_progress: Callable[[int, Mapping[str, float]], None] | None = None):
    """A new tiny flow model (the flow section's size) warm-started by flow matching on drawn
    images of the train split (``tether.flow.warmstart``), saved to ``out``."""
    from tether.flow import scenes
    from tether.flow.model import FlowModelConfig
    from tether.flow.task import flow_data, flow_scorer
    from tether.flow.warmstart import flow_warmstart

    data = flow_data(cfg.data.task, cfg.data.num_train, cfg.data.num_eval, seed=cfg.run.seed)
    config = FlowModelConfig(vocab=scenes.WORDS, width=cfg.flow.init_width, depth=cfg.flow.init_depth,
                             patch=4)
    log.info("building a flow model (width %d, depth %d); warm-starting it", config.width, config.depth)
    score = flow_scorer(cfg.reward.function, task=cfg.data.task)
    return flow_warmstart(out, config, data.train, data.eval, score,
                          settings=warmstart_settings(cfg), eval_steps=cfg.flow.eval_steps,
                          sampling=flow_sampling(cfg), on_progress=on_progress)


def flow_sampling(cfg: Config):
    from tether.flow.policy import FlowSampling

    return FlowSampling(steps=cfg.flow.steps, noise_level=cfg.flow.noise_level)


def _clean_stale_builds(path: Path) -> None:
    """Remove the staging folders of builds whose process is gone (an interrupted warm start);
    a build still running in another process keeps its own."""
    for staging in path.parent.glob(f".{path.name}.building-*"):
        pid = staging.name.rsplit("-", 1)[-1]
        if pid.isdigit() and _alive(int(pid)):
            continue
        log.info("removing %s, left by an interrupted model build", staging)
        shutil.rmtree(staging, ignore_errors=True)


def built_otherwise(cfg: Config, path: Path) -> list[str]:
    """The recipe's build keys (warm start, flow model size) that differ from what built the
    model at ``path``, read from its ``warmstart.json`` and config; empty for a model Tether did
    not build. A model that exists is never rebuilt, so these keys do nothing: the caller says so."""
    out = []
    warm = path / "warmstart.json"
    built = json.loads(warm.read_text()).get("settings", {}) if warm.is_file() else {}
    for key, value in asdict(warmstart_settings(cfg)).items():
        if key in built and built[key] != value:
            out.append(f"{'run.seed' if key == 'seed' else 'warmstart.' + key}: built with {built[key]}, "
                       f"the recipe says {value}")
    if cfg.model.family == "flow" and built:
        from tether.flow.model import read_config

        config = read_config(path)
        for key, have in (("init_width", config.width), ("init_depth", config.depth)):
            if have != getattr(cfg.flow, key):
                out.append(f"flow.{key}: built with {have}, the recipe says {getattr(cfg.flow, key)}")
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        pass
    return True


def ensure_model(cfg: Config, on_progress: Callable[[int, Mapping[str, float]], None] | None = None) -> Path:
    """``model.path``, building it first (init + warm start) when missing and allowed.

    The model is built in a temporary folder beside the target and renamed into place only when
    complete, so an interrupted build never leaves a half-made model at ``model.path``.
    """
    from tether.data.tiny_model import init_model

    path = Path(cfg.model.path)
    if (path / "config.json").is_file():
        if cfg.model.create_if_missing:
            for difference in built_otherwise(cfg, path):
                log.warning("model.path %s already exists and is used as it is: %s (delete it to build "
                            "it anew with the recipe's settings, or point model.path elsewhere)", path,
                            difference)
        return path
    if path.exists() and any(path.iterdir()):
        raise ConfigError(f"model.path {path} exists but holds no config.json; it is not a model directory")
    if not cfg.model.create_if_missing:
        raise ConfigError(f"model.path {path} does not exist; point it at a local model directory, "
                          "run `tether init-model`, or set model.create_if_missing=true")
    _clean_stale_builds(path)
    staging = path.parent / f".{path.name}.building-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        if cfg.model.family == "flow":
            build_flow_model(cfg, staging / "warm", on_progress)
        else:
            info = init_model(staging / "init", arch=cfg.model.init_arch, size=cfg.model.init_size,
                              seed=cfg.run.seed)
            log.info("built a %s %s model (%d parameters); warm-starting it", cfg.model.init_size,
                     cfg.model.init_arch, info.parameters)
            run_warmstart(cfg, staging / "init", staging / "warm", on_progress)
            shutil.copy2(staging / "init" / "tether_model.json", staging / "warm" / "tether_model.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            path.rmdir()
        os.replace(staging / "warm", path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path
