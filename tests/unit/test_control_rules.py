"""Every control rule on hand-computed cases, including partially committed steps."""

import pytest

from tether.control import AsyncControl, BudgetSettings
from tether.errors import ConfigError, ControlError, StaleBatchError


def control(**kw) -> AsyncControl:
    kw.setdefault("total_batches", 100)
    return AsyncControl(BudgetSettings(**kw))


# -- derived quantities ------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("s", "u", "budget", "depth"),
    [(0, 1, 0, 1), (1, 1, 1, 2), (1, 4, 4, 2), (3, 2, 6, 4), (11, 2, 22, 12), (11, 8, 88, 12)],
)
def test_budget_is_s_times_u_and_depth_is_s_plus_one(s, u, budget, depth):
    b = BudgetSettings(max_staleness=s, updates_per_batch=u)
    assert b.staleness_budget == budget
    assert b.admission_depth == depth


@pytest.mark.parametrize(
    ("s", "eval_i", "save_i", "period"),
    [(1, 0, 0, 2), (11, 10, 0, 10), (11, 0, 5, 5), (3, 8, 4, 4), (3, 2, 4, 2), (0, 5, 5, 1)],
)
def test_a_regular_sync_period_is_min_of_depth_and_nonzero_intervals(s, eval_i, save_i, period):
    b = BudgetSettings(max_staleness=s, eval_interval=eval_i, save_interval=save_i, total_batches=50)
    assert b.sync_period_batches == period
    assert b.describe_sync_schedule() == f"every {period} batch(es)"


@pytest.mark.parametrize(
    ("s", "eval_i", "save_i", "gaps", "first"),
    [
        (3, 6, 0, (4, 2), [4, 6, 10, 12]),  # docs/architecture.md §1's example
        (3, 10, 6, (4, 2, 4, 2, 4, 2, 2, 4, 4, 2), [4, 6, 10, 12, 16, 18, 20, 24, 28, 30]),
        (3, 2, 3, (2, 1, 1, 2), [2, 3, 4, 6, 8, 9, 10, 12]),
    ],
)
def test_an_irregular_schedule_is_reported_as_its_gaps_not_as_a_period(s, eval_i, save_i, gaps, first):
    b = BudgetSettings(max_staleness=s, eval_interval=eval_i, save_interval=save_i, total_batches=60)
    assert b.sync_gaps == gaps and b.sync_period_batches is None
    assert b.lazy_publications()[: len(first)] == first
    text = b.describe_sync_schedule()
    assert text.startswith("on an irregular schedule: after batches ") and "repeating" in text
    # the driver itself publishes exactly there (fakes, every update committed)
    from tether.loop import Timings, simulate, summarize

    assert summarize(simulate(b, Timings()))["syncs_after"] == b.lazy_publications()


def test_effective_max_staleness_caps_at_interval_and_run_length():
    assert BudgetSettings(max_staleness=11, eval_interval=10, total_batches=50).effective_max_staleness == 9
    assert BudgetSettings(max_staleness=3, total_batches=2).effective_max_staleness == 1
    assert BudgetSettings(max_staleness=3, total_batches=50).effective_max_staleness == 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_staleness": -1}, "async.max_staleness must be >= 0"),
        ({"updates_per_batch": 0}, "train.updates_per_batch must be >= 1"),
        ({"max_inflight": 0}, "async.max_inflight must be >= 1"),
        ({"total_batches": 0}, "train.num_batches must be >= 1"),
        ({"eval_interval": -2}, "eval.interval must be >= 0"),
        ({"max_staleness": 1.5}, "must be an integer"),
        ({"on_stale": "skip"}, "async.on_stale must be one of error, drop"),
    ],
)
def test_bad_settings_say_what_is_allowed(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        BudgetSettings(**kwargs)


# -- hard boundaries ---------------------------------------------------------------------------

def test_next_hard_boundary_is_nearest_eval_save_or_final():
    b = BudgetSettings(eval_interval=4, save_interval=6, total_batches=10)
    # trained → boundary: evals at 4, 8; saves at 6; final 10
    assert [b.next_hard_boundary(k) for k in range(10)] == [4, 4, 4, 4, 6, 6, 8, 8, 10, 10]
    assert BudgetSettings(total_batches=7).next_hard_boundary(0) == 7


def test_eval_and_save_are_due_at_intervals_and_at_the_end():
    b = BudgetSettings(eval_interval=4, save_interval=3, total_batches=10)
    assert [k for k in range(1, 11) if b.eval_due(k)] == [4, 8, 10]
    assert [k for k in range(1, 11) if b.save_due(k)] == [3, 6, 9, 10]
    off = BudgetSettings(total_batches=10)
    assert not any(off.eval_due(k) or off.save_due(k) for k in range(1, 11))


# -- versions ----------------------------------------------------------------------------------

def test_clock_advances_by_committed_updates_only():
    c = control(updates_per_batch=3)
    c.commit(3)
    c.commit(1)  # two updates skipped (non-finite gradient): not committed
    c.commit(0)  # nothing committed at all
    assert c.train_version == 4
    assert c.publish_lag == 4
    with pytest.raises(ControlError, match="between 0 and U=3"):
        c.commit(4)
    with pytest.raises(ControlError):
        c.commit(-1)


def test_publish_sets_rollout_version_and_refuses_the_future_and_the_past():
    c = control(updates_per_batch=2)
    c.commit(2)
    assert c.mark_published() == 2
    assert c.publish_lag == 0
    with pytest.raises(ControlError, match="ahead of train version"):
        c.mark_published(3)
    with pytest.raises(ControlError, match="backwards"):
        c.mark_published(1)


def test_staleness_in_updates_and_batches():
    c = control(max_staleness=2, updates_per_batch=4)  # budget 8
    for _ in range(3):
        c.commit(4)
    c.commit(2)  # train_version = 14
    s = c.staleness(6)
    assert (s.updates, s.batches, s.within_budget) == (8, 2.0, True)
    s = c.staleness(5)
    assert (s.updates, s.batches, s.within_budget) == (9, 2.25, False)
    with pytest.raises(ControlError, match="in the future"):
        c.staleness(15)


def test_stale_batch_fails_closed_by_default_and_is_reported_with_drop():
    c = control(max_staleness=0)
    c.commit(1)
    with pytest.raises(StaleBatchError, match="above the budget of 0 updates"):
        c.check_consumable(0, batch_index=7)
    d = control(max_staleness=0, on_stale="drop")
    d.commit(1)
    assert d.check_consumable(0, batch_index=7).within_budget is False


def test_restore_forces_a_publish_before_any_launch():
    c = control(max_staleness=1, updates_per_batch=2)
    c.restore(6)
    assert (c.train_version, c.rollout_version, c.publish_required) == (6, 0, True)
    assert c.launch_slots(inflight=0, ready=0, trained_batches=3) == 0
    c.mark_published()
    assert c.launch_slots(inflight=0, ready=0, trained_batches=3) == 2
    fresh = control()
    fresh.restore(0)
    assert fresh.publish_required is False


def test_restore_with_the_engines_version_continues_without_a_publish():
    c = control(max_staleness=1, updates_per_batch=1)
    c.restore(5, rollout_version=4)  # a stop between two publications; the engines get v4 back
    assert (c.train_version, c.rollout_version, c.publish_lag, c.publish_required) == (5, 4, 1, False)
    assert c.launch_slots(inflight=0, ready=0, trained_batches=5) == 1  # as before the stop
    with pytest.raises(ControlError, match="ahead of the train version"):
        c.restore(3, rollout_version=4)


# -- launch slots ------------------------------------------------------------------------------

def test_launch_slots_hand_computed():
    c = control(max_staleness=1, updates_per_batch=2, max_inflight=2)  # budget 2, depth 2
    # lag 0: freshness = 2//2 + 1 = 2 → launch 2
    assert c.freshness() == 2
    assert c.launch_slots(inflight=0, ready=0, trained_batches=0) == 2
    # one step of 2 committed, the second batch still in flight: lag 2, freshness 0//2+1 = 1
    c.commit(2)
    assert c.freshness() == 1
    assert c.launch_slots(inflight=1, ready=0, trained_batches=1) == 0
    # over budget: no launch at all
    c.commit(2)
    assert c.publish_lag == 4
    assert c.freshness() == 0
    assert c.launch_slots(inflight=0, ready=0, trained_batches=2) == 0


def test_partial_commit_floors_freshness():
    c = control(max_staleness=1, updates_per_batch=2, max_inflight=4)  # budget 2
    c.commit(1)  # a partially committed step: lag 1
    # (2 − 1) // 2 + 1 = 1, not 1.5 → 2: the budget cannot cover a second outstanding batch
    assert c.freshness() == 1
    assert c.launch_slots(inflight=0, ready=0, trained_batches=1) == 1
    c2 = control(max_staleness=3, updates_per_batch=2, max_inflight=8)  # budget 6
    c2.commit(1)
    assert c2.freshness() == 3  # (6 − 1) // 2 + 1


def test_launch_slots_respect_inflight_cap_ready_batches_and_boundaries():
    c = control(max_staleness=5, max_inflight=3, eval_interval=4, total_batches=10)  # depth 6
    assert c.launch_slots(inflight=0, ready=0, trained_batches=0) == 3  # max_inflight
    assert c.launch_slots(inflight=1, ready=2, trained_batches=0) == 1  # boundary 4 − 3 outstanding
    assert c.launch_slots(inflight=0, ready=0, trained_batches=3) == 1  # boundary 4 − 3 trained
    assert c.launch_slots(inflight=1, ready=0, trained_batches=3) == 0
    # final boundary: 1 batch left to train
    assert c.launch_slots(inflight=0, ready=0, trained_batches=9) == 1


# -- sync rule ---------------------------------------------------------------------------------

def test_sync_due_for_eval_save_or_exhausted_budget():
    c = control(max_staleness=1, updates_per_batch=2, eval_interval=3, save_interval=4, total_batches=8)
    c.commit(2)
    assert c.sync_decision(1).reasons == ()          # lag 2 == budget: not yet
    c.commit(2)
    assert c.sync_decision(2).reasons == ("budget",)  # lag 4 > 2
    c.mark_published()
    c.commit(2)
    assert c.sync_decision(3).reasons == ("eval",)
    c.commit(1)
    c.commit(1)  # lag 4 at step 4
    assert c.sync_decision(4).reasons == ("save", "budget")
    # the final step is never a budget sync: nothing is left to generate
    c.commit(2)
    assert "budget" not in c.sync_decision(8).reasons
    assert c.sync_decision(8).reasons == ("eval", "save")  # both run at the end too


def test_idle_sync_only_when_asked_idle_ahead_and_nothing_else_due():
    lazy = control(max_staleness=1, total_batches=8)
    lazy.commit(1)
    assert lazy.sync_decision(1, engines_idle=True).reasons == ()  # off by default
    fresh = control(max_staleness=1, total_batches=8, sync_when_idle=True)
    assert fresh.sync_decision(0, engines_idle=True).reasons == ()  # nothing new to publish
    c = control(max_staleness=1, total_batches=8, eval_interval=4, sync_when_idle=True)
    c.commit(1)
    assert c.sync_decision(1, engines_idle=False).reasons == ()  # a generation is in flight
    assert c.sync_decision(1, engines_idle=True).reasons == ("idle",)
    c.commit(1)
    assert c.sync_decision(2, engines_idle=True).reasons == ("budget",)  # due anyway
    c.mark_published()
    c.commit(1)
    c.mark_published()
    c.commit(1)
    assert c.sync_decision(4, engines_idle=True).reasons == ("eval",)  # a boundary, not "idle"
    c.mark_published()
    c.commit(1)
    assert c.sync_decision(8, engines_idle=True).reasons == ("eval",)  # never idle at the end


def test_without_draining_a_launch_is_bounded_by_the_oldest_version_still_generating():
    """S = 1, U = 1, keep: batches A and B launched at v0; A trains (T = 1) and v1 is published
    while B still generates. Launching C now (at v1) would let C finish first and train before
    B, which would then train at staleness 2 > 1: no slot while B (v0) generates; once B is
    done, the published version bounds the launch as when draining."""
    c = AsyncControl(BudgetSettings(max_staleness=1, max_inflight=2, total_batches=10,
                                    inflight_update="keep"))
    assert c.launch_slots(inflight=0, ready=0, trained_batches=0) == 2
    c.commit(1)
    c.mark_published()
    assert c.sync_decision(1).reasons == ()  # published above: the trainer is not ahead
    assert c.launch_slots(inflight=1, ready=0, trained_batches=1) == 1  # the drain rule's answer
    assert c.launch_slots(inflight=1, ready=0, trained_batches=1, oldest_generating=0) == 0
    assert c.launch_slots(inflight=0, ready=1, trained_batches=1, oldest_generating=None) == 1
    c.commit(1)
    assert c.sync_decision(2).reasons == ("eager",)
    with pytest.raises(ControlError, match="ahead of the published version"):
        c.freshness(oldest_generating=2)


def test_draining_never_publishes_eagerly():
    c = AsyncControl(BudgetSettings(max_staleness=2, total_batches=10))
    c.commit(1)
    assert c.sync_decision(1).reasons == ()


def test_draining_at_turn_boundaries_runs_the_rules_of_publishing_without_draining():
    """drain with drain_at_turns (agent episodes, env.switch_at=turn): a publication waits only for
    the turns in flight, so generations outlive it. The control plane publishes after every step
    the trainer is ahead and bounds launches by the oldest version still generating, as for keep."""
    turns = BudgetSettings(max_staleness=1, max_inflight=2, total_batches=10, inflight_update="drain",
                           drain_at_turns=True)
    keep = BudgetSettings(max_staleness=1, max_inflight=2, total_batches=10, inflight_update="keep")
    assert not turns.drains and turns.sync_gaps == keep.sync_gaps == (1,)
    assert turns.effective_max_staleness == keep.effective_max_staleness
    c = AsyncControl(turns)
    c.commit(1)
    assert c.sync_decision(1).reasons == ("eager",)
    c.mark_published()
    assert c.launch_slots(inflight=1, ready=0, trained_batches=1, oldest_generating=0) == 0
    with pytest.raises(ConfigError, match=r"sync_when_idle .* drains only the turns in flight"):
        BudgetSettings(inflight_update="drain", drain_at_turns=True, sync_when_idle=True)
    with pytest.raises(ConfigError, match=r"needs async\.inflight_update=drain"):
        BudgetSettings(inflight_update="keep", drain_at_turns=True)
