"""The learner in a Ray actor (``ray.learner: actor``).

``RemoteLearner`` stands in the driver for a ``TorchLearner`` that lives in an actor of its own,
with the held-out evaluator beside it (evaluation runs on the trainer's weights). It implements
what the loop and the runner use: ``train``, ``export_weights``, ``evaluate``, ``save`` and
``load``. Its weights never pass through the driver: ``export_weights`` returns the proxy itself
as ``RemoteWeights``, and at a publication the actor writes its snapshot and puts it into the
object store, from where the rollout actors fetch it.

Checkpoints are written by the actor, at the run directory's path: on a cluster the run directory
must be on a filesystem the learner's node sees (docs/distributed.md).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from tether.config import Config
from tether.data.types import Example
from tether.errors import ConfigError, LearnerLostError
from tether.loop.protocols import RolloutBatch, TrainResult


class _LearnerActor:
    def __init__(self, cfg: Config, model_path: str, eval_examples: Sequence[Example],
                 stop_text: str) -> None:
        import torch

        from tether.data.rewards import scorer
        from tether.rollout.channel import Snapshot
        from tether.runtime.run import local_learner

        torch.set_num_threads(cfg.train.threads)
        # the scorer is rebuilt here: a user's reward file is loaded by path, not pickled
        score = scorer(cfg.reward.function, task=cfg.data.task or None)
        self.learner, self.evaluator = local_learner(cfg, model_path, eval_examples, score, stop_text)
        self.snapshot = Snapshot.for_tensors(self.learner.export_weights())

    def describe(self) -> tuple:
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id(), self.snapshot.layout

    def train(self, batch: RolloutBatch, train_version: int) -> TrainResult:
        return self.learner.train(batch, train_version=train_version)

    def put(self, version: int) -> tuple[Any, dict[str, float]]:
        import ray

        from tether.rollout.ray_pool import put_snapshot

        return put_snapshot(ray, self.snapshot, self.learner.export_weights(), version)

    def evaluate(self, step: int) -> Mapping[str, float]:
        return self.evaluator(step)

    def save(self, path: str) -> None:
        self.learner.save(path)

    def load(self, path: str) -> None:
        self.learner.load(path)


class RemoteLearner:
    """The driver's handle on the learner actor."""

    def __init__(self, ray, cfg: Config, model_path: str, eval_examples: Sequence[Example], stop_text: str,
                 *, startup_timeout_s: float = 300.0) -> None:
        from tether.runtime.run import learner_gpus

        self.ray = ray
        gpus = learner_gpus(cfg)
        if gpus:
            have = sum(n["Resources"].get("GPU", 0.0) for n in ray.nodes() if n.get("Alive"))
            if have < gpus:
                raise ConfigError(f"train.device={cfg.train.device} with ray.learner=actor asks the Ray "
                                  f"cluster for a GPU, and it has {have:g}; set train.device=cpu, or start "
                                  "Ray on nodes with GPUs")
        self.handle = ray.remote(_LearnerActor).options(
            num_cpus=cfg.train.threads, num_gpus=gpus, max_restarts=0,
            name=f"tether-learner-{os.getpid()}-{id(self):x}",
        ).remote(cfg, str(model_path), list(eval_examples), stop_text)
        self.pid: int | None = None
        self.node: str | None = None
        try:
            self.pid, self.node, self.layout = self._call(self.handle.describe, timeout=startup_timeout_s,
                                                          doing="while starting")
        except BaseException:
            self.close()
            raise

    def _call(self, method, *args, timeout: float | None = None, doing: str) -> Any:
        """Call an actor method and wait. An error inside the actor is re-raised as itself
        (Ray's error is also an instance of the original class, with the remote traceback); a
        dead actor becomes ``LearnerLostError``."""
        ray = self.ray
        try:
            return ray.get(method.remote(*args), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise LearnerLostError(f"the learner actor did not answer within {timeout:.0f}s "
                                   f"{doing}") from None
        except ray.exceptions.RayActorError as exc:
            where = f"pid {self.pid}, node {self.node[:8]}" if self.pid and self.node else "not started"
            text = str(exc).strip()
            if "creation task" not in text:  # a death: its first line says enough
                text = text.splitlines()[0] if text else ""
            raise LearnerLostError(f"the learner's Ray actor ({where}) died {doing}: {type(exc).__name__}"
                                   + (f": {text}" if text else "")) from None

    # -- the Learner protocol, and what the runner's hooks use ---------------------------------

    def train(self, batch: RolloutBatch, *, train_version: int) -> TrainResult:
        return self._call(self.handle.train, batch, train_version,
                          doing=f"while training batch {batch.index}")

    def export_weights(self) -> RemoteLearner:
        return self  # RemoteWeights: the actor puts its own snapshot at publication

    def put(self, version: int) -> tuple[Any, dict[str, float]]:
        t0 = time.perf_counter()
        ref, metrics = self._call(self.handle.put, version, doing=f"while publishing version {version}")
        metrics["sync/export_wall_s"] = time.perf_counter() - t0
        return ref, metrics

    def evaluate(self, step: int) -> Mapping[str, float]:
        return self._call(self.handle.evaluate, step, doing=f"while evaluating at step {step}")

    def save(self, path) -> None:
        self._call(self.handle.save, str(path), doing=f"while saving {path}")

    def load(self, path) -> None:
        self._call(self.handle.load, str(path), doing=f"while loading {path}")

    def close(self) -> None:
        import contextlib

        with contextlib.suppress(Exception):
            self.ray.kill(self.handle, no_restart=True)
