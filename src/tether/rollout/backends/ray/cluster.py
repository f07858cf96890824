"""Connecting to Ray and what a run asks of the cluster: ``RayOptions`` (the ``ray`` section),
``RaySession`` (connect to ``ray.address`` or start a local instance with no dashboard, no usage
reporting, its temporary directory inside the run directory; it shuts down only what it started),
the start-up checks that refuse a request no node can give (``check_resources``, ``check_fits``,
each listing the nodes' resources), and ``put_snapshot``, how a version goes into the object
store. The pool of rollout actors is ``pool.py``."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tether.errors import ConfigError, RolloutError
from tether.rollout.channel import Layout, Snapshot

log = logging.getLogger("tether.rollout")

# AF_UNIX socket paths are limited to 107 bytes; Ray puts its sockets at
# <temp_dir>/session_<date>_<time>_<usec>_<pid>/sockets/plasma_store (about 62 bytes below temp_dir).
_MAX_TEMP_DIR = 107 - 64


@dataclass(frozen=True)
class RayOptions:
    """The ``ray`` recipe section, resolved."""

    address: str = ""
    local_cpus: int = 0
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    temp_dir: str = ""
    """Where a local instance keeps its logs and sockets; empty = inside the run directory when
    one is given (see ``ray_temp_dir``), else Ray's default."""
    reserved_cpus: float = 0.0
    """CPUs other actors of the run take (the learner's), counted when checking the workers fit."""
    reserved_gpus: float = 0.0
    """GPUs other actors of the run take (a learner actor on CUDA), counted the same way."""
    worker_resources: Mapping[str, float] = field(default_factory=dict)
    """Custom resources each rollout actor requests (``ray.worker_resources``)."""
    learner: Mapping[str, float] = field(default_factory=dict)
    """What each learner actor requests (CPU, GPU and ``ray.learner_resources``); empty without
    learner actors."""
    learner_actors: int = 0
    """How many learner actors the run starts (``train.world_size`` with ``ray.learner=actor``)."""

    @classmethod
    def of(cls, cfg: Any) -> RayOptions:
        """The ``ray`` section of ``cfg``, with what the learner's actors reserve."""
        r, t = cfg.ray, cfg.train
        actors = r.learner == "actor"
        gpu = 1.0 if actors and t.device != "cpu" else 0.0
        learner = {"CPU": float(t.threads), **({"GPU": gpu} if gpu else {}), **r.learner_resources}
        return cls(address=r.address, local_cpus=r.local_cpus,
                   cpus_per_worker=r.cpus_per_worker or float(cfg.rollout.threads_per_worker),
                   gpus_per_worker=r.gpus_per_worker,
                   reserved_cpus=float(t.threads * t.world_size) if actors else 0.0,
                   reserved_gpus=gpu * t.world_size, worker_resources=dict(r.worker_resources),
                   learner=learner if actors else {}, learner_actors=t.world_size if actors else 0)

    def worker_request(self) -> dict[str, float]:
        """What one rollout actor requests, built-in resources and custom ones."""
        gpus = {"GPU": self.gpus_per_worker} if self.gpus_per_worker else {}
        return {"CPU": self.cpus_per_worker, **gpus, **self.worker_resources}


@runtime_checkable
class RemoteWeights(Protocol):
    """Weights that live elsewhere (a learner actor) and put themselves into the object store."""

    layout: Layout

    def put(self, version: int) -> tuple[Any, dict[str, float]]:
        """Write and ``ray.put`` a snapshot of ``version``; return its reference and metrics."""
        ...


def put_snapshot(ray, snapshot: Snapshot, tensors: Mapping[str, Any], version: int) -> tuple[Any, dict]:
    """Write ``tensors`` into the staging block as ``version`` and put it into the object store as
    one object; returns its reference and ``sync/publish_s`` (write + put), ``sync/put_s``,
    ``sync/bytes``."""
    metrics = dict(snapshot.write(tensors, version))
    t0 = time.perf_counter()
    ref = ray.put(snapshot.array)
    metrics["sync/put_s"] = time.perf_counter() - t0
    metrics["sync/publish_s"] += metrics["sync/put_s"]
    return ref, metrics


def require_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("rollout.backend=ray needs Ray: pip install 'tether[ray]' (or set "
                          "rollout.backend=local)") from None
    return ray


def ray_temp_dir(run_dir: Path) -> tuple[str, Path | None]:
    """A temp dir for a local Ray instance: ``run_dir/ray`` when its path is short enough for
    Ray's sockets, else a short directory under /tmp named after the run, linked from
    ``run_dir/ray`` while the instance runs (its reaper then moves its logs into ``run_dir/ray``
    and removes it). Returns (directory, the link to create or None)."""
    inside = (run_dir / "ray").resolve()
    if len(str(inside)) <= _MAX_TEMP_DIR:
        return str(inside), None
    digest = hashlib.sha1(str(inside).encode()).hexdigest()[:12]
    return f"/tmp/tether-ray-{digest}", inside


_NOT_SHOWN = ("memory", "object_store_memory")


def describe_nodes(nodes: Sequence[Mapping[str, Any]]) -> str:
    """Each alive node's id (8 hex digits), address and the resources it offers, for a refusal."""
    def offered(res: Mapping[str, float]) -> str:
        shown = sorted((k not in ("CPU", "GPU"), k, v) for k, v in res.items()
                       if k not in _NOT_SHOWN and not k.startswith("node:"))
        return ", ".join(f"{k} {v:g}" for _, k, v in shown)

    return "; ".join(f"node {n['NodeID'][:8]} ({n.get('NodeManagerAddress', '?')}): {offered(n['Resources'])}"
                     for n in nodes) or "none"


def _holds(node: Mapping[str, Any], request: Mapping[str, float]) -> bool:
    return all(node["Resources"].get(k, 0.0) >= v for k, v in request.items())


def check_resources(ray, num_workers: int, o: RayOptions) -> None:
    """Refuse at once custom resources (``ray.worker_resources``, ``ray.learner_resources``) the
    cluster can never give: a resource no node has, more of it than any node has, an actor's whole
    request (CPUs, GPU and custom resources) that no single node holds, or more of a resource in all
    than the cluster has. The message names the key and lists every node's resources. Checked
    before any actor of the run starts."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    learner_custom = {k: v for k, v in o.learner.items() if k not in ("CPU", "GPU")}
    parts = [("ray.worker_resources", "rollout actor", o.worker_resources, o.worker_request())]
    if o.learner_actors:
        parts.append(("ray.learner_resources", "learner actor", learner_custom, o.learner))
    listing = f"The cluster's nodes: {describe_nodes(nodes)}"
    for key, what, custom, request in parts:
        for name, amount in custom.items():
            most = max((n["Resources"].get(name, 0.0) for n in nodes), default=0.0)
            if amount > most:
                has = "no node of the Ray cluster has it" if most == 0 else f"no node has more than {most:g}"
                raise ConfigError(
                    f"{key} asks each {what} for {amount:g} of the resource {name!r}, and {has}; start "
                    f"nodes that offer it (`ray start --address=<head>:6379 --resources='{{\"{name}\": "
                    f"{amount:g}}}'`) or change {key}. {listing}")
        if custom and not any(_holds(n, request) for n in nodes):
            asked = ", ".join(f"{k} {v:g}" for k, v in request.items())
            raise ConfigError(f"no node of the Ray cluster holds a whole {what} ({asked}: {key} with its "
                              f"CPUs and GPUs); change {key} or the CPUs it asks for. {listing}")
    for name in sorted({*o.worker_resources, *learner_custom}):
        terms = [(count, amount, f"{what} × ray.{key}[{name!r}]") for count, amount, what, key in (
            (num_workers, o.worker_resources.get(name, 0.0), "rollout actor(s)", "worker_resources"),
            (o.learner_actors, learner_custom.get(name, 0.0), "learner actor(s)", "learner_resources"))
            if count and amount]
        need = sum(count * amount for count, amount, _ in terms)
        have = sum(n["Resources"].get(name, 0.0) for n in nodes)
        if need > have:
            asked = " and ".join(f"{count} {what}={amount:g}" for count, amount, what in terms)
            raise ConfigError(f"{asked} need {need:g} of {name!r}, and the Ray cluster has {have:g}; lower "
                              f"rollout.num_workers or the amounts, or add nodes that offer it. {listing}")


def check_fits(ray, num_workers: int, o: RayOptions) -> None:
    """Refuse at once a request the cluster can never place (instead of waiting on it): the rollout
    actors with what the learner's actors reserve. Checked before any actor of the run starts."""
    check_resources(ray, num_workers, o)
    alive = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    nodes = [r.get("CPU", 0.0) for r in alive]
    need = num_workers * o.cpus_per_worker + o.reserved_cpus
    if o.cpus_per_worker > max(nodes, default=0.0) or need > sum(nodes):
        per_node = ", ".join(f"{c:g}" for c in nodes) or "none"
        learner = f" plus {o.reserved_cpus:g} for the learner's actors" if o.reserved_cpus else ""
        raise ConfigError(
            f"{num_workers} rollout actor(s) × ray.cpus_per_worker={o.cpus_per_worker:g} "
            f"CPUs{learner} do not fit the Ray cluster's nodes (CPUs per node: {per_node}); lower "
            "rollout.num_workers or ray.cpus_per_worker, or add nodes (with a local instance: raise "
            "ray.local_cpus)")
    if o.gpus_per_worker > 0:
        gpus = [r.get("GPU", 0.0) for r in alive]
        need = num_workers * o.gpus_per_worker + o.reserved_gpus
        if o.gpus_per_worker > max(gpus, default=0.0) or need > sum(gpus):
            learner = f" plus {o.reserved_gpus:g} for the learner's actors" if o.reserved_gpus else ""
            raise ConfigError(
                f"{num_workers} rollout actor(s) × ray.gpus_per_worker={o.gpus_per_worker:g} GPUs"
                f"{learner} do not fit the Ray cluster's nodes (GPUs per node: "
                f"{', '.join(f'{g:g}' for g in gpus) or 'none'}); set ray.gpus_per_worker=0 to sample "
                "on CPUs, lower rollout.num_workers, or start Ray on nodes with GPUs")


class RaySession:
    """Connects to a cluster or starts a local instance; ``close`` undoes only what it did."""

    def __init__(self, options: RayOptions, run_dir: Path | None = None) -> None:
        self.ray = require_ray()
        self.started = False
        self.connected = False
        self.reaper = None
        if self.ray.is_initialized():
            log.info("ray: using the Ray instance this process is already connected to")
            return
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        common = dict(include_dashboard=False, configure_logging=False, log_to_driver=True)
        if options.address:
            try:
                self.ray.init(address=options.address, **common)
            except Exception as exc:  # Ray raises ConnectionError and others
                raise ConfigError(f"could not connect to the Ray cluster at ray.address="
                                  f"{options.address!r}: {exc}; start it with `ray start --head`, or "
                                  "leave ray.address empty to start a local instance") from exc
            self.connected = True
            log.info("ray: connected to %s", options.address)
            return
        temp_dir, link = options.temp_dir or None, None
        if temp_dir is None and run_dir is not None:
            temp_dir, link = ray_temp_dir(run_dir)
            if link is not None:
                Path(temp_dir).mkdir(parents=True, exist_ok=True)
                if not link.exists() and not link.is_symlink():  # else an earlier attempt's logs
                    link.parent.mkdir(parents=True, exist_ok=True)
                    link.symlink_to(temp_dir)
        from tether.rollout.backends.ray.reaper import Reaper

        # the instance's processes die with this run, even a killed one; a temp dir under /tmp
        # comes home to the run's `ray` folder once they have
        self.reaper = Reaper(home=(temp_dir, link) if link is not None else None)
        try:
            with self.reaper.marking():
                self.ray.init(num_cpus=options.local_cpus or None, _temp_dir=temp_dir, **common)
        except Exception as exc:
            self.reaper.close()
            raise RolloutError(f"could not start a local Ray instance (temp dir {temp_dir or 'default'}): "
                               f"{type(exc).__name__}: {exc}") from exc
        self.started = True
        log.info("ray: started a local instance (temp dir %s)", temp_dir or "Ray's default")

    def close(self) -> None:
        if self.started or self.connected:
            self.ray.shutdown()
            self.started = self.connected = False
        if self.reaper is not None:
            self.reaper.close()  # kills what the shutdown left behind
            self.reaper = None
