"""The loop in virtual time: sync periods, staleness in batch units, and the planner summary."""

import pytest

from tether.control import BudgetSettings
from tether.loop import Timings, plan_document, simulate, summarize


@pytest.mark.parametrize("s", [0, 1, 3, 11])
@pytest.mark.parametrize("u", [1, 2, 3, 4, 8])
def test_sync_period_is_s_plus_one_and_max_staleness_is_s_at_every_u(s, u):
    settings = BudgetSettings(max_staleness=s, updates_per_batch=u, max_inflight=2,
                              total_batches=3 * (s + 1) + 1)
    sim = simulate(settings, Timings(gen_time=1.0, train_time=0.3))
    summary = summarize(sim)
    assert settings.sync_period_batches == s + 1
    # publications every S+1 batches (none after the final batch: nothing left to generate)
    assert summary["syncs_after"] == [(s + 1) * k for k in (1, 2, 3)]
    assert summary["max_staleness_batches"] == s
    # measured from the data the learner saw, in updates
    staleness = [tv - dv for _i, tv, dv in sim.learner.trained]
    assert max(staleness) == s * u


def test_s11_with_eval_every_10_publishes_every_10_and_caps_staleness_at_9():
    settings = BudgetSettings(max_staleness=11, updates_per_batch=2, max_inflight=12,
                              eval_interval=10, total_batches=40)
    sim = simulate(settings, Timings(gen_time=0.5, train_time=1.0))
    summary = summarize(sim)
    assert summary["syncs_after"] == [10, 20, 30, 40]
    assert summary["max_staleness_batches"] == 9
    assert settings.sync_period_batches == 10
    notes = dict(sim.trace.notes)
    assert "never more than 9 batch(es) stale" in notes["boundary_clamp"]


def test_partial_commits_delay_budget_syncs():
    # S=1, U=2, budget 2 updates. With every step committing only 1 of its 2 updates the lag
    # after steps 1, 2, 3 is 1, 2, 3: the budget is exceeded, and weights published, only after
    # every third batch; staleness in updates still never exceeds 2.
    settings = BudgetSettings(max_staleness=1, updates_per_batch=2, total_batches=9)
    doc = plan_document(simulate(settings, Timings(commits=(1,))))
    assert [b["committed_updates"] for b in doc["batches"]] == [1] * 9
    assert [b["staleness_updates"] for b in doc["batches"]] == [0, 1, 2] * 3
    assert [b["staleness_batches"] for b in doc["batches"]] == [0, 0.5, 1.0] * 3
    assert doc["syncs_after"] == [3, 6]
    # with alternating 2, 1 commits the lag after two steps is 3 > 2: every 2 batches
    alt = plan_document(simulate(settings, Timings(commits=(2, 1))))
    assert alt["syncs_after"] == [2, 4, 6, 8]


def test_plan_document_has_the_documented_fields():
    sim = simulate(BudgetSettings(max_staleness=2, updates_per_batch=2, total_batches=6),
                   Timings(gen_time=1.0, train_time=0.5))
    doc = plan_document(sim)
    for key in ("staleness_budget", "admission_depth", "sync_period_batches", "syncs_after",
                "batches", "notes", "summary"):
        assert key in doc
    assert (doc["staleness_budget"], doc["admission_depth"], doc["sync_period_batches"]) == (4, 3, 3)
    assert set(doc["batches"][0]) >= {"index", "behavior_version", "staleness_updates",
                                      "staleness_batches"}
    for key in ("mean_step_time_s", "trainer_idle_fraction", "generator_idle_fraction",
                "staleness_histogram_batches"):
        assert key in doc["summary"]


def test_step_time_matches_closed_form_in_the_simple_cases():
    # synchronous: each batch costs gen + train + sync, nothing overlaps
    sync = summarize(simulate(BudgetSettings(max_staleness=0, max_inflight=1, total_batches=10),
                              Timings(gen_time=2.0, train_time=1.0, sync_time=0.5)))
    # 10 × (2 + 1) + 9 publications × 0.5 (none after the final batch)
    assert sync["makespan_s"] == pytest.approx(10 * 3.0 + 9 * 0.5)
    # deep budget, generation-bound: the trainer waits, generation never stops inside a period
    deep = summarize(simulate(BudgetSettings(max_staleness=9, max_inflight=10, total_batches=10),
                              Timings(gen_time=2.0, train_time=1.0)))
    assert deep["makespan_s"] == pytest.approx(10 * 2.0 + 1.0)
    assert deep["generator_idle_fraction"] == pytest.approx(1 - 20 / 21)


def test_jitter_is_seeded():
    settings = BudgetSettings(max_staleness=2, max_inflight=3, total_batches=20)
    a = summarize(simulate(settings, Timings(gen_jitter=0.5, workers=3, seed=7)))
    b = summarize(simulate(settings, Timings(gen_jitter=0.5, workers=3, seed=7)))
    c = summarize(simulate(settings, Timings(gen_jitter=0.5, workers=3, seed=8)))
    assert a == b
    assert a["makespan_s"] != c["makespan_s"]


def test_bad_timings_are_refused():
    with pytest.raises(ValueError, match="gen_time must be a finite number >= 0"):
        Timings(gen_time=-1)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        Timings(workers=0)


def test_event_trace_has_every_kind_in_time_order():
    settings = BudgetSettings(max_staleness=1, total_batches=4, eval_interval=2, save_interval=4)
    doc = plan_document(simulate(settings, Timings(gen_time=1.0, train_time=0.5, sync_time=0.1)))
    events = doc["events"]
    kinds = {e["kind"] for e in events}
    assert {"launch", "complete", "ready", "consume", "train", "sync", "eval", "save"} <= kinds
    assert [e["t"] for e in events] == sorted(e["t"] for e in events)
    # each batch: launched, then completed, then consumed, then trained
    for b in range(4):
        seq = [e["kind"] for e in events if e["batch"] == b and e["kind"] in
               ("launch", "complete", "consume", "train")]
        assert seq == ["launch", "complete", "consume", "train"]


@pytest.mark.parametrize(("gen", "train"), [(0.1, 0.35), (0.3, 0.3), (0.2, 0.3)])
def test_idle_syncs_keep_the_pipeline_full_at_s1_within_budget(gen, train):
    """With training the slower (or equal) side, lazy syncs at S = 1 idle the generator every
    other step; idle syncs reach max(T_gen, T_train) plus the publish, and never exceed S."""
    timings = Timings(gen_time=gen, train_time=train, sync_time=0.005)
    runs = {}
    for idle in (False, True):
        settings = BudgetSettings(max_staleness=1, max_inflight=2, total_batches=100, sync_when_idle=idle)
        sim = simulate(settings, timings)
        runs[idle] = summarize(sim)["mean_step_time_s"]
        assert max(r.staleness_batches for r in sim.trace.records) <= 1
    ideal = max(gen, train)
    assert runs[True] < 1.05 * (ideal + 0.005) < runs[False]


def test_sequence_lengths_are_geometric_capped_and_their_longest_is_expected():
    import statistics

    from tether.loop.sequences import Lengths

    lengths = Lengths(mean=12.0, cap=40, rows=16, seed=3)
    draws = [lengths.draw(b, i, 0) for b in range(400) for i in range(16)]
    assert min(draws) >= 1 and max(draws) == 40  # the cap is reached: a long tail, cut
    assert statistics.fmean(draws) == pytest.approx(12.0, rel=0.03)  # the mean of the capped lengths
    uncapped = Lengths(mean=12.0, cap=10**6, rows=1)
    assert statistics.fmean(uncapped.draw(b, 0, 0) for b in range(20000)) == pytest.approx(12.0, rel=0.03)
    assert {Lengths(mean=40.0, cap=40, rows=1).draw(b, 0, 0) for b in range(50)} == {40}
    assert {Lengths(mean=1.0, cap=40, rows=1).draw(b, 0, 0) for b in range(50)} == {1}
    longest = [max(draws[b * 16:(b + 1) * 16]) for b in range(400)]
    assert statistics.fmean(longest) == pytest.approx(lengths.expected_longest(), rel=0.05)
    assert [lengths.draw(7, 3, 1) for _ in range(3)] == [lengths.draw(7, 3, 1)] * 3  # a pure function


def test_what_each_mode_does_to_a_generation_at_a_publication():
    """Two sequences of 10 and 4 tokens, one step a second, a publication at t = 2.5 (so from
    step 3 on): keep splits the long one's tokens 3 + 7 and ends on time; recompute adds the
    3-token prefix's prefill; abort throws away 3 tokens of the long one and starts it again."""
    from tether.loop.sequences import Lengths, replay

    lengths = Lengths(mean=5.0, cap=64, rows=2, seed=0)
    batch = next(b for b in range(10000) if [lengths.draw(b, i, 0) for i in range(2)] == [10, 4])
    keep = replay(lengths, batch, 0, "keep", [(2.5, 1)], 0.0, 1.0, 0.5)
    assert (keep.steps, keep.pause_s, keep.wasted_tokens) == (10, 0.0, 0)
    assert keep.tokens_by_version == {0: 3 + 3, 1: 7 + 1} and keep.spanning_rows == 2
    recompute = replay(lengths, batch, 0, "recompute", [(2.5, 1)], 0.0, 1.0, 0.5)
    assert (recompute.steps, recompute.pause_s) == (10, 0.5 * 3)
    assert recompute.tokens_by_version == keep.tokens_by_version
    abort = replay(lengths, batch, 0, "abort", [(2.5, 1)], 0.0, 1.0, 0.5)
    again = [lengths.draw(batch, i, 1) for i in range(2)]
    assert abort.wasted_tokens == 3 + 3 and abort.spanning_rows == 0
    assert abort.steps == 3 + max(again)
    assert abort.tokens_by_version == {1: sum(again)}
    # published before it started: it starts under the new weights, nothing wasted or split
    early = replay(lengths, batch, 0, "abort", [(0.0, 1)], 0.0, 1.0, 0.5)
    assert early.tokens_by_version == {1: 14} and early.wasted_tokens == 0
    # published after it finished: nothing changes
    late = replay(lengths, batch, 0, "abort", [(10.0, 1)], 0.0, 1.0, 0.5)
    assert late.tokens_by_version == {0: 14} and late.steps == 10


@pytest.mark.parametrize("s", [1, 2])
def test_the_planner_prices_each_inflight_mode_on_a_long_tail(s):
    """Per-sequence lengths: draining keeps the mean batch at gen_time; keep beats drain on a long
    tail; recompute pays its prefills and abort its wasted tokens; every batch within S."""
    timings = Timings(gen_time=0.3, train_time=0.2, sync_time=0.005, mean_length=20, max_length=96,
                      prefill_cost=0.2)
    out = {}
    for mode in ("drain", "keep", "recompute", "abort"):
        settings = BudgetSettings(max_staleness=s, max_inflight=s + 1, total_batches=200,
                                  inflight_update=mode)
        sim = simulate(settings, timings, num_groups=4, group_size=8)
        assert max(r.staleness_batches for r in sim.trace.records) <= s
        out[mode] = summarize(sim)
    spans = [end - start for _e, start, end, _i in simulate(
        BudgetSettings(max_staleness=0, max_inflight=1, total_batches=300), timings,
        num_groups=4, group_size=8).pool.spans]
    assert sum(spans) / len(spans) == pytest.approx(0.3, rel=0.1)
    step = {m: r["mean_step_time_s"] for m, r in out.items()}
    assert step["keep"] < step["recompute"] < step["drain"]
    assert step["keep"] < step["abort"]
    assert out["abort"]["wasted_tokens_per_batch"] > 0 == out["keep"]["wasted_tokens_per_batch"]
    assert out["abort"]["multi_version_seq_frac"] == 0 < out["keep"]["multi_version_seq_frac"]
    assert out["drain"]["multi_version_seq_frac"] == 0 and out["drain"]["wasted_tokens_per_batch"] == 0


def test_publications_that_reach_the_same_poll_make_one_switch():
    """Two publications between the same two decode steps: one prefill (recompute), one restart
    (abort), the tokens under the newer version. One that comes during a recompute's prefill is
    seen at the next poll, which pays a prefill of its own."""
    from tether.loop.sequences import Lengths, replay

    lengths = Lengths(mean=5.0, cap=64, rows=2, seed=0)
    batch = next(b for b in range(10000) if [lengths.draw(b, i, 0) for i in range(2)] == [10, 4])
    twice = [(2.3, 1), (2.6, 2)]
    recompute = replay(lengths, batch, 0, "recompute", twice, 0.0, 1.0, 0.5)
    assert recompute.pause_s == 0.5 * 3 and recompute.tokens_by_version == {0: 6, 2: 8}
    abort = replay(lengths, batch, 0, "abort", twice, 0.0, 1.0, 0.5)
    once = replay(lengths, batch, 0, "abort", [(2.6, 2)], 0.0, 1.0, 0.5)
    assert (abort.wasted_tokens, abort.steps, abort.tokens_by_version) == (
        once.wasted_tokens, once.steps, once.tokens_by_version)
    # the poll at step 3 (t = 3.0) starts a 1.5 s prefill; t = 3.5 falls inside it: seen at step 4
    during = replay(lengths, batch, 0, "recompute", [(2.5, 1), (3.5, 2)], 0.0, 1.0, 0.5)
    assert during.pause_s == 0.5 * 3 + 0.5 * 4
    assert during.tokens_by_version == {0: 3 + 3, 1: 1 + 1, 2: 6}  # step 3 under v1, steps 4–9 under v2
