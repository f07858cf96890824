"""The learner's ranks as Ray actors (``ray.learner: actor``): the second transport of
``tether.train.ranks.RankGroup``.

One actor per rank (one in all with ``train.world_size=1``), anywhere in the cluster, in one
placement group reserved before any rank starts; the ranks meet over TCP at rank 0's address.
The weights never pass through the driver: at a publication rank 0 writes its snapshot and puts
it into the object store, from where the rollout actors fetch it (``ActorWeights.put``).
Checkpoints are written by the actors, at the run directory's path: on a cluster the run
directory must be on a filesystem the learner's nodes see (docs/distributed.md).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from tether.config import Config
from tether.errors import ConfigError, LearnerLostError
from tether.train.ranks import Outcome, RankGroup, RankServer, RankWeights
from tether.vocabulary import DataBundle, RolloutBatch


class _LearnerActor(RankServer):
    """One rank as a Ray actor: a ``RankServer`` that also meets its peers over TCP and puts rank
    0's snapshot of the weights into the object store."""

    def __init__(self, cfg: Config, model_path: str, eval_data: DataBundle | None, rank: int, world: int,
                 run_dir: str | None) -> None:
        super().__init__(cfg, model_path, eval_data, rank=rank, world=world, run_dir=run_dir)
        self.snapshot = None
        if world == 1:
            self._start(None)

    def address(self) -> str:
        """Where the ranks meet: this node's address and a free port (asked of rank 0)."""
        import socket

        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def join(self, address: str) -> None:
        """Join the ranks' process group (every rank at once) and build this rank."""
        import torch.distributed as dist

        from tether.train.collective import Ranks

        backend = "nccl" if self.cfg.train.device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, init_method=address, rank=self.rank, world_size=self.world)
        self._start(Ranks())

    def _start(self, group: Any) -> None:
        from tether.rollout.channel import Snapshot

        self.build(group)
        weights = self.learner.export_weights()  # with ranks, a collective: rank 0 gets them whole
        if self.rank == 0:
            self.snapshot = Snapshot.for_tensors(weights)

    def describe(self) -> tuple:
        import ray

        layout = self.snapshot.layout if self.snapshot is not None else None
        context = ray.get_runtime_context()
        return os.getpid(), context.get_node_id(), layout, context.get_placement_group_id()

    def put(self, version: int) -> tuple[Any, dict[str, float]] | None:
        import ray

        from tether.rollout.backends.ray.cluster import put_snapshot

        weights = self.learner.export_weights()
        return put_snapshot(ray, self.snapshot, weights, version) if self.rank == 0 else None

    def call(self, method: str, *args: Any) -> Any:
        """The transport's one entry point; only rank 0's answer is kept."""
        answer = getattr(self, method)(*args)
        return answer if self.rank == 0 or method == "describe" else None


class ActorWeights(RankWeights):
    """Weights of learner actors: they put themselves into the object store (``RemoteWeights``)."""

    @property
    def layout(self) -> Any:
        return self._group.transport.layout

    def put(self, version: int) -> tuple[Any, dict[str, float]]:
        self._current()
        t0 = time.perf_counter()
        ref, metrics = self._group.call("put", version, doing=f"while publishing version {version}")
        metrics["sync/export_wall_s"] = time.perf_counter() - t0
        return ref, metrics


def learner_gpus(cfg: Config) -> float:
    """GPUs each learner actor requests: one when it trains on CUDA, else none."""
    return 1.0 if cfg.train.device != "cpu" else 0.0


def rank_bundle(cfg: Config) -> dict[str, float]:
    """What each learner rank actor reserves: train.threads CPUs, a GPU when it trains on CUDA,
    and ``ray.learner_resources``."""
    gpus = learner_gpus(cfg)
    return {"CPU": float(cfg.train.threads), **({"GPU": gpus} if gpus else {}), **cfg.ray.learner_resources}


def check_placement(ray: Any, cfg: Config) -> None:
    """Refuse at once learner ranks the Ray cluster can never hold, saying what to change: GPUs
    it does not have, or more ranks than ``ray.learner_placement`` can put on its nodes. Checked
    before any actor of the run starts (``runtime.assemble``), and again when the ranks start."""
    world, strategy, bundle = cfg.train.world_size, cfg.ray.learner_placement, rank_bundle(cfg)
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if "GPU" in bundle:
        have = sum(res.get("GPU", 0.0) for res in nodes)
        if have < bundle["GPU"] * world:
            asked = "a GPU" if world == 1 else f"{world} GPUs (one per rank)"
            raise ConfigError(f"train.device={cfg.train.device} with ray.learner=actor asks the Ray "
                              f"cluster for {asked}, and it has {have:g}; set train.device=cpu"
                              + (", lower train.world_size" if world > 1 else "")
                              + ", or start Ray on nodes with GPUs")
    if world == 1:
        return
    fits = [min(int(res.get(k, 0.0) // v) for k, v in bundle.items()) for res in nodes]  # ranks per node
    room = {"STRICT_PACK": max(fits, default=0), "STRICT_SPREAD": sum(f > 0 for f in fits)}.get(
        strategy, sum(fits))
    if room < world:
        raise ConfigError(
            f"train.world_size={world} learner ranks of {bundle} each cannot be placed "
            f"({strategy}) on this Ray cluster: it has room for {room} ({len(nodes)} node(s)); "
            "lower train.world_size or train.threads, raise ray.local_cpus, add nodes, or choose "
            "another ray.learner_placement")


class ActorRanks:
    """The ranks as Ray actors (``world`` ≥ 1)."""

    def __init__(self, ray: Any, cfg: Config, model_path: str, eval_data: DataBundle | None, *,
                 run_dir: str | None = None, startup_timeout_s: float = 300.0) -> None:
        self.ray = ray
        self.world = cfg.train.world_size
        self.group = None
        self.handles: list[Any] = []
        self.pids: list[int | None] = [None] * self.world
        self.nodes: list[str | None] = [None] * self.world
        self._pending: dict[int, Any] = {}  # rank → the reference of its call in progress
        gpus = learner_gpus(cfg)
        try:
            placement = self._place(cfg, startup_timeout_s)
            remote = ray.remote(_LearnerActor)
            self.handles = [
                remote.options(num_cpus=cfg.train.threads, num_gpus=gpus,
                               resources=dict(cfg.ray.learner_resources), max_restarts=0,
                               name=f"tether-learner-{rank}-{os.getpid()}-{id(self):x}", **placement[rank],
                               ).remote(cfg, str(model_path), eval_data, rank, self.world,
                                        None if run_dir is None else str(run_dir))
                for rank in range(self.world)]
            starting = RankGroup(self)
            if self.world > 1:
                address = starting.call("address", ranks=[0], timeout=startup_timeout_s,
                                        doing="while starting")
                starting.call("join", address, timeout=startup_timeout_s, doing="while starting")
            for rank in range(self.world):
                self.send(rank, "describe", ())
            described = starting.collect(list(range(self.world)), "while starting", startup_timeout_s)
        except BaseException:
            self.close()
            raise
        self.pids = [described[r][0] for r in range(self.world)]
        self.nodes = [described[r][1] for r in range(self.world)]
        self.layout = described[0][2]
        self.placement = [described[r][3] for r in range(self.world)]  # each rank's placement group

    def _place(self, cfg: Config, timeout_s: float) -> list[dict]:
        """Check the cluster can hold every rank (``check_placement``); with several, reserve
        their bundles in a placement group, so every rank starts together or none does, on as few
        nodes as ``ray.learner_placement`` allows. Returns the actor options that put rank r in
        bundle r."""
        check_placement(self.ray, cfg)
        if self.world == 1:
            return [{}]
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, strategy = self.ray, cfg.ray.learner_placement
        bundle = rank_bundle(cfg)
        self.group = placement_group([dict(bundle) for _ in range(self.world)], strategy=strategy,
                                     name=f"tether-learner-{os.getpid()}-{id(self):x}")
        ready, _ = ray.wait([self.group.ready()], timeout=timeout_s)
        if not ready:
            raise LearnerLostError(f"the Ray cluster did not place the {self.world} learner ranks "
                                   f"({strategy}, {bundle} each) within {timeout_s:.0f}s: other work "
                                   "holds the resources")
        return [{"scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=rank)} for rank in range(self.world)]

    def send(self, rank: int, method: str, args: tuple) -> None:
        if not self.handles:
            raise LearnerLostError("the learner's actors were stopped")
        args = tuple(self.ray.put(a) if isinstance(a, RolloutBatch) else a for a in args)  # sent once
        self._pending[rank] = self.handles[rank].call.remote(method, *args)

    def next(self, ranks: list[int], doing: str, timeout: float | None) -> Outcome | None:
        """An error inside an actor is its own (Ray's error is also an instance of the original
        class, with the remote traceback); a dead actor is a death."""
        ray = self.ray
        by_ref = {self._pending[r]: r for r in ranks}
        ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=timeout)
        if not ready:
            return None
        return self._outcome(by_ref[ready[0]], ready[0])

    def _outcome(self, rank: int, ref: Any) -> Outcome:
        ray = self.ray
        del self._pending[rank]
        try:
            return Outcome(rank, answer=ray.get(ref))
        except ray.exceptions.RayActorError as exc:
            text = str(exc).strip()
            if "creation task" not in text:  # a death: its first line says enough
                text = text.splitlines()[0] if text else ""
            return Outcome(rank, died=f"{type(exc).__name__}" + (f": {text}" if text else ""))
        except Exception as exc:
            return Outcome(rank, error=exc)

    def dead_among(self, ranks: list[int], wait_s: float = 10.0) -> Outcome | None:
        by_ref = {self._pending[r]: r for r in ranks if r in self._pending}
        ready, _ = self.ray.wait(list(by_ref), num_returns=len(by_ref), timeout=wait_s)
        for ref in ready:
            outcome = self._outcome(by_ref[ref], ref)
            if outcome.died is not None:
                return outcome
        return None

    def death(self, outcome: Outcome, doing: str) -> str:
        rank = outcome.rank
        pid, node = self.pids[rank], self.nodes[rank]
        where = f"pid {pid}, node {node[:8]}" if pid and node else "not started"
        who = "the learner's Ray actor" if self.world == 1 else f"the learner's Ray actor of rank {rank}"
        return f"{who} ({where}) died {doing}: {outcome.died}"

    def weights(self, group: RankGroup) -> RankWeights:
        return ActorWeights(group)

    def close(self, *, grace_s: float = 0.0) -> None:
        """Kill every actor (one blocked in a collective with a dead peer included) and release
        their placement group."""
        self._pending.clear()
        for handle in self.handles:
            with contextlib.suppress(Exception):
                self.ray.kill(handle, no_restart=True)
        self.handles = []
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.group)
            self.group = None
