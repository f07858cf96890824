"""Make sure a recipe's model exists: have its family build and warm-start a tiny one when asked
to, atomically."""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict
from pathlib import Path

from tether.config import Config
from tether.errors import ConfigError
from tether.paths import check_folder_to_write
from tether.vocabulary import Progress

log = logging.getLogger("tether.data")


def _clean_stale_builds(path: Path) -> None:
    """Remove the staging folders of builds whose process is gone (an interrupted warm start);
    a build still running in another process keeps its own."""
    for staging in path.parent.glob(f".{path.name}.building-*"):
        pid = staging.name.rsplit("-", 1)[-1]
        if pid.isdigit() and _alive(int(pid)):
            continue
        log.info("removing %s, left by an interrupted model build", staging)
        shutil.rmtree(staging, ignore_errors=True)


def built_settings(path: str | Path) -> dict:
    """The settings a model Tether built at ``path`` was built with (its ``warmstart.json``'s, as
    ``tether.train.supervised.write_record`` wrote them); empty for a model Tether did not build."""
    record = Path(path) / "warmstart.json"
    return json.loads(record.read_text()).get("settings", {}) if record.is_file() else {}


def built_otherwise(cfg: Config, path: Path) -> list[str]:
    """The recipe's build keys (the warm start's, and the family's own, such as a flow model's
    size) that differ from what built the model at ``path``, read from its ``warmstart.json``;
    empty for a model Tether did not build. A model that exists is never rebuilt, so these keys do
    nothing: the caller says so."""
    out = []
    built = built_settings(path)
    if built:  # a key newer than the build was at its default then (a constant warm-start rate)
        built = {**asdict(type(cfg.warmstart)()), **built}
    for key, value in {**asdict(cfg.warmstart), "seed": cfg.run.seed}.items():
        if key in built and built[key] != value:
            out.append(f"{'run.seed' if key == 'seed' else 'warmstart.' + key}: built with {built[key]}, "
                       f"the recipe says {value}")
    return out + (cfg.family().build_differences(cfg, path) if built else [])


def unbuilt_keys(cfg: Config, path: Path) -> list[str]:
    """For a model Tether did not build (no ``warmstart.json``): the build keys the recipe sets away
    from their defaults (the warm start's, ``model.init_arch`` and ``model.init_size``, and the
    family's own, such as a flow pipeline's ``flow.init_width``). The model is used as it is, so
    these keys do nothing: the caller says so."""
    from tether.config.features import changed_keys

    if built_settings(path):
        return []
    keys = [*(f"warmstart.{key}" for key in asdict(cfg.warmstart)), "model.init_arch", "model.init_size"]
    return changed_keys(cfg, keys) + cfg.family().build_differences(cfg, path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        pass
    return True


def ensure_model(cfg: Config, on_progress: Progress | None = None) -> Path:
    """``model.path``, building it first (the family's ``build_model``: a tiny model and its warm
    start) when missing and allowed.

    The model is built in a temporary folder beside the target and renamed into place only when
    complete, so an interrupted build never leaves a half-made model at ``model.path``.
    """
    from tether.modeling import is_model_dir

    path = Path(cfg.model.path)
    if is_model_dir(path):
        if cfg.model.create_if_missing:
            for difference in built_otherwise(cfg, path):
                log.warning("model.path %s already exists and is used as it is: %s (delete it to build "
                            "it anew with the recipe's settings, or point model.path elsewhere)", path,
                            difference)
        unused = unbuilt_keys(cfg, path)
        if unused:
            log.warning("model.path %s is a model Tether did not build (it has no warmstart.json), used as "
                        "it is: %s shape only a model Tether builds and do nothing here; drop them", path,
                        ", ".join(unused))
        return path
    if path.exists() and not path.is_dir():
        raise ConfigError(f"model.path {path} is a file, not a model directory; point model.path at a model "
                          "directory or a new folder")
    if path.exists() and any(path.iterdir()):
        raise ConfigError(f"model.path {path} exists but holds neither config.json nor model_index.json "
                          "(a diffusers pipeline's): it is not a model directory, and a model is never built "
                          "over files already there; point model.path at a model directory or a new folder")
    if not cfg.model.create_if_missing:
        raise ConfigError(f"model.path {path} does not exist; point it at a local model directory, "
                          "run `tether init-model`, or set model.create_if_missing=true")
    check_folder_to_write(path, "model.path")  # before a build and warm start that may take minutes
    _clean_stale_builds(path)
    staging = path.parent / f".{path.name}.building-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        log.info("%s", cfg.family().build_model(cfg, staging / "warm", on_progress))
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            path.rmdir()
        os.replace(staging / "warm", path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path
