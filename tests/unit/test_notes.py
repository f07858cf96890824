"""Admission notes fire exactly where a number does not buy what its name implies."""

from tether.control import BudgetSettings, admission_notes


def codes(**kw):
    kw.setdefault("total_batches", 100)
    return [n.code for n in admission_notes(BudgetSettings(**kw))]


def test_plain_async_settings_have_no_notes():
    assert codes(max_staleness=1, max_inflight=2) == []
    assert codes(max_staleness=2, max_inflight=2) == []


def test_zero_staleness_says_no_overlap():
    assert codes(max_staleness=0, max_inflight=1) == ["no_overlap"]


def test_inflight_above_depth_is_wasted_concurrency():
    notes = admission_notes(BudgetSettings(max_staleness=1, max_inflight=4, total_batches=10))
    assert [n.code for n in notes] == ["inflight_surplus"]
    assert "2 slot(s) are never used" in notes[0].message


def test_depth_above_inflight_plus_one_reports_the_real_period():
    notes = admission_notes(BudgetSettings(max_staleness=3, max_inflight=2, total_batches=10))
    assert [n.code for n in notes] == ["depth_surplus"]
    assert "weights are published every 4 batch(es)" in notes[0].message


def test_eval_interval_below_depth_states_the_clamped_period_and_staleness():
    notes = admission_notes(BudgetSettings(max_staleness=11, max_inflight=12, eval_interval=10,
                                           total_batches=100))
    assert [n.code for n in notes] == ["boundary_clamp"]
    msg = notes[0].message
    assert "eval.interval=10" in msg
    assert "published every 10 batch(es)" in msg
    assert "never more than 9 batch(es) stale" in msg
    assert "not the 11" in msg


def test_both_intervals_named_when_both_clamp():
    notes = admission_notes(BudgetSettings(max_staleness=5, max_inflight=6, eval_interval=4,
                                           save_interval=3, total_batches=100))
    assert "eval.interval=4 and checkpoint.interval=3" in notes[-1].message
    # publications after 3, 4, 6, 8, 9, 12, …: no period, and the longest gap (3) caps staleness
    assert "on an irregular schedule: after batches 3, 4, 6, 8, 9, 12, …" in notes[-1].message
    assert "never more than 2 batch(es) stale" in notes[-1].message


def test_run_shorter_than_a_period_is_noted():
    notes = admission_notes(BudgetSettings(max_staleness=7, max_inflight=8, total_batches=3))
    assert [n.code for n in notes] == ["short_run"]
    assert "never more than 2 batch(es) stale" in notes[0].message


def test_a_budget_deeper_than_the_literature_supports_is_cautioned_more_strongly_without_decoupling():
    deep = dict(max_staleness=9, max_inflight=10, total_batches=100)
    assert "deep_budget" not in codes(**deep)  # no anchor given: no algorithm to judge
    notes = admission_notes(BudgetSettings(**deep), anchor="proximal")
    (note,) = [n for n in notes if n.code == "deep_budget"]
    assert "beyond the 8 that AReaL recommends" in note.message
    assert not [n for n in admission_notes(BudgetSettings(**{**deep, "max_staleness": 8}), anchor="proximal")
                if n.code.startswith("deep_budget")]
    # anchored on the behavior policy, the caution starts deeper than 4 batches, and says what to change
    behavior = [n for n in admission_notes(BudgetSettings(max_staleness=5, max_inflight=6, total_batches=100),
                                           anchor="behavior") if n.code.startswith("deep_budget")]
    assert [n.code for n in behavior] == ["deep_budget_behavior"]
    assert "Set train.anchor=proximal" in behavior[0].message
    # what counts is the staleness data can reach: an eval every 5 batches caps it at 4
    clamped = BudgetSettings(max_staleness=11, max_inflight=12, eval_interval=5, total_batches=100)
    assert not [n for n in admission_notes(clamped, anchor="behavior") if n.code.startswith("deep_budget")]
