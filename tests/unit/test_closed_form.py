"""Mean staleness in closed form: exact under the lazy publication rule (against the simulated
loop over a grid of recipes), Applied Compute's forms from their five parameters, and the
approximate forms for idle and eager publication where their regime is clear."""

import itertools
import random

import pytest

from tether.cli.main import main
from tether.config import load_config
from tether.loop.closed_form import closed_forms, lazy_staleness_updates, tail_multiplier
from tether.loop.virtual import plan_document, simulate, timings_of


def planned(cfg):
    return plan_document(simulate(cfg.budget(), timings_of(cfg), num_groups=cfg.rollout.batch_size,
                                  group_size=cfg.rollout.group_size))


def test_the_lazy_form_is_the_simulated_schedule_batch_for_batch():
    grid = list(itertools.product([0, 1, 2, 3], [1, 2], [1, 2, 3], [1, 2, 4], [0.5, 3.0], [0.2, 2.0],
                                  [0, 5], ["", "1,2"]))
    for s, u, w, m, g, t, ev, commits in random.Random(0).sample(grid, 60):
        overrides = [f"async.max_staleness={s}", f"train.updates_per_batch={u}", f"rollout.num_workers={w}",
                     f"async.max_inflight={m}", f"plan.gen_time={g}", f"plan.train_time={t}",
                     "plan.sync_time=0.01", "train.num_batches=17", f"eval.interval={ev}"]
        if commits and u == 2:
            overrides.append(f"plan.commits=[{commits}]")
        cfg = load_config(None, overrides)
        doc = planned(cfg)
        assert [b["staleness_updates"] for b in doc["batches"]] == \
            lazy_staleness_updates(cfg.budget(), tuple(cfg.plan.commits)), overrides
        form = closed_forms(cfg, gen_time=g, train_time=t, sync_time=0.01)
        assert form["rule"] == "lazy" and form["exact"]
        assert form["mean_staleness_batches"] == pytest.approx(doc["summary"]["mean_staleness_batches"])


def test_a_regular_period_averages_half_the_budget():
    cfg = load_config(None, ["async.max_staleness=3", "train.num_batches=40"])
    assert closed_forms(cfg, gen_time=1, train_time=1, sync_time=0)["mean_staleness_batches"] == 1.5


def test_applied_computes_five_parameters_and_forms_by_hand():
    cfg = load_config(None, ["async.max_staleness=4", "rollout.num_workers=2", "async.max_inflight=8",
                             "rollout.batch_size=4", "rollout.group_size=8", "train.updates_per_batch=2",
                             "async.inflight_update=keep", "plan.mean_length=20"])
    ac = closed_forms(cfg, gen_time=2.0, train_time=0.25, sync_time=0.1)["applied_compute"]
    b = 32
    rho = (2 * b / 2.0) / (b / (2 * 0.25 + 0.1))  # engines' samples/s over the trainer's
    assert (ac["B"], ac["C"], ac["q"]) == (b, 2 * b, 3)
    assert ac["rho"] == pytest.approx(rho) and ac["regime"] == "rollout-bound"
    tail = tail_multiplier(20, cfg.rollout.max_new_tokens, 8)
    assert ac["M_tail"] == pytest.approx(tail) and tail > 1
    assert ac["uncapped_batches"] == pytest.approx(2 * tail + rho)
    slow = closed_forms(cfg, gen_time=0.1, train_time=0.25, sync_time=0.1)["applied_compute"]
    r = slow["rho"]
    assert slow["regime"] == "train-bound"
    assert slow["uncapped_batches"] == pytest.approx(2 * tail / r + (2 * 3 + r - 1) / (2 * r))
    assert slow["mean_staleness_batches"] == min(slow["uncapped_batches"], 4)


@pytest.mark.parametrize("rule, train_time", [
    ("async.sync_when_idle=true", 3.0),
    ("async.sync_when_idle=true async.max_inflight=1", 0.1),  # an idle sync at every completion
    ("async.sync_when_idle=true async.max_inflight=1", 3.0),  # a launch a step: the queue never fills
    ("async.inflight_update=keep", 0.1),
    ("async.inflight_update=keep", 3.0),
    ("async.inflight_update=keep async.max_inflight=1", 3.0),
])
def test_idle_and_eager_forms_hold_away_from_balance(rule, train_time):
    cfg = load_config(None, ["async.max_staleness=4", "rollout.num_workers=2", "async.max_inflight=4",
                             "plan.gen_time=1", f"plan.train_time={train_time}", "train.num_batches=120",
                             *rule.split()])
    form = closed_forms(cfg, gen_time=1, train_time=train_time, sync_time=0)
    assert not form["exact"] and form["withheld"]["tether"] is None
    assert form["mean_staleness_batches"] == pytest.approx(planned(cfg)["summary"]["mean_staleness_batches"],
                                                           abs=0.3)


def test_rollout_bound_idle_syncs_publish_as_each_batch_completes():
    """Generation the slower side: the engines are busy at every step's end, so an idle sync fires
    when the batch the trainer waits for completes. With one generation at a time every batch
    after the first trains one batch stale and the step is the generation's time, not the
    generation's plus a training step every other batch as under the lazy rule."""
    base = ["async.max_staleness=1", "async.max_inflight=1", "plan.gen_time=1", "plan.train_time=0.6",
            "train.num_batches=40"]
    idle = planned(load_config(None, [*base, "async.sync_when_idle=true"]))
    lazy = planned(load_config(None, base))
    assert [b["staleness_updates"] for b in idle["batches"]] == [0] + [1] * 39
    assert [b["staleness_updates"] for b in lazy["batches"]] == [0, 1] * 20
    per_batch = idle["summary"]["mean_step_time_s"]
    assert per_batch == pytest.approx(1.0, abs=0.05)
    assert lazy["summary"]["mean_step_time_s"] == pytest.approx((2 * 1 + 0.6) / 2, abs=0.05)
    # with several generations in flight the engines fall idle together only by the timings' leave
    several = load_config(None, ["async.max_staleness=4", "async.max_inflight=4", "rollout.num_workers=2",
                                 "plan.gen_time=1", "plan.train_time=0.1", "train.num_batches=120",
                                 "async.sync_when_idle=true"])
    form = closed_forms(several, gen_time=1, train_time=0.1, sync_time=0)
    assert "async.max_inflight = 4" in form["withheld"]["tether"]
    assert planned(several)["summary"]["mean_staleness_batches"] > form["mean_staleness_batches"] + 0.3


def test_plan_prints_the_closed_forms_beside_the_simulation(capsys):
    assert main(["plan", "--max-staleness", "3", "--workers", "2", "--max-inflight", "4", "--gen-time", "1",
                 "--train-time", "0.2", "--num-batches", "40", "--closed-form"]) == 0
    out = capsys.readouterr().out
    assert "mean staleness (batches): simulated 1.50" in out
    assert "closed form (lazy publication rule: exact): 1.50" in out
    # the queueing form would say 2.40: the lazy rule is outside what it models, so it is not printed
    assert ("Applied Compute's rollout-bound form [rho=0.40, B=32, C=64, q=2, M_tail=1.00]: not printed: "
            "the forms model engines that take up every update") in out
    assert main(["plan", "--max-staleness", "3", "--workers", "2", "--max-inflight", "4", "--gen-time", "1",
                 "--train-time", "0.2", "--num-batches", "40", "--closed-form",
                 "async.inflight_update=keep"]) == 0
    out = capsys.readouterr().out
    assert "closed form (a publication every step: approximate): 2.40" in out
    assert "Applied Compute's rollout-bound form [rho=0.40, B=32, C=64, q=2, M_tail=1.00]: 2.40" in out


@pytest.mark.parametrize("keys, ours, theirs", [
    # near balance neither approximate form is printed, whichever rule
    (["async.inflight_update=keep", "plan.train_time=0.5"], "rho = 1.00 is near balance",
     "rho = 1.00 is near balance"),
    (["async.sync_when_idle=true", "plan.train_time=0.45"], "rho = 0.90 is near balance",
     "rho = 0.90 is near balance"),
    # train-bound, Tether's form is S; the queueing form does not know the budget
    (["async.inflight_update=keep", "plan.train_time=2"], None, "async.max_staleness = 3"),
    # rollout-bound idle syncs fire when every generation in flight has finished: with several,
    # by the timings' leave; with one at a time, at every completion (neither queueing form)
    (["async.sync_when_idle=true", "plan.train_time=0.1"], "async.max_inflight = 4",
     "async.max_inflight = 4"),
    (["async.sync_when_idle=true", "async.max_inflight=1", "plan.train_time=0.1"], None,
     "one generation at a time"),
    # the lazy rule's form needs no timings; the others do
    (["plan.gen_time=0"], None, "plan.gen_time"),
    (["async.inflight_update=keep", "plan.gen_time=0"], "plan.gen_time", "plan.gen_time"),
])
def test_a_form_outside_its_assumptions_names_why_instead_of_a_number(keys, ours, theirs):
    from tether.cli.plan import closed_form_lines

    cfg = load_config(None, ["async.max_staleness=3", "rollout.num_workers=2", "async.max_inflight=4",
                             "plan.gen_time=1", "plan.train_time=0.2", "train.num_batches=40", *keys])
    form = closed_forms(cfg, gen_time=cfg.plan.gen_time, train_time=cfg.plan.train_time, sync_time=0)
    assert (form["withheld"]["tether"] is None) == (ours is None)
    if ours:
        assert ours in form["withheld"]["tether"]
    assert theirs in form["withheld"]["applied_compute"]
    ours_line, theirs_line = closed_form_lines(form, 0.0)[1:]
    assert ("not printed" in ours_line) == (ours is not None) and "not printed" in theirs_line
    assert "rho=" in theirs_line  # the five parameters are printed either way


def test_kv_versions_are_the_turns_prefill_under_keep_and_the_tokens_own_otherwise():
    import torch

    from tether.control.inflight import MODES, cache_metrics, cache_versions
    from tether.train.attribution import cache_versions as cache_versions_of

    row = [3, 3, 4, 5, -1, -1, 5, 6, 6, -1]  # a turn switched twice, an observation, a turn switched once
    assert cache_versions(row, MODES["keep"]) == [3, 3, 3, 3, -1, -1, 5, 5, 5, -1]
    for name in ("drain", "recompute", "abort"):
        assert cache_versions(row, MODES[name]) == row
    m = cache_metrics([row, [7, 7]], MODES["keep"])
    assert m["staleness/kv_mixed_token_frac"] == pytest.approx(4 / 9)
    assert m["staleness/kv_lag_updates_mean"] == pytest.approx((1 + 2 + 1 + 1) / 4)
    assert cache_metrics([row], MODES["recompute"])["staleness/kv_mixed_token_frac"] == 0
    versions = torch.tensor([row, [7, 7, 8, 0, 0, 0, 0, 0, 0, 0]])
    mask = versions >= 0
    mask[1, 3:] = False
    kv = cache_versions_of(versions, mask)
    assert kv[0][mask[0]].tolist() == [3, 3, 3, 3, 5, 5, 5] and kv[1][mask[1]].tolist() == [7, 7, 7]
