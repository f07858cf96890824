"""Tether: asynchronous RL post-training with a staleness budget stated in rollout batches.

The public API — everything else is internal and may move:

    train, load_config, Config                 run a recipe (as ``tether train`` does), with your own
                                               reward, environment and plug-ins as Python objects
    register_family, register_task,            plug-ins: what a recipe can name
    register_reward, register_loss,            (``run.plugins`` imports them in every process)
    register_advantage, register_kl, batched   (``batched``: a reward function that scores a whole batch)
    register_engine, register_backend,         an engine or a rollout backend, declared as
    EnginePlugin, BackendPlugin                (``tether.plugins``) what it owns, supports and checks
    Family, FamilyBase, PolicyBase, ...        the vocabulary a plug-in is written in
    TetherError, ConfigError, ...              the errors (``tether.errors``)

Importing ``tether`` loads neither torch nor the parts of a run: each name is imported on first use.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "train": "tether.api",
    "load_config": "tether.config",
    "Config": "tether.config",
    "register_family": "tether.registry",
    "register_task": "tether.registry",
    "register_reward": "tether.registry",
    "register_loss": "tether.registry",
    "register_advantage": "tether.registry",
    "register_kl": "tether.registry",
    "register_engine": "tether.registry",
    "register_backend": "tether.registry",
    "EnginePlugin": "tether.plugins",
    "BackendPlugin": "tether.plugins",
    "batched": "tether.data.rewards",
    "FamilyBase": "tether.families.base",
    "PolicyBase": "tether.families.base",
    "Capabilities": "tether.vocabulary",
    "DataBundle": "tether.vocabulary",
    "Example": "tether.vocabulary",
    "Family": "tether.vocabulary",
    "Policy": "tether.vocabulary",
    "Sampler": "tether.vocabulary",
    "WorkItem": "tether.vocabulary",
    "TetherError": "tether.errors",
    "ConfigError": "tether.errors",
    "PluginError": "tether.errors",
    "ControlError": "tether.errors",
    "StaleBatchError": "tether.errors",
    "AdmissionStallError": "tether.errors",
    "QueueClosedError": "tether.errors",
    "QueueTimeoutError": "tether.errors",
    "NothingLearnedError": "tether.errors",
    "RolloutError": "tether.errors",
    "WorkerRestartLimitError": "tether.errors",
    "LearnerLostError": "tether.errors",
    "LearnerError": "tether.errors",
    "LearnerMemoryError": "tether.errors",
    "RunBusyError": "tether.errors",
    "CheckpointError": "tether.errors",
    "DataError": "tether.errors",
    "RewardError": "tether.errors",
    "LossError": "tether.errors",
    "NativeDecoderError": "tether.errors",
    "StopRequested": "tether.errors",
}

__all__ = ["__version__", *_EXPORTS]


class _Train:
    """``tether.train``: the function (``tether.api.train``) under the name of a subpackage. Called,
    it trains; an attribute is the subpackage's (``import tether.train.learner as m`` works)."""

    def __init__(self, fn: Any) -> None:
        functools.update_wrapper(self, fn)
        self._fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return importlib.import_module(f"tether.train.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"tether.train.{name}":
                raise
            raise AttributeError(f"tether.train has no attribute {name!r}") from exc

    def __repr__(self) -> str:
        return f"<function tether.train {self._fn.__module__}.{self._fn.__qualname__}>"


class _Package(types.ModuleType):
    """Importing the subpackage ``tether.train`` (a learner does) would bind the module over the
    function, and a script's ``tether.train(...)`` would then call a module: the name keeps
    ``_Train``; the subpackage stays in ``sys.modules`` and behind ``_Train``'s attributes."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "train" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        if name == "train":
            value = _Train(value)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tether' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
