"""A rollout pool of worker processes, implementing the driver loop's ``RolloutPool`` seam.

Launches go to an idle worker (or wait in order for one); a collector thread watches every
worker's result pipe and process sentinel, puts each complete scored batch into the completion
FIFO, and turns a worker's error — or its death — into a ``RolloutError`` that names the worker,
the batch and the cause, with the original traceback. Weights go through the shared-memory
``WeightChannel``; workers load them only while the pool is quiesced.

The same protocol is what a Ray-actor backend implements: launch, reap, wait, quiesce, publish,
close.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_any
from typing import Literal

import torch

from tether.control import BatchQueue
from tether.data.types import Example
from tether.decoding.sampling import SamplingParams
from tether.errors import QueueTimeoutError, RolloutError
from tether.loop.protocols import GenerationRequest, RolloutBatch
from tether.loop.scored import ScoredBatch
from tether.rollout.channel import WeightChannel
from tether.rollout.types import WorkItem
from tether.rollout.worker import WorkerSpec, worker_main

log = logging.getLogger("tether.rollout")


@dataclass(frozen=True)
class PoolSettings:
    """How the pool's workers run (see the ``rollout`` and ``reward`` recipe sections)."""

    model_path: str
    num_workers: int = 1
    threads_per_worker: int = 1
    group_size: int = 4
    params: SamplingParams = SamplingParams()
    reward: str = "task"
    task: str | None = None
    stop_text: str = "\n"
    reward_on_error: Literal["raise", "zero"] = "raise"
    seed: int = 0
    startup_timeout_s: float = 300.0


_PRELOAD = ["torch", "transformers", "tether.rollout.worker", "tether.rollout.torch_engine",
            "tether.data.rewards"]


def _worker_context() -> mp.context.BaseContext:
    """A forkserver that has imported torch and transformers once, so each worker starts by
    forking it (fast) instead of importing them afresh. The server runs no torch ops, so no
    thread pool exists to be forked. Falls back to spawn where forkserver is unavailable."""
    try:
        ctx = mp.get_context("forkserver")
    except ValueError:
        return mp.get_context("spawn")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is unresponsive"
    if code < 0:
        import signal

        try:
            return f"died from signal {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"died from signal {-code}"
    return f"exited with code {code}"


class _Handle:
    def __init__(self, worker_id: int, process: mp.Process, requests: Connection, results: Connection):
        self.id = worker_id
        self.name = f"rollout-{worker_id}"
        self.process = process
        self.requests = requests
        self.results = results
        self.batch: int | None = None  # the batch it is generating, if any
        self.alive = True


class ProcessPool:
    """N rollout worker processes behind the ``RolloutPool`` protocol."""

    def __init__(self, settings: PoolSettings, batches: Callable[[int], Sequence[tuple[int, Example]]],
                 initial_weights: Mapping[str, torch.Tensor], *, initial_version: int = 0) -> None:
        self.settings = settings
        self.batches = batches
        self.channel = WeightChannel.for_tensors(initial_weights)
        self.channel.publish(initial_weights, initial_version)
        self.version = initial_version
        self._completed: BatchQueue[RolloutBatch] = BatchQueue(maxsize=1 << 16, name="rollout")
        self._acks: BatchQueue[tuple[int, int, float]] = BatchQueue(maxsize=1 << 10, name="weight-load")
        self._lock = threading.Lock()
        self._pending: deque[WorkItem] = deque()
        self._launched_at: dict[int, float] = {}
        self._inflight = 0
        self._closing = False
        self._workers: list[_Handle] = []
        self._collector: threading.Thread | None = None
        try:
            self._start_workers()
        except BaseException:
            self.close()
            raise

    # -- lifecycle ----------------------------------------------------------------------------

    def _start_workers(self) -> None:
        ctx = _worker_context()
        s = self.settings
        for i in range(s.num_workers):
            req_recv, req_send = ctx.Pipe(duplex=False)
            res_recv, res_send = ctx.Pipe(duplex=False)
            spec = WorkerSpec(worker_id=i, model_path=s.model_path, channel_name=self.channel.name,
                              channel_layout=self.channel.layout, reward=s.reward, task=s.task,
                              stop_text=s.stop_text, num_threads=s.threads_per_worker,
                              reward_on_error=s.reward_on_error, initial_version=self.version)
            proc = ctx.Process(target=worker_main, args=(spec, req_recv, res_send), daemon=True,
                               name=f"tether-rollout-{i}")
            proc.start()
            req_recv.close()
            res_send.close()
            self._workers.append(_Handle(i, proc, req_send, res_recv))
        deadline = time.monotonic() + s.startup_timeout_s
        for w in self._workers:
            remaining = deadline - time.monotonic()
            if not w.results.poll(max(0.0, remaining)):
                raise RolloutError(f"did not start within {s.startup_timeout_s:.0f}s", worker=w.name)
            try:
                msg = w.results.recv()
            except EOFError:
                w.process.join(5)
                raise RolloutError(f"{_describe_exit(w.process.exitcode)} while starting",
                                   worker=w.name) from None
            if msg[0] == "error":
                raise RolloutError(msg[2], worker=w.name, remote_traceback=msg[3])
        self._collector = threading.Thread(target=self._collect, name="tether-rollout-collector", daemon=True)
        self._collector.start()

    def close(self, timeout: float = 10.0, busy_grace: float = 1.0) -> None:
        """Stop every worker and free the weight channel; idempotent.

        Idle workers are asked to stop and get ``timeout`` seconds; a worker still generating
        cannot read the request until its batch ends, so it gets ``busy_grace`` seconds and is
        then terminated (its batch is abandoned). Survivors of SIGTERM are killed.
        """
        if self._closing and not any(w.process.is_alive() for w in self._workers):
            return
        self._closing = True
        for w in self._workers:
            with contextlib.suppress(OSError, ValueError):
                w.requests.send(("stop",))
        deadline = time.monotonic() + timeout
        busy_deadline = time.monotonic() + min(timeout, busy_grace)
        for w in self._workers:
            until = busy_deadline if w.batch is not None else deadline
            w.process.join(max(0.0, until - time.monotonic()))
            if w.process.is_alive():
                w.process.terminate()
                w.process.join(2)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(2)
        if self._collector is not None:
            self._collector.join(5)
        for w in self._workers:
            for conn in (w.requests, w.results):
                conn.close()
        self._completed.close()
        self._acks.close()
        self.channel.close()

    def __enter__(self) -> ProcessPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers if w.process.pid is not None]

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
                        params=s.params, seed=s.seed * 1_000_003 + request.index)
        with self._lock:
            self._inflight += 1
            self._launched_at[request.index] = time.monotonic()
            self._pending.append(item)
            self._dispatch()

    def reap(self) -> list[RolloutBatch]:
        return self._taken(self._completed.drain())

    def wait(self, timeout: float | None) -> list[RolloutBatch]:
        try:
            first = self._completed.get(timeout=timeout)
        except QueueTimeoutError:
            raise self._timeout_error(timeout) from None
        return self._taken([first, *self._completed.drain()])

    def quiesce(self, timeout: float | None) -> list[RolloutBatch]:
        out: list[RolloutBatch] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.inflight - len(out) > 0:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                out.append(self._completed.get(timeout=remaining))
            except QueueTimeoutError:
                raise self._timeout_error(timeout) from None
        return self._taken(out)

    def publish(self, weights: Mapping[str, torch.Tensor], version: int) -> Mapping[str, float]:
        """Write ``weights`` to the channel and have every worker verify and load them."""
        if self.inflight:
            raise RolloutError(f"publish of version {version} while {self.inflight} batch(es) are in flight")
        metrics = dict(self.channel.publish(weights, version))
        t0 = time.perf_counter()
        for w in self._workers:
            err = self._send(w, ("load", version))
            if err is not None:
                raise err
        loads = []
        for _ in self._workers:
            try:
                _worker, got, seconds = self._acks.get(timeout=self.settings.startup_timeout_s)
            except QueueTimeoutError:
                raise RolloutError(f"workers did not load version {version} in time") from None
            assert got == version, (got, version)
            loads.append(seconds)
        self.version = version
        metrics["sync/load_s"] = max(loads)
        metrics["sync/load_wall_s"] = time.perf_counter() - t0
        total = metrics["sync/publish_s"] + metrics["sync/load_s"]
        metrics["sync/gbps"] = metrics["sync/bytes"] / total / 1e9 if total > 0 else 0.0
        return metrics

    # -- internals ----------------------------------------------------------------------------

    def _taken(self, batches: list[RolloutBatch]) -> list[RolloutBatch]:
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
                self._send(w, ("generate", item))  # a failure is reported through the queues

    def _send(self, w: _Handle, msg: tuple) -> RolloutError | None:
        """Send to a worker; if its pipe is broken (it died), report that as its death."""
        try:
            w.requests.send(msg)
            return None
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            return self._bury(w, join_s=2)

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

    def _collect(self) -> None:
        """Collector thread: results and deaths, until the pool closes."""
        by_conn = {w.results: w for w in self._workers}
        by_sentinel = {w.process.sentinel: w for w in self._workers}
        while not self._closing:
            live = [w for w in self._workers if w.alive]
            if not live:
                return
            ready = wait_any([w.results for w in live] + [w.process.sentinel for w in live], timeout=0.2)
            for obj in ready:
                w = by_conn.get(obj)  # type: ignore[call-overload]
                if w is not None and w.alive and not self._receive(w) and not self._closing:
                    self._drain_then_bury(w)  # its end of the pipe closed: it is exiting
            for obj in ready:
                w = by_sentinel.get(obj)  # type: ignore[call-overload]
                if w is not None and w.alive and not self._closing:
                    self._drain_then_bury(w)

    def _receive(self, w: _Handle) -> bool:
        """Handle one message from ``w``; False when its pipe is at end of file."""
        try:
            msg = w.results.recv()
        except (EOFError, OSError):
            return False
        kind = msg[0]
        if kind == "batch":
            self._accept(w, msg[1], msg[2])
        elif kind == "loaded":
            self._acks.put((w.id, msg[1], msg[2]))
        elif kind == "error":
            err = RolloutError(msg[2], worker=w.name, batch_index=msg[1], remote_traceback=msg[3])
            self._completed.report_error(err)
            self._acks.report_error(err)
        return True

    def _accept(self, w: _Handle, index: int, scored: ScoredBatch) -> None:
        try:
            scored.check()
            expected = len(self.batches(index))
            if scored.num_groups != expected or scored.group_size != self.settings.group_size:
                raise ValueError(f"{scored.num_groups} groups of {scored.group_size}, expected "
                                 f"{expected} of {self.settings.group_size}")
        except ValueError as exc:
            self._completed.report_error(RolloutError(f"incomplete rollout batch: {exc}", worker=w.name,
                                                      batch_index=index))
            return
        metrics = {**scored.metrics, "async/newest_version": float(scored.newest_version)}
        batch = RolloutBatch(index=index, behavior_version=scored.oldest_version,
                             newest_version=scored.newest_version, num_groups=scored.num_groups,
                             group_size=scored.group_size, payload=scored, metrics=metrics)
        with self._lock:
            w.batch = None
            self._dispatch()
        self._completed.put(batch)

    def _drain_then_bury(self, w: _Handle) -> None:
        while w.results.poll(0) and self._receive(w):  # what it sent before dying still counts
            pass
        self._bury(w, join_s=5)

    def _bury(self, w: _Handle, *, join_s: float) -> RolloutError:
        """Mark a worker dead and report its death, naming its batch, to everyone waiting."""
        w.process.join(join_s)
        w.alive = False
        err = RolloutError(
            f"worker process (pid {w.process.pid}) {_describe_exit(w.process.exitcode)}"
            + (f" while generating batch {w.batch}" if w.batch is not None else ""),
            worker=w.name, batch_index=w.batch,
        )
        self._completed.report_error(err)
        self._acks.report_error(err)
        return err
