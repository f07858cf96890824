"""A second kind of rollout backend, defined outside Tether: rollout workers as threads of the
driver process, weights handed over in process (each engine copies the learner's tensors in).

One plug-in and one ``register_backend`` call: ``run.plugins: [tests/plugins/thread_backend.py]``
makes ``rollout.backend: threads`` valid. The pool is Tether's ``DispatchingPool`` (the protocol
logic every backend shares) with three hooks: how an item reaches a worker (its queue), how
weights reach every worker (``load_weights`` in the driver), and how workers stop.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import tether
from tether.config.fields import knob

# -- the pool -----------------------------------------------------------------------------------


def _pool_class():
    """Defined on first use, so that loading the plug-in imports no torch."""
    from tether.errors import RolloutError
    from tether.rollout.dispatch import DispatchingPool, WorkerSlot
    from tether.rollout.worker import Rollout

    class ThreadSlot(WorkerSlot):
        def __init__(self, worker_id: int, rollout: Any) -> None:
            super().__init__(worker_id)
            self.rollout = rollout
            self.items: queue.Queue = queue.Queue()
            self.thread = threading.Thread(target=self._serve, name=f"tether-{self.name}", daemon=True)
            self.pool: Any = None

        def _serve(self) -> None:
            while (item := self.items.get()) is not None:
                try:
                    payload = self.rollout.generate(item)
                except BaseException as exc:  # the run's error, naming the worker and the batch
                    self.pool._fail(RolloutError(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                                                 worker=self.name, batch_index=item.batch_index))
                    return
                self.pool._accept(self, item.batch_index, payload)

    class ThreadPool(DispatchingPool):
        """``rollout.num_workers`` threads, each with its own engine, in this process."""

        def __init__(self, settings, batches, weights, *, initial_version, extras, join_s: float) -> None:
            super().__init__(settings, batches, initial_version=initial_version, extras=extras)
            self.join_s = join_s
            self._held = {name: t.detach().clone() for name, t in weights.items()}
            try:
                for i in range(settings.num_workers):
                    rollout = Rollout(settings.worker_spec(i, initial_version))
                    rollout.engine.load_weights(weights, initial_version)
                    slot = ThreadSlot(i, rollout)
                    slot.pool = self
                    self._workers.append(slot)
                    slot.thread.start()
            except BaseException:
                self.close()
                raise

        def _submit(self, w: Any, item: Any) -> None:
            w.items.put(item)

        def _load_all(self, weights: Mapping[str, Any], version: int) -> dict[str, float]:
            t0 = time.perf_counter()
            self._held = {name: t.detach().clone() for name, t in weights.items()}
            for w in self._workers:
                w.rollout.engine.load_weights(self._held, version)
            return {"sync/publish_s": 0.0, "sync/load_s": time.perf_counter() - t0,
                    "sync/bytes": float(sum(t.numel() * t.element_size() for t in self._held.values()))}

        def _holds(self, w: Any) -> int:
            return w.rollout.engine.version

        def published_weights(self) -> dict[str, Any]:
            return {name: t.clone() for name, t in self._held.items()}

        def close(self) -> None:
            for w in self._workers:
                w.items.put(None)
            for w in self._workers:
                w.thread.join(timeout=self.join_s)
                w.rollout.close()
            self._workers = []

    return ThreadPool


# -- its section and plug-in --------------------------------------------------------------------


@dataclass(frozen=True)
class ThreadsSection:
    """Rollout workers as threads of the driver (used when rollout.backend=threads; a test plug-in)."""

    join_s: float = knob(30.0, "Seconds to wait for each worker thread to finish its batch at the end.",
                         min=0.1)


class ThreadsPlugin(tether.BackendPlugin):
    def check(self, cfg: Any) -> None:
        if cfg.train.threads != cfg.rollout.threads_per_worker:
            raise tether.ConfigError(
                f"rollout.backend=threads runs the workers in the learner's process, which has one torch "
                f"thread count: set rollout.threads_per_worker={cfg.train.threads} (train.threads)")

    def pool(self, settings, batches, weights, session, *, initial_version, extras):
        return _pool_class()(settings, batches, weights, initial_version=initial_version, extras=extras,
                             join_s=settings.cfg.section("threads").join_s)


THREADS = ThreadsPlugin("threads", section=("threads", ThreadsSection), weight_channel="in_process",
                        inflight_updates=("drain",),
                        notes={"inflight_updates": "its workers take weights only between batches"})

tether.register_backend(THREADS)
