"""A rollout pool of worker processes, implementing the driver loop's ``RolloutPool`` seam.

The protocol logic (dispatch, the completion FIFO, whole-batch checks) is ``DispatchingPool``'s;
this backend adds processes. A collector thread watches every worker's result pipe and process
sentinel, accepts each complete scored batch, and turns a worker's error into a ``RolloutError``
that names the worker, the batch and the cause, with the original traceback — and its death into
the same, or, with ``rollout.on_worker_loss: replace``, into a new process in its place
(``DispatchingPool._recover``).
Weights go through the shared-memory ``WeightChannel``, or with ``rollout.weight_sync=collective``
a broadcast from this process to every worker (``tether.rollout.collective``; rank 0 here, worker
``i`` rank ``i + 1``, its group formed once every worker is ready); workers load them only while
the pool is quiesced — or, with ``async.inflight_update`` other than drain, switch to each new version
between decode steps (``tether.rollout.worker._ChannelWorker``).

Workers die with the driver however it ends: each holds the read end of a *lifeline* pipe whose
only write end is the driver's, and exits the moment it reads end-of-file (the driver closed the
pool, exited, or was killed). Stop signals are the driver's to handle: workers ignore SIGINT and
SIGTERM, so a signal sent to the whole process group stops the run once, in order.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_any

import torch

from tether.control import BatchQueue
from tether.errors import QueueTimeoutError, RolloutError
from tether.procinfo import Sealed, child_context, start_child, stop_signals_deferred
from tether.rollout.channel import Layout, WeightChannel
from tether.rollout.collective import CollectivePublisher
from tether.rollout.dispatch import DispatchingPool, WorkerSlot
from tether.rollout.settings import PoolSettings
from tether.rollout.worker import worker_main
from tether.vocabulary import Example, WorkItem

__all__ = ["PoolSettings", "ProcessPool"]

log = logging.getLogger("tether.rollout")


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


class _Handle(WorkerSlot):
    def __init__(self, worker_id: int, process: mp.Process, requests: Connection, results: Connection):
        super().__init__(worker_id)
        self.process = process
        self.requests = requests
        self.results = results


class ProcessPool(DispatchingPool):
    """N rollout worker processes behind the ``RolloutPool`` protocol."""

    def __init__(self, settings: PoolSettings, batches: Callable[[int], Sequence[tuple[int, Example]]],
                 initial_weights: Mapping[str, torch.Tensor], *, initial_version: int = 0,
                 extras: Callable[[int], Sequence[tuple[int, Example]]] | None = None) -> None:
        super().__init__(settings, batches, initial_version=initial_version, extras=extras)
        # (worker, version, seconds) per load, or None: a worker died
        self._acks: BatchQueue[tuple[int, int, float] | None] = BatchQueue(1 << 10, name="weight-load")
        self._workers: list[_Handle] = []
        self._retired: list[_Handle] = []  # dead workers replaced
        self._collector: threading.Thread | None = None
        self._lifeline: Connection | None = None  # the write end; closing it ends every worker
        self._lifeline_r: Connection | None = None  # the read end, handed to each worker started
        self.channel: WeightChannel | None = None
        self.sync: CollectivePublisher | None = None
        try:
            if settings.cfg.rollout.weight_sync == "collective":
                r = settings.cfg.rollout
                self.sync = CollectivePublisher(Layout.of(initial_weights),
                                                [f"rollout-{i}" for i in range(settings.num_workers)],
                                                timeout_s=r.weight_sync_timeout_s, port=r.weight_sync_port,
                                                gone=self._gone)
            else:
                # a stop signal between creating the shared block and holding it here would leak it
                with stop_signals_deferred():
                    self.channel = WeightChannel.for_tensors(initial_weights)
                self.channel.publish(initial_weights, initial_version)
            self._start_workers()
            if self.sync is not None:
                self.sync.join()
                self._broadcast(initial_weights, initial_version, told=True)
        except BaseException:
            self.close()
            raise

    # -- lifecycle ----------------------------------------------------------------------------

    def _start_workers(self) -> None:
        self._ctx = child_context()
        self._lifeline_r, self._lifeline = self._ctx.Pipe(duplex=False)
        self._workers = [self._spawn(i, self.version) for i in range(self.settings.num_workers)]
        deadline = time.monotonic() + self.settings.startup_timeout_s
        for w in self._workers:
            self._await_ready(w, deadline)
        self._collector = threading.Thread(target=self._collect, name="tether-rollout-collector", daemon=True)
        self._collector.start()

    def _spawn(self, i: int, version: int) -> _Handle:
        """Start worker process ``i``, to load ``version`` from the channel (or to join the
        collective group)."""
        ctx = self._ctx
        req_recv, req_send = ctx.Pipe(duplex=False)
        res_recv, res_send = ctx.Pipe(duplex=False)
        if self.sync is not None:
            spec = self.settings.worker_spec(i, version, group=self.sync.address,
                                             channel_layout=self.sync.layout)
        else:
            spec = self.settings.worker_spec(i, version, channel_name=self.channel.name,
                                             channel_layout=self.channel.layout)
        proc = start_child(ctx, worker_main, (Sealed(spec), req_recv, res_send, self._lifeline_r),
                           name=f"tether-worker-{i}")
        req_recv.close()
        res_send.close()
        return _Handle(i, proc, req_send, res_recv)

    def _await_ready(self, w: _Handle, deadline: float) -> None:
        if not w.results.poll(max(0.0, deadline - time.monotonic())):
            raise RolloutError(f"did not start within {self.settings.startup_timeout_s:.0f}s", worker=w.name)
        try:
            msg = w.results.recv()
        except EOFError:
            w.process.join(5)
            raise RolloutError(f"{_describe_exit(w.process.exitcode)} while starting",
                               worker=w.name) from None
        if msg[0] == "error":
            raise RolloutError(msg[2], worker=w.name, remote_traceback=msg[3])

    def _replace(self, w: _Handle, version: int) -> None:
        self._retired.append(w)  # its pipes close with the pool (the collector may be reading them)
        new = self._spawn(w.id, version)
        try:
            self._await_ready(new, time.monotonic() + self.settings.startup_timeout_s)
        except BaseException:
            new.process.kill()
            new.process.join(5)
            raise
        self._workers[w.id] = new  # the collector watches it from its next round

    def close(self, timeout: float = 10.0) -> None:
        """Stop every worker and free the weight channel; idempotent.

        Idle workers are asked to stop and left to exit through their own exit handlers (a
        library's named semaphore, such as the lock tqdm makes for diffusers' loading bar, is
        unlinked there; a worker ended by the lifeline unlinks its semaphores alone before it
        exits, so the resource tracker has none to warn of). Closing the lifeline then ends any
        worker still generating at once (its batch is abandoned), and one that could not be forked
        in time to be known here exits as soon as it starts. Survivors after ``timeout`` are killed.
        """
        if self._closing and self._lifeline is None and not any(w.process.is_alive() for w in self._workers):
            return
        self._closing = True
        deadline = time.monotonic() + timeout
        for w in self._workers:
            with contextlib.suppress(OSError, ValueError):
                w.requests.send(("stop",))
        for w in self._workers:
            if w.batch is None:
                w.process.join(max(0.0, deadline - time.monotonic()))
        if self._lifeline is not None:
            self._lifeline.close()
            self._lifeline = None
        if self._lifeline_r is not None:
            self._lifeline_r.close()
            self._lifeline_r = None
        for w in self._workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                w.process.kill()
                w.process.join(2)
        if self._collector is not None:
            self._collector.join(5)
        for w in [*self._workers, *self._retired]:
            for conn in (w.requests, w.results):
                conn.close()
        self._completed.close()
        self._acks.close()
        if self.channel is not None:
            self.channel.close()
        if self.sync is not None:
            self.sync.close()

    def published_weights(self) -> dict[str, torch.Tensor]:
        """A copy of the weights the workers hold (the channel's snapshot, checked whole)."""
        if self.sync is not None:
            self.sync.block.verify(self.version)
            return {name: t.clone() for name, t in self.sync.block.views.items()}
        self.channel.verify(self.version)
        return {name: t.clone() for name, t in self.channel.views().items()}

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers if w.process.pid is not None]

    # -- backend hooks ------------------------------------------------------------------------

    def _submit(self, w: _Handle, item: WorkItem) -> None:
        self._send(w, ("generate", item))  # a failure is reported through the queues

    def _load_all(self, weights: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        if self.sync is not None:
            return self._broadcast(weights, version, told=False)
        metrics = dict(self.channel.publish(weights, version))
        waiting = set()
        for w in self._workers:
            err = self._send(w, ("load", version))
            if err is None:
                waiting.add(w.id)
            elif self.settings.cfg.rollout.on_worker_loss == "stop":
                raise err
        loads = [0.0]
        while waiting:
            try:
                ack = self._acks.get(timeout=self.settings.startup_timeout_s)
            except QueueTimeoutError:
                raise RolloutError(f"workers did not load version {version} in time") from None
            if ack is None:  # a worker died: its replacement starts holding this version
                waiting -= set(self._recover(version))
                continue
            worker, got, seconds = ack
            assert got == version, (got, version)
            waiting.discard(worker)
            loads.append(seconds)
        self._recover(version)  # a death between the last ack and now
        metrics["sync/load_s"] = max(loads)
        return metrics

    def _broadcast(self, weights: Mapping[str, torch.Tensor], version: int, *,
                   told: bool) -> dict[str, float]:
        """The collective channel: tell every worker to receive ``version`` (unless it already
        waits for it: the first, at joining), broadcast it, and wait for every worker's load."""
        if not told:
            for w in self._workers:
                err = self._send(w, ("load", version))
                if err is not None:
                    raise err
        metrics = dict(self.sync.publish(weights, version))
        metrics["sync/load_s"] = self._loaded(version)
        return metrics

    def _gone(self) -> list[str]:
        """The workers whose process has ended (waiting up to 2 s for one that is ending)."""
        deadline = time.monotonic() + 2.0
        while True:
            gone = [w.name for w in self._workers if not w.process.is_alive()]
            if gone or time.monotonic() > deadline:
                return gone
            time.sleep(0.05)

    def _loaded(self, version: int) -> float:
        """Wait until every worker reports it loaded ``version`` (the collective channel, whose
        workers are not replaced: ``rollout.on_worker_loss=stop``); the slowest load's seconds."""
        loads = []
        for _ in self._workers:
            try:
                ack = self._acks.get(timeout=self.settings.startup_timeout_s)
            except QueueTimeoutError:
                raise RolloutError(f"workers did not load version {version} in time") from None
            if ack is None:
                raise RolloutError(f"a worker ended while loading version {version}: "
                                   f"{', '.join(self._gone()) or 'unknown'}")
            _worker, got, seconds = ack
            assert got == version, (got, version)
            loads.append(seconds)
        return max(loads)

    def _put_inflight(self, weights: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        return dict(self.channel.publish(weights, version))  # workers watch the channel's header

    def _holds(self, w: _Handle) -> int:
        return w.held  # each switch is reported on the worker's result pipe

    def _fail(self, err: RolloutError) -> None:
        self._completed.report_error(err)
        self._acks.report_error(err)

    def _wake_waiters(self) -> None:
        super()._wake_waiters()
        self._acks.put(None)

    # -- internals ----------------------------------------------------------------------------

    def _send(self, w: _Handle, msg: tuple) -> RolloutError | None:
        """Send to a worker; if its pipe is broken (it died), report that as its death."""
        try:
            w.requests.send(msg)
            return None
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            return self._bury(w, join_s=2)

    def _collect(self) -> None:
        """Collector thread: results and deaths, until the pool closes."""
        while not self._closing:
            workers = list(self._workers)  # a replacement joins at the next round
            by_conn = {w.results: w for w in workers}
            by_sentinel = {w.process.sentinel: w for w in workers}
            live = [w for w in workers if w.alive]
            if not live:  # every one died: replacements may come (on_worker_loss=replace)
                time.sleep(0.05)
                continue
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
        elif kind == "took":
            w.held = max(w.held, msg[1])
        elif kind == "error":
            self._fail(RolloutError(msg[2], worker=w.name, batch_index=msg[1], remote_traceback=msg[3]))
        return True

    def _drain_then_bury(self, w: _Handle) -> None:
        while w.results.poll(0) and self._receive(w):  # what it sent before dying still counts
            pass
        self._bury(w, join_s=5)

    def _bury(self, w: _Handle, *, join_s: float) -> RolloutError:
        """Mark a worker dead and report its death, naming its batch, once (``_lose``)."""
        w.process.join(join_s)
        err = RolloutError(
            f"worker process (pid {w.process.pid}) {_describe_exit(w.process.exitcode)}"
            + (f" while generating batch {w.batch}" if w.batch is not None else ""),
            worker=w.name, batch_index=w.batch,
        )
        with self._deaths:  # the collector and a failed send may both find it dead
            first, w.alive = w.alive, False
        if first:
            self._lose(w, err)
        return err
