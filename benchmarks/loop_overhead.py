"""The driver loop's own overhead per consumed batch, with fakes that do no work.

Side by side in one run:
  bare     a plain ``for`` loop calling the learner on pre-made batches (the floor);
  driver   the real driver loop with an instant in-process pool (reap, launch, consume, train,
           sync rule, metrics record) — its excess over ``bare`` is the loop's overhead;
  +trace   the same with every event and record kept in memory;
  threaded the threaded ``FakePool`` (adds a thread hand-off per batch; for reference).

Target (issue 2): under 50 µs of overhead per batch, invisible next to any real step.

    python benchmarks/loop_overhead.py [--batches N] [--repeats R] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Mapping

from tether.control import AsyncControl, BudgetSettings
from tether.loop import Driver, GenerationRequest, RolloutBatch, TraceRecorder, TrainResult
from tether.loop.fakes import FakePool

TARGET_US = 50.0


class InstantPool:
    """Completes every generation at launch; no threads, no sleeping."""

    def __init__(self) -> None:
        self.done: list[RolloutBatch] = []
        self.version = 0

    @property
    def inflight(self) -> int:
        return len(self.done)

    def launch(self, request: GenerationRequest) -> None:
        self.done.append(RolloutBatch(index=request.index, behavior_version=request.version,
                                      num_groups=8, group_size=4))

    def lost(self) -> list:
        return []  # its workers never die

    def reap(self) -> list[RolloutBatch]:
        out, self.done = self.done, []
        return out

    def wait(self, timeout: float | None) -> list[RolloutBatch]:
        return self.reap()

    def quiesce(self, timeout: float | None) -> list[RolloutBatch]:
        return self.reap()

    def publish(self, weights, version: int) -> Mapping[str, float]:
        self.version = version
        return {}


class NullLearner:
    def __init__(self, u: int) -> None:
        self.u = u
        self.result = TrainResult(u, u, {"loss/total": 0.0})

    def train(self, batch: RolloutBatch, *, train_version: int) -> TrainResult:
        return self.result

    def export_weights(self) -> dict:
        return {}


def settings(n: int) -> BudgetSettings:
    return BudgetSettings(max_staleness=1, updates_per_batch=2, max_inflight=2, total_batches=n,
                          eval_interval=0, save_interval=0)


def time_bare(n: int) -> float:
    learner = NullLearner(2)
    batches = [RolloutBatch(index=i, behavior_version=0, num_groups=8, group_size=4) for i in range(n)]
    t0 = time.perf_counter()
    for b in batches:
        learner.train(b, train_version=0)
    return time.perf_counter() - t0


def time_driver(n: int, *, trace: bool = False, threaded: bool = False) -> float:
    pool = FakePool(num_groups=8, group_size=4) if threaded else InstantPool()
    learner = NullLearner(2)
    if threaded:
        from tether.loop.fakes import FakeLearner

        learner = FakeLearner(updates_per_batch=2)
    driver = Driver(AsyncControl(settings(n)), pool, learner,
                    observer=TraceRecorder() if trace else None, wait_timeout_s=30)
    t0 = time.perf_counter()
    driver.run()
    elapsed = time.perf_counter() - t0
    if threaded:
        pool.close()
    return elapsed


def measure(batches: int, repeats: int) -> dict:
    runs: dict[str, list[float]] = {"bare": [], "driver": [], "driver+trace": [], "threaded": []}
    for _ in range(repeats):  # interleaved so machine noise hits every variant alike
        runs["bare"].append(time_bare(batches) / batches * 1e6)
        runs["driver"].append(time_driver(batches) / batches * 1e6)
        runs["driver+trace"].append(time_driver(batches, trace=True) / batches * 1e6)
        runs["threaded"].append(time_driver(batches // 10, threaded=True) / (batches // 10) * 1e6)
    us = {k: statistics.median(v) for k, v in runs.items()}
    overhead = us["driver"] - us["bare"]
    return {
        "batches": batches,
        "repeats": repeats,
        "us_per_batch": us,
        "overhead_us_per_batch": overhead,
        "overhead_with_trace_us_per_batch": us["driver+trace"] - us["bare"],
        "target_us": TARGET_US,
        "fraction_of_target": overhead / TARGET_US,
        "meets_target": overhead < TARGET_US,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    r = measure(a.batches, a.repeats)
    if a.json:
        print(json.dumps(r))
        return 0
    print(f"loop overhead, {a.batches} batches × {a.repeats} repeats (median µs per consumed batch)")
    print(f"{'variant':<14}{'µs/batch':>10}")
    for k, v in r["us_per_batch"].items():
        print(f"{k:<14}{v:>10.2f}")
    print(f"overhead (driver − bare): {r['overhead_us_per_batch']:.2f} µs "
          f"= {r['fraction_of_target']:.2f} × the {TARGET_US:.0f} µs target "
          f"({'met' if r['meets_target'] else 'MISSED'}); with trace "
          f"{r['overhead_with_trace_us_per_batch']:.2f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
