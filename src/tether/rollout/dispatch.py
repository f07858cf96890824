"""What every rollout-pool backend shares: the ``RolloutPool`` protocol over N workers.

Launches go to an idle worker, oldest first, or wait in order for one; each worker generates one
batch at a time. Completed batches are checked whole and go into one completion FIFO, from which
``reap``, ``wait`` and ``quiesce`` take them; the first error (a worker's failure, or its death)
reaches whoever waits next. A backend supplies how an item reaches a worker (``_submit``), how
weights reach every worker (``_load_all``) and how workers stop (``close``): ``ProcessPool``
(``tether.rollout.backends.local.pool``) with pipes and shared memory, ``RayPool``
(``tether.rollout.backends.ray.pool``) with actors and the object store.

A worker's death (``_lose``, from a backend's collector) fails the run with
``rollout.on_worker_loss: stop``. With ``replace`` it is left for the driver's thread, which meets
it at its next call (a ``None`` in the completion FIFO wakes it): ``_recover`` starts a new worker
holding the published version (``_replace``, the backend's), and the batch the lost one held
leaves the pool's count and is reported by ``lost`` for the driver to launch again, so only the
driver's thread ever changes what is in flight or publishes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tether.control import BatchQueue
from tether.errors import QueueTimeoutError, RolloutError, WorkerRestartLimitError
from tether.rollout.settings import PoolSettings
from tether.vocabulary import Example, GenerationRequest, Payload, RolloutBatch, WorkerLoss, WorkItem

log = logging.getLogger("tether.rollout")


class WorkerSlot:
    """The pool's view of one worker: its name, the batch it is generating, whether it lives."""

    def __init__(self, worker_id: int) -> None:
        self.id = worker_id
        self.name = f"rollout-{worker_id}"
        self.batch: int | None = None
        self.alive = True
        self.held = -1
        """The newest version it reported taking up while generating (process workers)."""


class DispatchingPool:
    """The protocol logic of a pool of ``WorkerSlot``s; backends subclass it."""

    def __init__(self, settings: PoolSettings, batches: Callable[[int], Sequence[tuple[int, Example]]],
                 *, initial_version: int = 0,
                 extras: Callable[[int], Sequence[tuple[int, Example]]] | None = None) -> None:
        assert (settings.cfg.dynamic_sampling() is None) == (extras is None), (
            "dynamic sampling needs both rollout.dynamic_sampling and the extra prompts")
        self.settings = settings
        self.params = settings.cfg.sampling()
        self.dynamic = settings.cfg.dynamic_sampling()
        self.batches = batches
        self.extras = extras
        self.version = initial_version
        self._completed: BatchQueue[RolloutBatch | None] = BatchQueue(maxsize=1 << 16, name="rollout")
        self._lock = threading.Lock()
        self._pending: deque[WorkItem] = deque()
        self._launched_at: dict[int, float] = {}
        self._inflight = 0
        self._closing = False
        self._workers: list[Any] = []  # WorkerSlot subclasses
        self.served: dict[str, int] = {}
        """Batches each worker has completed, by worker name."""
        self._deaths = threading.Lock()  # never held while taking ``_lock``
        self._dead: deque[tuple[Any, RolloutError]] = deque()  # reported, not yet replaced
        self._losses: list[WorkerLoss] = []  # replaced, not yet handed to the driver
        self.restarts = 0
        """Workers replaced so far (``rollout.on_worker_loss: replace``)."""

    # -- backend hooks ------------------------------------------------------------------------

    def _submit(self, w: Any, item: WorkItem) -> None:
        """Start ``item`` on idle worker ``w``; report failures through ``_fail``. Lock held."""
        raise NotImplementedError

    def _load_all(self, weights: Mapping[str, Any], version: int) -> dict[str, float]:
        """Make every worker verify and load ``weights`` as ``version``; return sync metrics
        including ``sync/publish_s``, ``sync/bytes`` and ``sync/load_s`` (the slowest load)."""
        raise NotImplementedError

    def _put_inflight(self, weights: Mapping[str, Any], version: int) -> dict[str, float]:
        """Without draining: make ``weights`` readable as ``version`` while workers generate
        (each switches to it between decode steps); return ``sync/publish_s``, ``sync/bytes``."""
        raise NotImplementedError(f"{type(self).__name__} publishes only between batches")

    def _holds(self, w: Any) -> int:
        """The version worker ``w``'s engine samples with now (as last reported)."""
        raise NotImplementedError

    def _replace(self, w: Any, version: int) -> None:
        """Put a new worker into dead ``w``'s slot of ``_workers`` (same id and name), started and
        holding ``version`` (loaded with the checks of a publication)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the RolloutPool protocol -------------------------------------------------------------

    @property
    def inflight(self) -> int:
        with self._lock:
            return self._inflight

    def launch(self, request: GenerationRequest) -> None:
        if request.version != self.version:
            raise RolloutError(
                f"launch stamped version {request.version} but the workers hold {self.version}",
                batch_index=request.index,
            )
        s = self.settings
        item = WorkItem(batch_index=request.index, version=request.version,
                        examples=list(self.batches(request.index)), group_size=s.group_size,
                        params=self.params, seed=s.cfg.run.seed * 1_000_003 + request.index,
                        dynamic=self.dynamic,
                        extra_examples=[] if self.extras is None else
                        [(-1 - pos, ex) for pos, ex in self.extras(request.index)])
        with self._lock:
            self._inflight += 1
            self._launched_at[request.index] = time.monotonic()
            self._pending.append(item)
            self._dispatch()

    def reap(self) -> list[RolloutBatch]:
        return self._taken(self._completed.drain())

    def wait(self, timeout: float | None) -> list[RolloutBatch]:
        """Also returns, possibly empty, when a worker was lost (``lost`` says which)."""
        try:
            first = self._completed.get(timeout=timeout)
        except QueueTimeoutError:
            raise self._timeout_error(timeout) from None
        return self._taken([first, *self._completed.drain()])

    def lost(self) -> list[WorkerLoss]:
        """Workers lost and replaced since the last call; their batches are out of ``inflight``."""
        self._recover()
        losses, self._losses = self._losses, []
        return losses

    def quiesce(self, timeout: float | None) -> list[RolloutBatch]:
        """Every in-flight batch, waiting at most ``timeout`` seconds for each next completion."""
        out: list[RolloutBatch | None] = []
        while self.inflight - sum(b is not None for b in out) > 0:
            try:
                out.append(self._completed.get(timeout=timeout))
            except QueueTimeoutError:
                raise self._timeout_error(timeout) from None
            if out[-1] is None:
                self._recover()  # a lost batch leaves ``inflight``: nothing more to wait for
        return self._taken(out)

    def publish(self, weights: Mapping[str, Any], version: int) -> Mapping[str, float]:
        """Have every worker verify and load ``weights`` as ``version``: while quiesced, or —
        without draining — as they generate (they switch between decode steps)."""
        self._recover()
        if not self.settings.inflight.drains:
            metrics = self._put_inflight(weights, version)
            self.version = version
            seconds = metrics["sync/publish_s"]
            metrics["sync/gbps"] = metrics["sync/bytes"] / seconds / 1e9 if seconds > 0 else 0.0
            metrics["sync/inflight_batches"] = float(self.inflight)
            if self.settings.drain_at_turns:
                metrics["sync/turn_wait_s"] = self._await_turns(version)
            return metrics
        if self.inflight:
            raise RolloutError(f"publish of version {version} while {self.inflight} batch(es) are in flight")
        t0 = time.perf_counter()
        metrics = self._load_all(weights, version)
        self.version = version
        metrics["sync/load_wall_s"] = time.perf_counter() - t0 - metrics["sync/publish_s"]
        total = metrics["sync/publish_s"] + metrics["sync/load_s"]
        metrics["sync/gbps"] = metrics["sync/bytes"] / total / 1e9 if total > 0 else 0.0
        return metrics

    # -- shared internals ---------------------------------------------------------------------

    def _await_turns(self, version: int) -> float:
        """Draining at turn boundaries: wait until every worker generating holds ``version`` (each
        takes it up as its turns in flight end) or has finished its batch; returns the seconds."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.settings.startup_timeout_s
        pause = 0.001
        while True:
            with self._lock:
                generating = [w for w in self._workers if w.alive and w.batch is not None]
            behind = [w for w in generating if self._holds(w) < version]
            if not behind:
                return time.perf_counter() - t0
            if time.monotonic() > deadline:
                names = ", ".join(w.name for w in behind)
                raise RolloutError(f"{names} did not reach a turn boundary to take up version {version} "
                                   f"within {self.settings.startup_timeout_s:.0f}s",
                                   worker=behind[0].name, batch_index=behind[0].batch)
            time.sleep(pause)
            pause = min(2 * pause, 0.02)

    def _taken(self, batches: list[RolloutBatch | None]) -> list[RolloutBatch]:
        batches = [b for b in batches if b is not None]  # a wake-up for a lost worker
        with self._lock:
            self._inflight -= len(batches)
            for b in batches:
                self._launched_at.pop(b.index, None)
        return batches

    def _dispatch(self) -> None:
        """Send pending items to idle workers, oldest first. Caller holds the lock."""
        for w in self._workers:
            if not self._pending:
                return
            if w.alive and w.batch is None:
                item = self._pending.popleft()
                w.batch = item.batch_index
                self._submit(w, item)

    def _fail(self, err: RolloutError) -> None:
        """Report ``err`` to whoever waits for a batch (and, in backends, for a weight load)."""
        self._completed.report_error(err)

    def _wake_waiters(self) -> None:
        """Wake whoever waits (a collector reported a death); backends add their own waits."""
        self._completed.put(None)

    def _lose(self, w: Any, err: RolloutError) -> None:
        """Worker ``w`` died (``err`` says how), reported once: fail the run
        (``rollout.on_worker_loss: stop``), or leave it for ``_recover``."""
        if self._closing or self.settings.cfg.rollout.on_worker_loss == "stop":
            self._fail(err)
            return
        with self._deaths:
            self._dead.append((w, err))
        self._wake_waiters()

    def _recover(self, version: int | None = None) -> list[int]:
        """The driver's thread: replace every worker reported dead with one holding ``version``
        (default: the published one) and take the batch each held out of ``inflight``, for
        ``lost``; past ``rollout.max_worker_restarts`` raise instead. Returns the slots replaced."""
        cap = self.settings.cfg.rollout.max_worker_restarts
        replaced = []
        while True:
            with self._deaths:
                if not self._dead:
                    return replaced
                w, err = self._dead.popleft()
            if self.restarts >= cap:
                raise WorkerRestartLimitError(
                    f"{err.message}; {self.restarts} worker(s) already replaced in this run, the most "
                    f"rollout.max_worker_restarts={cap} allows: raise rollout.max_worker_restarts, or "
                    "find why the workers die (the log above)", worker=w.name, batch_index=w.batch)
            self.restarts += 1
            index = w.batch
            log.warning("worker %s: %s; replacing it (%d of rollout.max_worker_restarts=%d)%s", w.name,
                        err.message, self.restarts, cap,
                        "" if index is None else f"; batch {index} is to be generated again")
            self._replace(w, self.version if version is None else version)
            with self._lock:
                if index is not None:
                    self._inflight -= 1
                    self._launched_at.pop(index, None)
                self._dispatch()
            self._losses.append(WorkerLoss(worker=w.name, cause=err.message, batch_index=index,
                                           restarts=self.restarts))
            replaced.append(w.id)

    def _timeout_error(self, timeout: float | None) -> RolloutError:
        with self._lock:
            running = [(w.batch, w.name) for w in self._workers if w.batch is not None]
            oldest = min(self._launched_at, default=None)
        where = next((name for b, name in running if b == oldest), "none (still queued)")
        return RolloutError(
            f"no rollout batch completed within async.wait_timeout_s={timeout:g}s; the oldest in "
            f"flight is batch {oldest} on worker {where}",
            worker=where if where.startswith("rollout") else None, batch_index=oldest,
        )

    def _accept(self, w: Any, index: int, scored: Payload) -> None:
        """A worker's finished batch: check it is whole, free the worker, queue the batch."""
        try:
            scored.check()
            expected = len(self.batches(index))
            if scored.num_groups != expected or scored.group_size != self.settings.group_size:
                raise ValueError(f"{scored.num_groups} groups of {scored.group_size}, expected "
                                 f"{expected} of {self.settings.group_size}")
        except ValueError as exc:
            self._fail(RolloutError(f"incomplete rollout batch: {exc}", worker=w.name, batch_index=index))
            return
        shares = scored.version_shares()
        oldest, newest = min(shares, default=0), max(shares, default=0)
        metrics = {**scored.metrics, "async/newest_version": float(newest)}
        batch = RolloutBatch(index=index, behavior_version=oldest, newest_version=newest,
                             num_groups=scored.num_groups, group_size=scored.group_size, payload=scored,
                             metrics=metrics, version_shares=shares or None,
                             completed_at=time.monotonic(),
                             work_s=metrics.get("time/generate", 0.0) + metrics.get("time/score", 0.0))
        with self._lock:
            w.batch = None
            self.served[w.name] = self.served.get(w.name, 0) + 1
            self._dispatch()
        self._completed.put(batch)
