"""``tether plan --optimize``: candidates priced from one recipe's measured timings, ranked by
samples/s (or by staleness above a throughput floor), ties given to the recipe asking least."""

import itertools

import pytest

from tether.cli.main import main
from tether.config import load_config
from tether.errors import ConfigError
from tether.loop.optimize import candidates, priced, search

BASE = ["plan.gen_time=1.0", "plan.train_time=0.1", "plan.sync_time=0.01", "train.num_batches=40",
        "rollout.batch_size=4", "rollout.group_size=8", "train.threads=1"]


def test_rollout_bound_recipes_get_every_engine_the_cores_allow():
    best, ranked, given = search(None, BASE, cores=4, staleness_cap=2)
    chosen = dict(o.split("=") for o in best.overrides)
    assert chosen["rollout.num_workers"] == "3"  # 4 cores less the learner's thread
    assert best.samples_per_s > 2 * given.samples_per_s  # the recipe as given: one engine
    assert ranked[0] is best
    near = [c for c in ranked if c.samples_per_s >= 0.97 * max(r.samples_per_s for r in ranked)]
    assert ranked[:len(near)] == near  # the near-fastest first, by staleness, then by samples/s
    assert all(a.mean_staleness <= b.mean_staleness for a, b in itertools.pairwise(near))
    assert all(a.samples_per_s >= b.samples_per_s for a, b in itertools.pairwise(ranked[len(near) - 1:]))


def test_a_lead_within_the_tie_does_not_buy_staleness():
    # train-bound with a publication cost: idle syncs and deeper budgets gain a sliver of samples/s
    args = ["plan.gen_time=0.18", "plan.train_time=0.49", "plan.sync_time=0.002", "train.num_batches=80",
            "async.max_staleness=1", "async.max_inflight=2"]
    exact, ranked_exact, _ = search(None, args, cores=2, staleness_cap=3, tie=0.0)
    best, _, _ = search(None, args, cores=2, staleness_cap=3)
    assert best.samples_per_s >= (1 - 0.03) * exact.samples_per_s
    assert best.mean_staleness < exact.mean_staleness  # tie=0 took S=3 for a rounding-size lead
    assert all(best.mean_staleness <= c.mean_staleness for c in ranked_exact
               if c.samples_per_s >= (1 - 0.03) * exact.samples_per_s)
    with pytest.raises(ConfigError, match=r"--tie 1\.5"):
        search(None, args, cores=2, staleness_cap=3, tie=1.5)


def test_equal_outcomes_go_to_the_candidate_asking_least():
    # train-bound: more engines or staleness buy nothing once the trainer never waits
    best, ranked, _ = search(None, ["plan.gen_time=0.05", "plan.train_time=1.0", "train.num_batches=30"],
                             cores=4, staleness_cap=3)
    chosen = dict(o.split("=") for o in best.overrides)
    assert chosen["rollout.num_workers"] == "1" and best.equivalent > 0
    assert len({(round(c.samples_per_s, 3), round(c.mean_staleness, 3)) for c in ranked}) == len(ranked)


def test_a_throughput_floor_ranks_by_staleness():
    fastest, _, _ = search(None, BASE, cores=4, staleness_cap=3)
    floor = 0.8 * fastest.samples_per_s
    best, _, _ = search(None, BASE, cores=4, staleness_cap=3, min_samples_per_s=floor)
    assert best.samples_per_s >= floor and best.mean_staleness <= fastest.mean_staleness
    with pytest.raises(ConfigError, match="no candidate reaches"):
        search(None, BASE, cores=4, staleness_cap=3, min_samples_per_s=10 * fastest.samples_per_s)


def test_other_batch_shapes_are_priced_by_their_samples():
    base = load_config(None, BASE)
    double = load_config(None, [*BASE, "rollout.batch_size=8", "train.updates_per_batch=1"])
    p = priced(double, base).plan
    assert p.gen_time == pytest.approx(2.0) and p.train_time == pytest.approx(0.2)
    grid = candidates(base, cores=2, staleness_cap=1, vary_batch=True, vary_group=True)
    assert {o for c in grid for o in c if o.startswith("rollout.batch_size")} == {
        "rollout.batch_size=2", "rollout.batch_size=4", "rollout.batch_size=8"}
    assert all("async.inflight_update=drain" in c for c in grid if "async.max_staleness=0" in c)


def test_the_search_needs_measured_timings_and_a_core_for_an_engine():
    with pytest.raises(ConfigError, match=r"plan\.gen_time"):
        search(None, ["plan.gen_time=0"], cores=2, staleness_cap=1)
    with pytest.raises(ConfigError, match="--cores 1 leaves no core"):
        search(None, BASE, cores=1, staleness_cap=1)


def test_the_command_prints_the_recipe_as_given_the_choice_and_how_to_run_it(capsys):
    assert main(["plan", *BASE, "--optimize", "--cores", "3", "--staleness-cap", "2"]) == 0
    out = capsys.readouterr().out
    assert "as given:" in out and "chosen:" in out and "rollout.num_workers=2" in out
    assert out.strip().splitlines()[-1].startswith("run it: tether train async.max_staleness=")
