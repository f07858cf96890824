"""The driver loop against the threaded fakes; staleness is measured from the data stamps."""

import threading

import pytest

from tether.control import AsyncControl, BudgetSettings
from tether.errors import ControlError, RolloutError, StaleBatchError
from tether.loop import Driver, LoopState, TraceRecorder
from tether.loop.fakes import FakeLearner, FakePool, RecordingHooks

pytestmark = pytest.mark.timeout(30)


def run(make_pool, *, pool_kw=None, learner_kw=None, resume=None, **settings):
    settings.setdefault("total_batches", 12)
    s = BudgetSettings(**settings)
    pool = make_pool(**(pool_kw or {}))
    learner = FakeLearner(updates_per_batch=s.updates_per_batch, **(learner_kw or {}))
    if resume is not None:
        learner.version = resume.train_version
        pool.version = resume.rollout_version or 0  # the engines hold what the checkpoint kept
    hooks = RecordingHooks(pool)
    trace = TraceRecorder()
    state = Driver(AsyncControl(s), pool, learner, hooks=hooks, observer=trace,
                   wait_timeout_s=10).run(resume)
    return state, pool, learner, hooks, trace


def test_synchronous_mode_trains_every_batch_at_staleness_zero(make_pool):
    state, pool, learner, _hooks, trace = run(make_pool, max_staleness=0, max_inflight=1,
                                              updates_per_batch=2)
    assert learner.measured_staleness() == [0] * 12
    assert pool.published == [2 * k for k in range(1, 12)]  # every batch but the last
    # the last batch is not followed by a publication: the engines end one batch behind
    assert state == LoopState(trained_batches=12, launched_batches=12, dropped_batches=0,
                              train_version=24, rollout_version=22)
    assert [n for n, _ in trace.notes] == ["no_overlap"]


@pytest.mark.parametrize(("s", "u"), [(1, 1), (1, 3), (2, 2), (3, 1)])
def test_async_staleness_from_the_data_cycles_up_to_s_batches(make_pool, s, u):
    _state, _pool, learner, _hooks, trace = run(
        make_pool, max_staleness=s, updates_per_batch=u, max_inflight=s + 1,
        total_batches=4 * (s + 1), pool_kw={"workers": 2, "gen_time": 0.002},
    )
    measured = learner.measured_staleness()
    assert max(measured) == s * u
    assert all(m <= s * u for m in measured)
    # the loop's own records agree with the data
    assert [r.staleness_updates for r in trace.records] == measured


def test_eval_and_save_happen_after_drain_and_publish(make_pool):
    _state, _pool, learner, hooks, trace = run(
        make_pool, max_staleness=3, max_inflight=4, eval_interval=3, save_interval=5,
        total_batches=10, pool_kw={"workers": 2},
    )
    # baseline eval at 0, then 3, 6, 9, and the end; each sees the train version published
    assert [step for step, _ in hooks.evals] == [0, 3, 6, 9, 10]
    assert [v for _, v in hooks.evals] == [0, 3, 6, 9, 10]
    assert [st.trained_batches for st in hooks.saves] == [5, 10]
    assert hooks.outstanding_at_boundary == [0] * 7
    assert max(learner.measured_staleness()) <= 2  # the eval interval of 3 clamps S=3 to 2
    assert "boundary_clamp" in [n for n, _ in trace.notes]


def test_partial_commits_keep_the_clock_honest(make_pool):
    state, _pool, learner, _h, trace = run(
        make_pool, max_staleness=1, updates_per_batch=2, total_batches=8,
        learner_kw={"commits": [2, 1, 0, 2]},
    )
    assert state.train_version == 2 * (2 + 1 + 0 + 2)
    assert [r.metrics["async/optimizer_updates"] for r in trace.records] == [2, 1, 0, 2] * 2
    assert all(m <= 2 for m in learner.measured_staleness())


def test_stale_batch_fails_closed(make_pool):
    # an engine that stamps an older version than it holds produces over-budget batches
    with pytest.raises(StaleBatchError, match="above the budget"):
        run(make_pool, max_staleness=0, max_inflight=1, pool_kw={"stamp_lag": 2})


def test_stale_batch_dropped_and_counted_with_drop(make_pool, caplog):
    state, _pool, learner, _h, trace = run(
        make_pool, max_staleness=0, max_inflight=1, on_stale="drop", total_batches=4,
        pool_kw={"stamp_lag": 1, "stale_at": [2, 3]},
    )
    # batches 2 and 3 are stamped one version older than the engine holds → 1 update stale
    assert state.trained_batches == 4
    assert [e.batch for e in trace.of_kind("drop")] == [2, 3]
    assert state.dropped_batches == 2
    assert state.launched_batches == state.trained_batches + state.dropped_batches
    assert trace.records[-1].metrics["async/dropped_batches"] == state.dropped_batches
    assert "dropped rollout batch" in caplog.text
    assert learner.measured_staleness() == [0] * 4


def test_endless_drops_fail_instead_of_spinning(make_pool):
    with pytest.raises(ControlError, match="5 rollout batches in a row"):
        run(make_pool, max_staleness=0, max_inflight=1, on_stale="drop",
            max_consecutive_drops=5, pool_kw={"stamp_lag": 1})


def test_generation_error_reaches_the_driver_with_worker_batch_and_traceback(make_pool):
    with pytest.raises(RolloutError) as info:
        run(make_pool, max_staleness=1, pool_kw={"fail_at": [3], "workers": 2})
    err = info.value
    assert err.batch_index == 3
    assert "fake-0" in str(err)
    assert "injected generation failure" in str(err)


def test_training_error_is_not_masked_and_outstanding_work_is_abandoned_at_once(make_pool):
    s = BudgetSettings(max_staleness=2, max_inflight=3, total_batches=10)
    pool = make_pool(workers=1, gen_time=0.3)  # batch 2 still generates when batch 1 fails
    learner = FakeLearner(fail_at=[1])
    trace = TraceRecorder()
    driver = Driver(AsyncControl(s), pool, learner, observer=trace, wait_timeout_s=10)
    with pytest.raises(RuntimeError, match="injected training failure"):
        driver.run()
    # the error is not held back behind work still generating (the pool's close stops it)
    assert pool.inflight > 0
    # every launched batch accounted once: trained, or abandoned at shutdown (the failed one too)
    (abandoned,) = [e.detail["batches"] for e in trace.of_kind("abandon")]
    trained = [i for i, _, _ in learner.trained]
    assert 1 in abandoned
    assert sorted(trained + abandoned) == list(range(driver.launched))


def test_drain_failure_during_teardown_does_not_mask_the_primary_error(make_pool):
    s = BudgetSettings(max_staleness=2, max_inflight=3, total_batches=10)
    trained_and_failed = threading.Event()

    class SignallingItsTraining(FakeLearner):
        def train(self, batch, *, train_version):
            try:
                return super().train(batch, train_version=train_version)
            finally:
                trained_and_failed.set()

    def gen_time(index: int) -> float:
        # batch 2's generation fails only once batch 0's training has failed: during the drain
        if index == 2:
            assert trained_and_failed.wait(10)
            return 0.05
        return 0.01

    pool = make_pool(workers=3, gen_time=gen_time, fail_at=[2])
    learner = SignallingItsTraining(fail_at=[0])
    with pytest.raises(RuntimeError, match="injected training failure") as info:
        Driver(AsyncControl(s), pool, learner, wait_timeout_s=10).run()
    assert not isinstance(info.value, RolloutError)


def test_keyboard_interrupt_is_never_swallowed(make_pool):
    class Interrupting(FakeLearner):
        def train(self, batch, *, train_version):
            if batch.index == 2:
                raise KeyboardInterrupt
            return super().train(batch, train_version=train_version)

    pool = make_pool(workers=2, gen_time=0.005)
    trace = TraceRecorder()
    driver = Driver(AsyncControl(BudgetSettings(max_staleness=1, total_batches=8)), pool,
                    Interrupting(), observer=trace, wait_timeout_s=10)
    with pytest.raises(KeyboardInterrupt):
        driver.run()
    # in-flight work is abandoned (not drained) and listed, so a resume can generate it again
    (abandon,) = trace.of_kind("abandon")
    assert 2 in abandon.detail["batches"]
    assert list(driver.state().pending) == abandon.detail["batches"]


def test_a_requested_stop_finishes_the_step_saves_and_lists_pending_batches(make_pool):
    class StopAfterTwo(FakeLearner):
        def train(self, batch, *, train_version):
            result = super().train(batch, train_version=train_version)
            if len(self.trained) == 2:
                assert driver.request_stop() is False  # inside a step: not safe to raise here
            return result

    pool = make_pool(workers=2, gen_time=0.01)
    hooks = RecordingHooks(pool)
    learner = StopAfterTwo()
    driver = Driver(AsyncControl(BudgetSettings(max_staleness=1, max_inflight=2, total_batches=10,
                                                save_interval=5)),
                    pool, learner, hooks=hooks, wait_timeout_s=10)
    with pytest.raises(KeyboardInterrupt):
        driver.run()
    assert len(learner.trained) == 2  # the step in progress finished; no further batch trained
    (final,) = hooks.saves
    assert final.trained_batches == 2
    trained = {i for i, _, _ in learner.trained}
    assert set(final.pending) == set(range(final.launched_batches)) - trained


def test_a_stop_while_a_step_is_reported_still_reports_it_before_saving(make_pool):
    """Ctrl-C arriving after the optimizer step but while the step's metrics are written must not
    raise there: the final checkpoint would count a batch with no metrics row."""
    from tether.loop.observe import LoopObserver

    class CtrlCWhileReporting(LoopObserver):
        def __init__(self):
            self.records = []

        def on_batch(self, record):
            if len(self.records) == 1 and driver.request_stop():  # as the SIGINT handler does
                raise KeyboardInterrupt
            self.records.append(record)

    pool = make_pool(workers=2, gen_time=0.005)
    hooks = RecordingHooks(pool)
    observer = CtrlCWhileReporting()
    driver = Driver(AsyncControl(BudgetSettings(max_staleness=1, total_batches=10, save_interval=5)),
                    pool, FakeLearner(), hooks=hooks, observer=observer, wait_timeout_s=10)
    with pytest.raises(KeyboardInterrupt):
        driver.run()
    (final,) = hooks.saves
    assert final.trained_batches == len(observer.records) == 2


def test_an_interrupt_inside_a_training_step_never_saves_that_state(make_pool):
    class InterruptedMidStep(FakeLearner):
        def train(self, batch, *, train_version):
            if len(self.trained) == 2:
                raise KeyboardInterrupt  # e.g. a second Ctrl-C inside the optimizer step
            return super().train(batch, train_version=train_version)

    pool = make_pool(workers=2, gen_time=0.005)
    hooks = RecordingHooks(pool)
    driver = Driver(AsyncControl(BudgetSettings(max_staleness=1, total_batches=10, save_interval=5)),
                    pool, InterruptedMidStep(), hooks=hooks, wait_timeout_s=10)
    with pytest.raises(KeyboardInterrupt):
        driver.run()
    assert hooks.saves == []  # the learner may be half-updated: the last good checkpoint stands


def test_resume_generates_pending_batches_before_fresh_ones(make_pool):
    resume = LoopState(trained_batches=2, launched_batches=4, dropped_batches=0, train_version=2,
                       pending=(2, 3))
    state, pool, learner, _h, _t = run(make_pool, max_staleness=1, total_batches=6, resume=resume)
    assert [r.index for r in pool.launched] == [2, 3, 4, 5]
    assert sorted(i for i, _, _ in learner.trained) == [2, 3, 4, 5]
    assert state.pending == ()


def test_resume_publishes_first_and_continues_versions_and_cursor(make_pool):
    resume = LoopState(trained_batches=4, launched_batches=4, dropped_batches=0, train_version=8)
    state, pool, learner, _h, trace = run(
        make_pool, max_staleness=1, updates_per_batch=2, total_batches=8, resume=resume,
    )
    first_sync = trace.of_kind("sync")[0]
    assert first_sync.detail["reasons"] == ("resume",)
    assert pool.published[0] == 8
    assert trace.events.index(first_sync) < trace.events.index(trace.of_kind("launch")[0])
    assert [r.index for r in pool.launched] == [4, 5, 6, 7]
    assert state.train_version == 16
    assert learner.measured_staleness() == [0, 2, 0, 2]


@pytest.mark.parametrize(("s", "u"), [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_a_stop_after_any_step_resumes_exactly_as_the_uninterrupted_run(make_pool, s, u):
    """A stop between two publications records the engines' version; a resume whose engines
    hold it again regenerates the abandoned batches under it: every batch trains at the same
    train version on data of the same version, and publications happen after the same steps."""
    from tether.loop.observe import LoopObserver

    total = 7
    settings = dict(max_staleness=s, updates_per_batch=u, max_inflight=s + 1, total_batches=total,
                    save_interval=total)
    _state, whole_pool, whole, _h, _t = run(make_pool, **settings)

    class StopAfter(LoopObserver):
        def __init__(self, step):
            self.step = step

        def on_batch(self, record):
            if record.step == self.step:
                assert driver.request_stop("SIGTERM") is False  # inside the step: stops after it

    for k in range(1, total):
        pool = make_pool()
        first = FakeLearner(updates_per_batch=u)
        hooks = RecordingHooks(pool)
        driver = Driver(AsyncControl(BudgetSettings(**settings)), pool, first, hooks=hooks,
                        observer=StopAfter(k), wait_timeout_s=10)
        with pytest.raises(KeyboardInterrupt):
            driver.run()
        (saved,) = hooks.saves
        assert saved.trained_batches == k
        assert saved.rollout_version == pool.version  # what the engines held at the stop
        _state, resumed_pool, second, _h, trace = run(make_pool, resume=saved, **settings)
        assert resumed_pool.version == saved.rollout_version or resumed_pool.published
        assert not [e for e in trace.of_kind("sync") if e.detail["reasons"] == ("resume",)]
        assert first.trained + second.trained == whole.trained, (k, first.trained, second.trained)
        assert pool.published + resumed_pool.published == whole_pool.published, k


def test_resume_past_the_end_is_refused(make_pool):
    with pytest.raises(ControlError, match="nothing to resume"):
        run(make_pool, total_batches=4, resume=LoopState(4, 4, 0, 4))


def test_every_record_carries_the_control_metrics(make_pool):
    _s, _p, _l, _h, trace = run(make_pool, max_staleness=1, total_batches=3)
    expected = {
        "async/train_version", "async/rollout_version", "async/publish_lag",
        "async/behavior_version", "async/optimizer_updates", "async/sync_period_batches",
        "async/dropped_batches", "staleness/updates", "staleness/batches",
        "time/generate_wait", "time/train", "time/sync", "time/step", "throughput/samples_per_s",
    }
    for record in trace.records:
        assert expected <= set(record.metrics)
    assert [r.metrics["async/train_version"] for r in trace.records] == [1, 2, 3]
    # the pool's publication metrics ride on the record of the step that published
    published = [r.step for r in trace.records if "sync/bytes" in r.metrics]
    assert published == [e.detail["step"] for e in trace.of_kind("sync") if e.detail["published"]]
    assert published == [2]


@pytest.mark.parametrize(("s", "lose"), [(0, [3]), (1, [3, 4]), (2, [0, 9])])
def test_a_batch_lost_with_its_worker_is_launched_again_and_trained_once(make_pool, s, lose):
    state, pool, learner, _hooks, trace = run(
        make_pool, max_staleness=s, max_inflight=s + 1, total_batches=10,
        pool_kw={"workers": 2, "gen_time": 0.002, "lose_at": lose})
    # every batch trained exactly once: the lost ones neither dropped nor doubled
    assert sorted(r.batch_index for r in trace.records) == list(range(10))
    assert state.launched_batches == 10 and state.pending == () and state.dropped_batches == 0
    # each lost batch launched a second time, as a new request the pool accepted at the version it
    # then held (FakePool.launch refuses any other)
    assert sorted(r.index for r in pool.launched if r.index in lose) == sorted(lose * 2)
    assert sorted(e.batch for e in trace.of_kind("worker_lost")) == sorted(lose)
    measured = learner.measured_staleness()  # from the data: within the budget, as the loop recorded
    assert max(measured) <= s and [r.staleness_updates for r in trace.records] == measured
    restarts = [r.metrics["rollout/worker_restarts"] for r in trace.records]
    assert restarts == sorted(restarts) and restarts[-1] == len(lose)


def test_generation_slower_than_training_publishes_idle_as_each_batch_completes(make_pool):
    """With one generation at a time the engine is idle when the batch the trainer waits for
    completes: the idle sync then hands it the weights the trainer has, and the next batch
    starts at once, one batch stale, instead of after the next training step."""
    state, pool, learner, _h, trace = run(make_pool, pool_kw={"gen_time": 0.03}, max_staleness=1,
                                          max_inflight=1, sync_when_idle=True, total_batches=8)
    assert learner.measured_staleness() == [0] + [1] * 7
    syncs = trace.of_kind("sync")
    assert [s.detail["reasons"] for s in syncs] == [("idle",)] * 7
    # after 1 … 7 trained batches, each as batch k completes, before the step that trains it
    assert [s.detail["step"] for s in syncs] == list(range(1, 8))
    events = trace.events
    for sync in syncs:
        at = events.index(sync)
        ready = [e for e in events[:at] if e.kind == "ready"][-1]
        trained = next(e for e in events[at:] if e.kind == "train")
        assert ready.batch == trained.batch == sync.detail["step"]
    assert pool.published == list(range(1, 8)) and state.rollout_version == 7
    lazy = run(make_pool, pool_kw={"gen_time": 0.03}, max_staleness=1, max_inflight=1, total_batches=8)[2]
    assert lazy.measured_staleness() == [0, 1] * 4


def test_a_stop_during_an_idle_publication_trains_nothing_more(make_pool):
    class StopWhilePublishing(FakePool):
        def publish(self, weights, version):
            metrics = super().publish(weights, version)
            if version == 3:
                assert driver.request_stop() is False  # inside the publication: not safe to raise
            return metrics

    pool = StopWhilePublishing(gen_time=0.02)
    learner = FakeLearner()
    driver = Driver(AsyncControl(BudgetSettings(max_staleness=1, max_inflight=1, sync_when_idle=True,
                                                total_batches=10)), pool, learner, wait_timeout_s=10)
    try:
        with pytest.raises(KeyboardInterrupt):
            driver.run()
    finally:
        pool.close()
    assert len(learner.trained) == 3  # version 3 was published before the fourth step: none ran
    assert driver.state().trained_batches == 3
