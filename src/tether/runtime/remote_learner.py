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
    """One learner in an actor, or (``world`` > 1) one of its ranks: rank 0 also evaluates and
    publishes; every rank takes part in the collectives those need."""

    def __init__(self, cfg: Config, model_path: str, eval_examples: Sequence[Example],
                 stop_text: str, rank: int = 0, world: int = 1) -> None:
        self.cfg, self.model_path, self.stop_text = cfg, model_path, stop_text
        self.eval_examples = eval_examples
        self.rank, self.world = rank, world
        self.snapshot = None
        if world == 1:
            self._build(None)

    def address(self) -> str:
        """Where the ranks meet: this node's address and a free port (asked of rank 0)."""
        import socket

        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def join(self, address: str) -> None:
        """Join the ranks' process group (every rank at once) and build this rank's learner."""
        import torch.distributed as dist

        from tether.train.collective import Ranks

        backend = "nccl" if self.cfg.train.device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, init_method=address, rank=self.rank, world_size=self.world)
        self._build(Ranks())

    def _build(self, group) -> None:
        import torch

        from tether.data.rewards import scorer
        from tether.rollout.channel import Snapshot
        from tether.runtime.run import evaluator, local_learner
        from tether.runtime.settings import learner_settings

        cfg = self.cfg
        torch.set_num_threads(cfg.train.threads)
        # the scorer is rebuilt here: a user's reward file is loaded by path, not pickled
        score = scorer(cfg.reward.function, task=cfg.data.task or None)
        if group is None:
            self.learner, self.evaluator = local_learner(cfg, self.model_path, self.eval_examples, score,
                                                         self.stop_text)
        else:
            from tether.modeling import learner_device, load_causal_lm
            from tether.train.learner import TorchLearner

            self.learner = TorchLearner(self.model_path, learner_settings(cfg), group=group)
            if self.rank == 0:  # evaluation on a whole copy, given the ranks' weights first
                model, tokenizer = load_causal_lm(self.model_path)
                self.eval_model = model.to(learner_device(cfg.train.device)).eval()
                self.evaluator = evaluator(cfg, self.eval_model, tokenizer, self.eval_examples, score,
                                           self.stop_text)
        weights = self.learner.export_weights()  # with ranks, a collective: rank 0 gets them whole
        if self.rank == 0:
            self.snapshot = Snapshot.for_tensors(weights)

    def describe(self) -> tuple:
        import ray

        layout = self.snapshot.layout if self.snapshot is not None else None
        context = ray.get_runtime_context()
        return os.getpid(), context.get_node_id(), layout, context.get_placement_group_id()

    def train(self, batch: RolloutBatch, train_version: int) -> TrainResult | None:
        result = self.learner.train(batch, train_version=train_version)
        return result if self.rank == 0 else None

    def put(self, version: int) -> tuple[Any, dict[str, float]] | None:
        import ray

        from tether.rollout.ray_pool import put_snapshot

        weights = self.learner.export_weights()
        return put_snapshot(ray, self.snapshot, weights, version) if self.rank == 0 else None

    def evaluate(self, step: int) -> Mapping[str, float] | None:
        if self.world == 1:
            return self.evaluator(step)
        from tether.modeling import copy_weights

        weights = self.learner.export_weights()
        if self.rank != 0:
            return None
        copy_weights(self.eval_model, weights)
        return self.evaluator(step)

    def save(self, path: str) -> None:
        self.learner.save(path)

    def load(self, path: str) -> None:
        self.learner.load(path)


class RemoteLearner:
    """The driver's handle on the learner actor, or on the actors of its ranks
    (``train.world_size`` > 1: one actor per rank, anywhere in the cluster, meeting over TCP)."""

    def __init__(self, ray, cfg: Config, model_path: str, eval_examples: Sequence[Example], stop_text: str,
                 *, startup_timeout_s: float = 300.0) -> None:
        from tether.runtime.run import learner_gpus

        self.ray = ray
        self.world = cfg.train.world_size
        gpus = learner_gpus(cfg)
        if gpus:
            have = sum(n["Resources"].get("GPU", 0.0) for n in ray.nodes() if n.get("Alive"))
            if have < gpus * self.world:
                asked = "a GPU" if self.world == 1 else f"{self.world} GPUs (one per rank)"
                raise ConfigError(f"train.device={cfg.train.device} with ray.learner=actor asks the Ray "
                                  f"cluster for {asked}, and it has {have:g}; set train.device=cpu"
                                  + (", lower train.world_size" if self.world > 1 else "")
                                  + ", or start Ray on nodes with GPUs")
        self.group = None
        self.handles = []
        self.pids: list[int | None] = [None] * self.world
        self.nodes: list[str | None] = [None] * self.world
        try:
            placement = self._place(cfg, gpus, startup_timeout_s) if self.world > 1 else [{}]
            remote = ray.remote(_LearnerActor)
            self.handles = [
                remote.options(num_cpus=cfg.train.threads, num_gpus=gpus, max_restarts=0,
                               name=f"tether-learner-{rank}-{os.getpid()}-{id(self):x}", **placement[rank],
                               ).remote(cfg, str(model_path), list(eval_examples), stop_text, rank,
                                        self.world)
                for rank in range(self.world)]
            if self.world > 1:
                address = self._call("address", ranks=[0], timeout=startup_timeout_s, doing="while starting")
                self._call("join", address, timeout=startup_timeout_s, doing="while starting")
            described = self._call("describe", timeout=startup_timeout_s, doing="while starting", every=True)
        except BaseException:
            self.close()
            raise
        self.pids = [d[0] for d in described]
        self.nodes = [d[1] for d in described]
        self.layout = described[0][2]
        self.placement = [d[3] for d in described]  # each rank's placement group (None: world 1)

    def _place(self, cfg: Config, gpus: float, timeout_s: float) -> list[dict]:
        """Reserve one bundle per rank (train.threads CPUs, and a GPU when training on CUDA) in a
        placement group, so every rank starts together or none does, on as few nodes as
        ``ray.learner_placement`` allows; the actor options that put rank r in bundle r."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, strategy = self.ray, cfg.ray.learner_placement
        bundle = {"CPU": float(cfg.train.threads), **({"GPU": gpus} if gpus else {})}
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        fits = [min(int(res.get(k, 0.0) // v) for k, v in bundle.items()) for res in nodes]  # ranks per node
        room = {"STRICT_PACK": max(fits, default=0), "STRICT_SPREAD": sum(f > 0 for f in fits)}.get(
            strategy, sum(fits))
        if room < self.world:
            raise ConfigError(
                f"train.world_size={self.world} learner ranks of {bundle} each cannot be placed "
                f"({strategy}) on this Ray cluster: it has room for {room} ({len(nodes)} node(s)); "
                "lower train.world_size or train.threads, raise ray.local_cpus, add nodes, or choose "
                "another ray.learner_placement")
        self.group = placement_group([dict(bundle) for _ in range(self.world)], strategy=strategy,
                                     name=f"tether-learner-{os.getpid()}-{id(self):x}")
        ready, _ = ray.wait([self.group.ready()], timeout=timeout_s)
        if not ready:
            raise LearnerLostError(f"the Ray cluster did not place the {self.world} learner ranks "
                                   f"({strategy}, {bundle} each) within {timeout_s:.0f}s: other work "
                                   "holds the resources")
        return [{"scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=rank)} for rank in range(self.world)]

    @property
    def pid(self) -> int | None:
        return self.pids[0]

    @property
    def node(self) -> str | None:
        return self.nodes[0]

    def _call(self, method: str, *args, ranks=None, timeout: float | None = None, doing: str,
              every: bool = False) -> Any:
        """Call a method on every rank's actor (or on ``ranks``) and wait for all; returns rank
        0's answer (``every``: all of them). An error inside an actor is re-raised as itself
        (Ray's error is also an instance of the original class, with the remote traceback); a
        dead actor becomes ``LearnerLostError`` naming it, and the other ranks (waiting for it in
        a collective) are stopped."""
        ray = self.ray
        ranks = list(range(self.world)) if ranks is None else ranks
        args = tuple(ray.put(a) if isinstance(a, RolloutBatch) else a for a in args)  # sent once
        pending = {getattr(self.handles[r], method).remote(*args): r for r in ranks}
        answers: dict[int, Any] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not ready:
                self.close()
                raise LearnerLostError(f"the learner actor did not answer within {timeout:.0f}s {doing}")
            rank = pending.pop(ready[0])
            try:
                answers[rank] = ray.get(ready[0])
            except ray.exceptions.RayActorError as exc:
                self.close()
                raise LearnerLostError(self._lost(rank, exc, doing)) from None
            except BaseException:
                if self.world > 1:  # a rank whose peer died fails in its collective: name the dead one
                    dead = self._first_dead(pending)
                    self.close()
                    if dead is not None:
                        raise LearnerLostError(self._lost(*dead, doing)) from None
                raise
        return [answers[r] for r in ranks] if every else answers[ranks[0]]

    def _first_dead(self, pending: dict, wait_s: float = 10.0):
        """(rank, error) of a rank among ``pending`` whose actor died, waiting up to ``wait_s`` for
        their answers; None if none did."""
        ray = self.ray
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=wait_s)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                return pending[ref], exc
            except BaseException:
                continue
        return None

    def _lost(self, rank: int, exc, doing: str) -> str:
        pid, node = self.pids[rank], self.nodes[rank]
        where = f"pid {pid}, node {node[:8]}" if pid and node else "not started"
        text = str(exc).strip()
        if "creation task" not in text:  # a death: its first line says enough
            text = text.splitlines()[0] if text else ""
        who = "the learner's Ray actor" if self.world == 1 else f"the learner's Ray actor of rank {rank}"
        return f"{who} ({where}) died {doing}: {type(exc).__name__}" + (f": {text}" if text else "")

    # -- the Learner protocol, and what the runner's hooks use ---------------------------------

    def train(self, batch: RolloutBatch, *, train_version: int) -> TrainResult:
        return self._call("train", batch, train_version, doing=f"while training batch {batch.index}")

    def export_weights(self) -> RemoteLearner:
        return self  # RemoteWeights: the actor puts its own snapshot at publication

    def put(self, version: int) -> tuple[Any, dict[str, float]]:
        t0 = time.perf_counter()
        ref, metrics = self._call("put", version, doing=f"while publishing version {version}")
        metrics["sync/export_wall_s"] = time.perf_counter() - t0
        return ref, metrics

    def evaluate(self, step: int) -> Mapping[str, float]:
        return self._call("evaluate", step, doing=f"while evaluating at step {step}")

    def save(self, path) -> None:
        self._call("save", str(path), doing=f"while saving {path}")

    def load(self, path) -> None:
        self._call("load", str(path), doing=f"while loading {path}")

    def close(self) -> None:
        import contextlib

        for handle in getattr(self, "handles", []):
            with contextlib.suppress(Exception):
                self.ray.kill(handle, no_restart=True)
        if getattr(self, "group", None) is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.group)
            self.group = None
