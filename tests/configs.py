"""Recipes for tests that build one part of a run (a learner, a rollout pool) by hand: the part is
told what a run would tell it — a ``Config`` — so these say only what differs from the defaults."""

from __future__ import annotations

from typing import Any

from tether.config import Config, load_config


def config(*overrides: str, **train: Any) -> Config:
    """A validated recipe: ``section.key=value`` overrides, and ``train`` keys as keyword arguments."""
    return load_config(None, [*(f"train.{key}={value}" for key, value in train.items()), *overrides])


def pool_settings(model_dir, *overrides: str, stop_text: str = "\n", startup_timeout_s: float = 300.0):
    """A rollout pool's settings: the arithmetic task's recipe with ``overrides``, for ``model_dir``."""
    from tether.rollout.settings import PoolSettings

    return PoolSettings(config("data.task=arithmetic", *overrides), str(model_dir), stop_text=stop_text,
                        startup_timeout_s=startup_timeout_s)
