"""The Ray backend: rollout workers as Ray actors, weights through Ray's object store.

``RayPool`` implements the same ``RolloutPool`` protocol as ``ProcessPool`` (the dispatch logic is
``DispatchingPool``'s), so the driver loop and the control plane run unchanged across a cluster:

- Each worker is an actor (``_RolloutActor``) hosting the same ``Rollout`` (engine + reward) as a
  local worker process, with its own resource request (``ray.cpus_per_worker``, and
  ``ray.gpus_per_worker``: an actor given a GPU samples on it) and no restarts by Ray: a dead
  actor (its node gone with it) is reported like a dead process, and either fails the run or,
  with ``rollout.on_worker_loss: replace``, is replaced by a new actor (wherever the cluster has
  room) that loads the published version, its batch launched again by the driver.
- A publication writes the weights into one staging block (the channel's format: header with
  state, version and checksum, then every tensor) and puts it into the object store as one
  object. Each actor fetches it (zero-copy on its node), verifies version and checksum, and binds
  its parameters to it (an actor on a GPU copies it to the device instead). The pool holds a
  reference to the newest version only, and an actor drops its old snapshot when it binds the
  next, so each version's object is released once no worker needs it. With
  ``rollout.weight_sync=collective`` the driver broadcasts each version to the actors instead
  (``tether.rollout.collective``, gloo over TCP between host blocks: an actor on a GPU copies what
  it received to its device).
- A collector thread waits on the actors' result references and accepts finished batches in
  completion order (ties within one wake-up are ordered by the actors' finish times).

Connecting to Ray (``RaySession``), the start-up resource checks and the object-store write are
``cluster.py``'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tether.errors import RolloutError
from tether.procinfo import Sealed, failure_traceback
from tether.rollout.backends.ray.cluster import (
    RayOptions,
    RaySession,
    RemoteWeights,
    check_fits,
    put_snapshot,
)
from tether.rollout.channel import Layout, Snapshot, open_snapshot
from tether.rollout.collective import CollectivePublisher
from tether.rollout.dispatch import DispatchingPool, WorkerSlot
from tether.rollout.settings import PoolSettings, WorkerSpec
from tether.vocabulary import Example, WorkItem

log = logging.getLogger("tether.rollout")

class _RolloutActor:
    """A rollout worker as a Ray actor. Every method answers with a message tuple in the same
    shapes as a worker process's, so failures carry the original traceback.

    Without draining (``inflight_update``) the actor runs two threads (``max_concurrency=2``):
    ``offer`` verifies a newer snapshot while ``generate`` runs, and the engine binds it at its next
    decode step (object-store snapshots are immutable: nothing can tear them)."""

    def __init__(self, sealed: Sealed, layout: Layout) -> None:
        self.sealed = sealed  # the WorkerSpec, opened by ``start``: a failure there is its answer
        self.spec: WorkerSpec | None = None
        self.layout = layout
        self.rollout = None
        self._offered: tuple[dict, int] | None = None  # (views, version), verified, not yet bound
        self._lock = threading.Lock()

    def start(self) -> tuple:
        try:
            from tether.rollout.worker import Rollout

            self.spec = self.sealed.open()
            self.rollout = Rollout(self.spec)
            if not self.spec.inflight.drains:
                self.rollout.watch(self._take_offered)
        except BaseException as exc:  # a recipe's mistake (a plug-in that fails here) says it all
            return ("error", None, f"failed to start: {type(exc).__name__}: {exc}",
                    failure_traceback(exc))
        import ray

        return ("ready", os.getpid(), ray.get_runtime_context().get_node_id())

    def load(self, snapshot, version: int) -> tuple:
        try:
            from tether.rollout.channel import open_snapshot

            views, seconds = open_snapshot(snapshot, self.layout, version)
            # share the fetched object; the previous version's is released
            self.rollout.use_weights(views, version)
            return ("loaded", version, seconds)
        except BaseException as exc:
            return ("error", None, f"loading version {version}: {type(exc).__name__}: {exc}",
                    traceback.format_exc())

    def offer(self, snapshot, version: int) -> tuple:
        """Verify ``version`` and leave it for the engine's next decode step (without draining)."""
        try:
            from tether.rollout.channel import open_snapshot

            views, seconds = open_snapshot(snapshot, self.layout, version)
            with self._lock:
                if self._offered is None or self._offered[1] < version:
                    self._offered = (views, version)
            return ("offered", version, seconds)
        except BaseException as exc:
            return ("error", None, f"verifying version {version}: {type(exc).__name__}: {exc}",
                    traceback.format_exc())

    def join(self, address, rank: int, version: int) -> tuple:
        """Join the collective weight group as ``rank`` and take ``version``, the first."""
        try:
            from tether.rollout.collective import CollectiveReceiver

            self.receiver = CollectiveReceiver(address, rank, self.layout)
            seconds = self.receiver.receive(version)
            self.rollout.use_weights(self.receiver.views(), version)
            return ("loaded", version, seconds)
        except BaseException as exc:
            return ("error", None, f"joining the weight group: {type(exc).__name__}: {exc}",
                    traceback.format_exc())

    def receive(self, version: int) -> tuple:
        """Receive ``version`` from the collective group, verify it, and load it."""
        try:
            seconds = self.receiver.receive(version)
            self.rollout.engine.load_weights(self.receiver.views(), version)
            return ("loaded", version, seconds)
        except BaseException as exc:
            return ("error", None, f"receiving version {version}: {type(exc).__name__}: {exc}",
                    traceback.format_exc())

    def held(self) -> int:
        """The version the engine samples with now."""
        return self.rollout.engine.version

    def _take_offered(self) -> int | None:
        with self._lock:
            offered, self._offered = self._offered, None
        if offered is None or offered[1] <= self.rollout.engine.version:
            return None
        self.rollout.use_weights(*offered)
        return offered[1]

    def generate(self, item: WorkItem) -> tuple:
        try:
            if not self.spec.inflight.drains:
                self.rollout.start_at(item.version)
            batch = self.rollout.generate(item)
            return ("batch", item.batch_index, batch, time.time())
        except BaseException as exc:
            return ("error", item.batch_index, f"{type(exc).__name__}: {exc}", traceback.format_exc())


class _Actor(WorkerSlot):
    def __init__(self, worker_id: int, handle: Any) -> None:
        super().__init__(worker_id)
        self.handle = handle
        self.pid: int | None = None
        self.node: str | None = None


class RayPool(DispatchingPool):
    """N rollout actors behind the ``RolloutPool`` protocol."""

    def __init__(self, settings: PoolSettings, batches: Callable[[int], Sequence[tuple[int, Example]]],
                 initial_weights: Mapping[str, Any] | RemoteWeights, *, options: RayOptions | None = None,
                 session: RaySession | None = None, run_dir: Path | None = None,
                 initial_version: int = 0,
                 extras: Callable[[int], Sequence[tuple[int, Example]]] | None = None) -> None:
        """``initial_weights``: tensors (the learner is in this process) or ``RemoteWeights``.
        ``session``: a Ray session the caller owns; without one the pool starts its own (from
        ``options`` and ``run_dir``) and closes it with the pool."""
        super().__init__(settings, batches, initial_version=initial_version, extras=extras)
        options = options if options is not None else RayOptions()
        self.options = options
        self._workers: list[_Actor] = []
        self._running: dict[Any, _Actor] = {}  # result ref → the actor generating it
        self._wake = threading.Event()
        self._weights_ref = None
        self._staged_version: int | None = None  # the version in the staging block, if any
        self.sync: CollectivePublisher | None = None
        self._receiving: dict[Any, _Actor] = {}  # the actors' calls in the broadcast under way
        self._collector: threading.Thread | None = None
        self._own_session = session is None
        self.session = RaySession(options, run_dir) if session is None else session
        self.ray = self.session.ray
        try:
            if isinstance(initial_weights, RemoteWeights):
                self.snapshot, self.layout = None, initial_weights.layout
            else:
                self.snapshot: Snapshot | None = Snapshot.for_tensors(initial_weights)
                self.layout = self.snapshot.layout
            self._start_actors()
            if settings.cfg.rollout.weight_sync == "collective":
                metrics = self._join_group(initial_weights, initial_version)
            else:
                metrics = self._load_all(initial_weights, initial_version)
            log.info("ray: %d rollout actor(s) ready on node(s) %s; version %d loaded in %.2fs",
                     len(self._workers), ", ".join(str(w.node)[:8] for w in self._workers), initial_version,
                     metrics["sync/load_s"])
        except BaseException:
            self.close()
            raise
        self._collector = threading.Thread(target=self._collect, name="tether-ray-collector", daemon=True)
        self._collector.start()

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self._workers if w.pid is not None]

    @property
    def nodes(self) -> list[str | None]:
        """The Ray node id each actor runs on, by worker (None before it started)."""
        return [w.node for w in self._workers]

    # -- lifecycle ----------------------------------------------------------------------------

    def _start_actors(self) -> None:
        self._check_fits()
        self._workers = [self._new_actor(i) for i in range(self.settings.num_workers)]
        self._await_started(self._workers)

    def _new_actor(self, i: int) -> _Actor:
        """Actor ``i``, created (not yet started)."""
        s, o = self.settings, self.options
        spec = s.worker_spec(i, self.version, device="cuda" if o.gpus_per_worker > 0 else "cpu")
        handle = self.ray.remote(_RolloutActor).options(
            num_cpus=o.cpus_per_worker, num_gpus=o.gpus_per_worker,
            resources=dict(o.worker_resources), max_restarts=0,
            name=f"tether-rollout-{i}-{os.getpid()}-{id(self):x}-{self.restarts}",
            max_concurrency=1 if s.inflight.drains else 2,
        ).remote(Sealed(spec), self.layout)
        return _Actor(i, handle)

    def _replace(self, w: _Actor, version: int) -> None:
        new = self._new_actor(w.id)
        try:
            self._await_started([new])
            msg = self._get(new, new.handle.load.remote(self._weights_ref, version),
                            f"while loading version {version}", timeout=self.settings.startup_timeout_s)
            if msg[0] == "error":
                raise RolloutError(msg[2], worker=new.name, remote_traceback=msg[3])
        except BaseException:
            with contextlib.suppress(Exception):
                self.ray.kill(new.handle, no_restart=True)
            raise
        self._workers[w.id] = new
        with contextlib.suppress(Exception):  # gone already; make sure
            self.ray.kill(w.handle, no_restart=True)

    def _await_started(self, workers: list[_Actor]) -> None:
        s, o, ray = self.settings, self.options, self.ray
        pending = {w.handle.start.remote(): w for w in workers}
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=s.startup_timeout_s)
        for ref, w in pending.items():
            if ref not in ready:
                raise RolloutError(
                    f"did not start within {s.startup_timeout_s:.0f}s; the cluster may lack the "
                    f"resources it asks for (ray.cpus_per_worker={o.cpus_per_worker:g}, "
                    f"ray.gpus_per_worker={o.gpus_per_worker:g}, ray.worker_resources="
                    f"{dict(o.worker_resources)}; available: "
                    f"{ray.available_resources()})", worker=w.name)
            msg = self._get(w, ref, "while starting")
            if msg[0] == "error":
                raise RolloutError(msg[2], worker=w.name, remote_traceback=msg[3])
            _, w.pid, w.node = msg

    def _check_fits(self) -> None:
        check_fits(self.ray, self.settings.num_workers, self.options)

    def close(self) -> None:
        """Kill every actor, release the weights and shut down the Ray instance this pool started, if it did;
        idempotent. A batch still generating is abandoned."""
        self._closing = True
        self._wake.set()
        if self._collector is not None:
            self._collector.join(5)
            self._collector = None
        for w in self._workers:
            with contextlib.suppress(Exception):
                self.ray.kill(w.handle, no_restart=True)
            w.alive = False
        self._running.clear()
        self._weights_ref = None
        if self.sync is not None:
            self.sync.close()
        self._completed.close()
        if self._own_session:
            self.session.close()

    def published_weights(self) -> dict[str, Any]:
        """A copy of the weights the actors hold: the staging block when this process publishes,
        else the newest snapshot fetched back from the object store (checked whole)."""
        if self.sync is not None:
            self.sync.block.verify(self.version)
            return {name: t.clone() for name, t in self.sync.block.views.items()}
        if self.snapshot is not None and self._staged_version == self.version:
            array = self.snapshot.array
        else:
            if self._weights_ref is None:
                raise RolloutError("no published snapshot is held")
            array = self.ray.get(self._weights_ref, timeout=60)
        views, _ = open_snapshot(array, self.layout, self.version)
        return {name: t.clone() for name, t in views.items()}

    # -- backend hooks ------------------------------------------------------------------------

    def _submit(self, w: _Actor, item: WorkItem) -> None:
        self._running[w.handle.generate.remote(item)] = w
        self._wake.set()

    def _load_all(self, weights: Mapping[str, Any] | RemoteWeights, version: int, *,
                  method: str = "load") -> dict[str, float]:
        """Put ``version`` into the object store and have every actor ``load`` it (between
        batches), or ``offer`` it to every actor (without draining: bound at its next decode step)."""
        dead = [w.name for w in self._workers if not w.alive]
        if dead:
            raise RolloutError(f"cannot publish version {version}: {', '.join(dead)} died")
        if self.sync is not None:
            return self._broadcast({w.handle.receive.remote(version): w for w in self._workers},
                                   weights, version)
        if isinstance(weights, RemoteWeights):
            ref, metrics = weights.put(version)
        else:
            assert self.snapshot is not None, "this pool was started with remote weights; publish those"
            ref, metrics = put_snapshot(self.ray, self.snapshot, weights, version)
            self._staged_version = version
        # what a replacement loads; the previous version's object goes once the actors rebind
        self._weights_ref = ref
        loads = {getattr(w.handle, method).remote(ref, version): w for w in self._workers}
        seconds = [0.0]
        for call, w in loads.items():
            try:
                msg = self._get(w, call, f"while loading version {version}",
                                timeout=self.settings.startup_timeout_s)
            except RolloutError:
                if w.alive or self.settings.cfg.rollout.on_worker_loss == "stop":
                    raise
                continue  # it died: its replacement (below) starts holding this version
            if msg[0] == "error":
                raise RolloutError(msg[2], worker=w.name, remote_traceback=msg[3])
            seconds.append(msg[2])
        self._recover(version)
        metrics["sync/load_s"] = max(seconds)
        return metrics

    def _join_group(self, weights: Mapping[str, Any], version: int) -> dict[str, float]:
        """``rollout.weight_sync=collective``: open the group on this node, have every actor join
        it, and broadcast the first version."""
        r = self.settings.cfg.rollout
        self.sync = CollectivePublisher(self.layout, [w.name for w in self._workers],
                                        timeout_s=r.weight_sync_timeout_s, port=r.weight_sync_port,
                                        host=self.ray.util.get_node_ip_address(), gone=self._gone)
        calls = {w.handle.join.remote(self.sync.address, w.id + 1, version): w for w in self._workers}
        self._receiving = calls
        self.sync.join()
        return self._broadcast(calls, weights, version)

    def _broadcast(self, calls: dict, weights: Mapping[str, Any], version: int) -> dict[str, float]:
        """Broadcast ``version`` while every actor's ``calls`` receive it; wait for their loads."""
        self._receiving = calls
        metrics = dict(self.sync.publish(weights, version))
        seconds = []
        for call, w in calls.items():
            msg = self._get(w, call, f"while receiving version {version}",
                            timeout=self.settings.cfg.rollout.weight_sync_timeout_s)
            if msg[0] == "error":
                raise RolloutError(msg[2], worker=w.name, remote_traceback=msg[3])
            seconds.append(msg[2])
        self._receiving = {}
        metrics["sync/load_s"] = max(seconds)
        return metrics

    def _gone(self) -> list[str]:
        """The actors of the broadcast under way that died (waiting up to 2 s for their calls)."""
        ray, gone = self.ray, []
        ready, _ = ray.wait(list(self._receiving), num_returns=len(self._receiving), timeout=2.0)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                gone.append(self._receiving[ref].name)
        return gone

    def _put_inflight(self, weights: Mapping[str, Any] | RemoteWeights, version: int) -> dict[str, float]:
        return self._load_all(weights, version, method="offer")

    def _holds(self, w: _Actor) -> int:
        try:
            return self.ray.get(w.handle.held.remote(), timeout=self.settings.startup_timeout_s)
        except Exception as exc:  # a dead actor: its death reaches the run through its batch
            raise RolloutError(f"asking which version it holds: {type(exc).__name__}: {exc}",
                               worker=w.name, batch_index=w.batch) from exc

    # -- internals ----------------------------------------------------------------------------

    def _get(self, w: _Actor, ref: Any, doing: str, timeout: float | None = None) -> tuple:
        """``ray.get`` one actor call; an actor's death becomes a ``RolloutError`` naming it."""
        ray = self.ray
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise RolloutError(f"did not answer within {timeout:.0f}s {doing}", worker=w.name) from None
        except ray.exceptions.RayActorError as exc:
            raise self._death(w, exc, doing) from None

    def _death(self, w: _Actor, exc: BaseException, doing: str) -> RolloutError:
        """The error of ``w``'s death, reported once (``_lose``) however many calls find it."""
        cause = str(exc).strip().splitlines()
        where = f"pid {w.pid}, node {w.node[:8]}" if w.pid is not None and w.node else "not started"
        err = RolloutError(f"Ray actor ({where}) died {doing}: {type(exc).__name__}"
                           + (f": {cause[0]}" if cause else ""), worker=w.name, batch_index=w.batch)
        with self._deaths:
            first, w.alive = w.alive, False
        if first:
            self._lose(w, err)
        return err

    def _collect(self) -> None:
        """Collector thread: finished generations, in completion order, until the pool closes."""
        ray = self.ray
        while not self._closing:
            self._wake.clear()
            with self._lock:
                refs = list(self._running)
            if not refs:
                self._wake.wait(0.05)
                continue
            first, _ = ray.wait(refs, num_returns=1, timeout=0.05)
            if not first:
                continue
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            finished = []
            for ref in ready:
                with self._lock:
                    w = self._running.pop(ref)
                try:
                    msg = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    self._death(w, exc, f"while generating batch {w.batch}")
                    continue
                except Exception as exc:  # a Ray-level failure of the call itself
                    self._fail(RolloutError(f"{type(exc).__name__}: {exc}", worker=w.name,
                                            batch_index=w.batch))
                    continue
                if msg[0] == "error":
                    self._fail(RolloutError(msg[2], worker=w.name, batch_index=msg[1],
                                            remote_traceback=msg[3]))
                    continue
                finished.append((msg[3], w, msg[1], msg[2]))
            for _at, w, index, scored in sorted(finished, key=lambda f: f[0]):
                self._accept(w, index, scored)
