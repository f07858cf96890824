"""Randomized invariant fuzzing of the control plane through the real loop (docs/architecture.md §2).

Thousands of random settings — partially committed steps, random eval/save intervals, in-flight
caps, worker counts, generation-time jitter and every ``async.inflight_update`` mode — each run
to the end in virtual time, checking: the queue is empty at every draining sync and at every hard
boundary (an ``idle`` sync, with ``sync_when_idle``, finds nothing in flight but may leave older
batches queued; without draining, a publication that is not for a boundary leaves generations
running and switches them to the new weights); consumed staleness (measured from the data's
oldest token) never exceeds the budget; admission never starves the queue while refusing to
launch (the loop would raise); versions never decrease; every launched batch is accounted for
exactly once.
"""

import random

import pytest

from tether.control import AsyncControl, BudgetSettings
from tether.errors import StaleBatchError
from tether.loop import Driver, LoopObserver
from tether.loop.virtual import SimHooks, SimLearner, SimPool, Timings, VirtualClock

TRIALS = 4000


class InvariantChecker(LoopObserver):
    def __init__(self, pool: SimPool, driver_ref: list) -> None:
        self.pool = pool
        self.driver_ref = driver_ref
        self.violations: list[str] = []
        self.last_train_version = 0
        self.last_rollout_version = 0
        self.last_launch_version = 0
        self.syncs = 0

    def on_event(self, event):
        driver = self.driver_ref[0]
        if event.kind == "sync":
            self.syncs += 1
            idle = event.detail["reasons"] == ("idle",)
            boundary = {"eval", "save"} & set(event.detail["reasons"])
            if idle and self.pool.inflight:
                self.violations.append("idle sync with generation in flight")
            if not self.pool.drains and not boundary:
                if event.detail["drained"]:
                    self.violations.append("a non-draining mode drained for a non-boundary sync")
            elif not idle and event.detail["outstanding"] != 0:
                self.violations.append(f"{event.detail['outstanding']} outstanding at sync")
        if event.kind in ("eval", "save") and (self.pool.inflight or driver.ready):
            self.violations.append(f"work outstanding at {event.kind}")
        if event.kind == "launch":
            if event.version < self.last_launch_version:
                self.violations.append("launch version went backwards")
            self.last_launch_version = event.version

    def on_batch(self, record):
        m = record.metrics
        if m["async/train_version"] < self.last_train_version:
            self.violations.append("train version went backwards")
        if m["async/rollout_version"] < self.last_rollout_version:
            self.violations.append("rollout version went backwards")
        if m["async/rollout_version"] > m["async/train_version"]:
            self.violations.append("rollout version ahead of train version")
        self.last_train_version = m["async/train_version"]
        self.last_rollout_version = m["async/rollout_version"]
        parts = [m[f"staleness/{p}_updates"] for p in ("at_launch", "generating", "queued")]
        if min(parts) < 0 or sum(parts) != m["staleness/updates"]:
            self.violations.append(f"staleness split {parts} does not add up to {m['staleness/updates']}")


def random_trial(rng: random.Random) -> tuple[BudgetSettings, Timings]:
    u = rng.choice([1, 1, 2, 3, 4, 8])
    partial = rng.random() < 0.5
    commits = tuple(rng.randint(0, u) for _ in range(rng.randint(1, 7))) if partial else ()
    settings = BudgetSettings(
        max_staleness=rng.choice([0, 1, 1, 2, 3, 5, 11]),
        updates_per_batch=u,
        max_inflight=rng.randint(1, 8),
        total_batches=rng.randint(1, 40),
        eval_interval=rng.choice([0, 0, rng.randint(1, 12)]),
        save_interval=rng.choice([0, 0, rng.randint(1, 12)]),
        inflight_update=(mode := rng.choice(["drain", "drain", "keep", "recompute", "abort"])),
        sync_when_idle=mode == "drain" and rng.random() < 0.5,
    )
    sequences = rng.random() < 0.5  # each sequence's length modeled (abort and recompute move completions)
    timings = Timings(
        gen_time=rng.uniform(0.01, 3.0),
        gen_jitter=0.0 if sequences else rng.choice([0.0, rng.uniform(0.0, 1.5)]),
        mean_length=rng.uniform(1.0, 30.0) if sequences else 0.0,
        max_length=rng.randint(1, 64) if sequences else 0,
        prefill_cost=rng.uniform(0.0, 1.0) if sequences else 0.0,
        train_time=rng.uniform(0.01, 2.0),
        sync_time=rng.choice([0.0, rng.uniform(0.0, 1.0)]),
        workers=rng.randint(1, 4),
        commits=commits,
        seed=rng.randint(0, 2**31),
    )
    return settings, timings


def check_trial(settings: BudgetSettings, timings: Timings) -> list[str]:
    clock = VirtualClock()
    pool = SimPool(clock, timings, inflight=settings.mode, num_groups=3, group_size=2)
    learner = SimLearner(clock, timings, settings.updates_per_batch)
    ref: list = []
    checker = InvariantChecker(pool, ref)
    driver = Driver(AsyncControl(settings), pool, learner, hooks=SimHooks(clock, timings),
                    observer=checker, clock=clock)
    ref.append(driver)
    state = driver.run()  # raises AdmissionStallError if admission ever starves the queue
    v = list(checker.violations)
    for _index, train_version, data_version in learner.trained:
        if train_version - data_version > settings.staleness_budget:
            v.append(f"consumed {train_version - data_version} updates stale > budget")
    launched = [r.index for r in pool.launched]
    trained = [i for i, _, _ in learner.trained]
    if launched != list(range(len(launched))):
        v.append("launch indices not contiguous")
    if sorted(trained) != launched or len(set(trained)) != len(trained):
        v.append("a launched batch was not trained exactly once")
    if state.trained_batches != settings.total_batches or pool.inflight or driver.ready:
        v.append("run did not end with every batch trained and nothing outstanding")
    return v, learner.spanning


@pytest.mark.timeout(300)
def test_invariants_hold_over_thousands_of_random_trials():
    rng = random.Random(20261129)
    partial_trials = switched = 0
    failures = []
    for trial in range(TRIALS):
        settings, timings = random_trial(rng)
        partial_trials += bool(timings.commits and min(timings.commits) < settings.updates_per_batch)
        violations, spans = check_trial(settings, timings)
        switched += spans > 0
        if violations:
            failures.append((trial, settings, timings, violations[:3]))
    assert not failures, failures[:5]
    assert partial_trials > TRIALS // 3  # the partially committed case is well covered
    assert switched > TRIALS // 10  # batches that really changed weights mid-generation

def test_the_checker_catches_a_broken_admission_rule(monkeypatch):
    """The fuzzer can fail: admit one batch too many and it reports over-budget staleness."""
    monkeypatch.setattr(AsyncControl, "freshness", lambda self, _oldest=None: (
        (self.settings.staleness_budget - self.publish_lag) // self.settings.updates_per_batch + 2
    ))
    settings = BudgetSettings(max_staleness=1, updates_per_batch=1, max_inflight=4, total_batches=8)
    with pytest.raises(Exception, match="outstanding at a weight sync"):
        check_trial(settings, Timings())


def test_the_checker_catches_the_drain_rule_used_without_draining(monkeypatch):
    """Without draining, the launch rule must bound by the oldest version still generating: the
    draining rule (the published version's lag only) lets a later launch overtake an older batch,
    which then trains above budget — the fuzzer sees it in the data."""
    original = AsyncControl.freshness
    monkeypatch.setattr(AsyncControl, "freshness", lambda self, _oldest=None: original(self))
    rng = random.Random(7)
    caught = 0
    for _ in range(300):
        settings, timings = random_trial(rng)
        if settings.drains:
            continue
        try:
            violations, _ = check_trial(settings, timings)
        except StaleBatchError:  # the loop's own fail-closed check at consumption saw it first
            caught += 1
        else:
            caught += any("> budget" in v for v in violations)
    assert caught > 0
