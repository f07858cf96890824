"""Fakes for both seams, shipped in the package so the whole pipeline runs in seconds.

``FakePool`` generates on real threads (so the loop is exercised concurrently) and stamps the
version its "engine" holds into the data it returns; ``FakeLearner`` reads that stamp back. Tests
therefore measure staleness from the data, not from the loop's own bookkeeping. ``FakePool``'s
``lose_at`` loses a batch's first generation with its "worker", as a replaced worker's would be.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tether.control import BatchQueue
from tether.errors import ControlError, RolloutError
from tether.vocabulary import GenerationRequest, LoopState, RolloutBatch, TrainResult, WorkerLoss


class FakePool:
    """A rollout pool of ``workers`` threads that sleep ``gen_time(index)`` seconds per batch."""

    def __init__(
        self,
        *,
        num_groups: int = 2,
        group_size: int = 2,
        workers: int = 1,
        gen_time: float | Callable[[int], float] = 0.0,
        fail_at: Sequence[int] = (),
        stamp_lag: int = 0,
        stale_at: Sequence[int] | None = None,
        lose_at: Sequence[int] = (),
    ) -> None:
        self.num_groups = num_groups
        self.group_size = group_size
        self.gen_time = gen_time if callable(gen_time) else (lambda _i, t=gen_time: t)
        self.fail_at = set(fail_at)
        self.stamp_lag = stamp_lag
        self.stale_at = None if stale_at is None else set(stale_at)
        self.lose_at = set(lose_at)
        self._dying: list[int] = []  # lost, not yet out of ``inflight``
        self._losses: list[WorkerLoss] = []
        self.restarts = 0
        self.version = 0
        self.launched: list[GenerationRequest] = []
        self.published: list[int] = []
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fake-rollout")
        self._done: BatchQueue[RolloutBatch | None] = BatchQueue(maxsize=1 << 20, name="fake-pool")
        self._lock = threading.Lock()
        self._inflight = 0
        self._generating = 0

    @property
    def inflight(self) -> int:
        with self._lock:
            return self._inflight

    def launch(self, request: GenerationRequest) -> None:
        if request.version != self.version:
            raise ControlError(
                f"launch stamped version {request.version} but the engine holds {self.version}"
            )
        with self._lock:
            self._inflight += 1
        self.launched.append(request)
        self._executor.submit(self._generate, request, self.version)

    def _generate(self, request: GenerationRequest, engine_version: int) -> None:
        with self._lock:
            self._generating += 1
        try:
            time.sleep(self.gen_time(request.index))
            if request.index in self.lose_at:  # its worker dies; the batch is never returned
                with self._lock:
                    self.lose_at.discard(request.index)
                    self._dying.append(request.index)
                self._done.put(None)
                return
            if request.index in self.fail_at:
                raise RuntimeError(f"injected generation failure in batch {request.index}")
            lag = self.stamp_lag if self.stale_at is None or request.index in self.stale_at else 0
            stamped = max(0, engine_version - lag)
            n = self.num_groups * self.group_size
            payload = {"index": request.index, "versions": [stamped] * n}
            self._done.put(RolloutBatch(
                index=request.index, behavior_version=min(payload["versions"]),
                num_groups=self.num_groups, group_size=self.group_size, payload=payload,
                newest_version=max(payload["versions"]),
            ))
        except BaseException as exc:
            self._done.report_error(
                RolloutError(str(exc), worker="fake-0", batch_index=request.index)
            )
        finally:
            with self._lock:
                self._generating -= 1

    def _take(self, batches: list[RolloutBatch | None]) -> list[RolloutBatch]:
        batches = [b for b in batches if b is not None]
        with self._lock:
            self._inflight -= len(batches)
        return batches

    def _bury(self) -> None:
        with self._lock:
            for index in self._dying:
                self._inflight -= 1
                self.restarts += 1
                self._losses.append(WorkerLoss(worker="fake-0", cause="lost (lose_at)", batch_index=index,
                                               restarts=self.restarts))
            self._dying.clear()

    def lost(self) -> list[WorkerLoss]:
        self._bury()
        with self._lock:
            losses, self._losses = self._losses, []
        return losses

    def reap(self) -> list[RolloutBatch]:
        return self._take(self._done.drain())

    def wait(self, timeout: float | None) -> list[RolloutBatch]:
        first = self._done.get(timeout=timeout)
        return self._take([first, *self._done.drain()])

    def quiesce(self, timeout: float | None) -> list[RolloutBatch]:
        out: list[RolloutBatch | None] = []
        while self.inflight - sum(b is not None for b in out) > 0:
            out.append(self._done.get(timeout=timeout))
            if out[-1] is None:
                self._bury()
        return self._take(out)

    def publish(self, weights: Any, version: int) -> Mapping[str, float]:
        with self._lock:
            if self._inflight:
                raise ControlError(f"publish of version {version} while {self._inflight} batch(es) are "
                                   "in flight")
        if weights.get("version") != version:
            raise ControlError(f"weights carry version {weights.get('version')}, published as {version}")
        self.version = version
        self.published.append(version)
        return {"sync/bytes": 8.0, "sync/publish_s": 0.0}

    def close(self) -> None:
        self._done.close()
        self._executor.shutdown(wait=True, cancel_futures=True)


class FakeLearner:
    """Records what it trained on; commits ``commits[i % len]`` updates on its i-th batch."""

    def __init__(
        self,
        *,
        updates_per_batch: int = 1,
        commits: Sequence[int] | None = None,
        train_time: float = 0.0,
        fail_at: Sequence[int] = (),
    ) -> None:
        self.updates_per_batch = updates_per_batch
        self.commits = list(commits) if commits else None
        self.train_time = train_time
        self.fail_at = set(fail_at)
        self.version = 0
        self.trained: list[tuple[int, int, int]] = []
        """(batch index, train version when it trained, version stamped in its data)."""

    def train(self, batch: RolloutBatch, *, train_version: int) -> TrainResult:
        if batch.index in self.fail_at:
            raise RuntimeError(f"injected training failure on batch {batch.index}")
        if train_version != self.version:
            raise ControlError(f"learner is at version {self.version}, loop says {train_version}")
        time.sleep(self.train_time)
        data_version = min(batch.payload["versions"])
        self.trained.append((batch.index, train_version, data_version))
        n = len(self.trained) - 1
        committed = self.commits[n % len(self.commits)] if self.commits else self.updates_per_batch
        self.version += committed
        return TrainResult(committed, self.updates_per_batch, {"loss/total": 0.0})

    def export_weights(self) -> dict[str, int]:
        return {"version": self.version}

    def measured_staleness(self) -> list[int]:
        """Per trained batch, staleness in updates measured from the data's stamp."""
        return [tv - dv for _i, tv, dv in self.trained]


class RecordingHooks:
    """Boundary hooks that record each eval and save and what the pool held at the time."""

    def __init__(self, pool: Any = None) -> None:
        self.pool = pool
        self.evals: list[tuple[int, int]] = []
        self.saves: list[LoopState] = []
        self.outstanding_at_boundary: list[int] = []

    def evaluate(self, step: int, version: int) -> Mapping[str, float]:
        self.evals.append((step, version))
        if self.pool is not None:
            self.outstanding_at_boundary.append(self.pool.inflight)
        return {"eval/accuracy": 0.0}

    def save(self, step: int, state: LoopState) -> None:
        self.saves.append(state)
        if self.pool is not None:
            self.outstanding_at_boundary.append(self.pool.inflight)
