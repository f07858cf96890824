"""The in-run staleness study: per-staleness figures, the grouped comparison and the reward trend
computed as the statistics say (against hand-made rows whose answers are known)."""

import math

from tether.runtime.study import staleness_study, summary_lines, trend


def rows(n, s, clip_of, reward_of):
    """Metrics rows of a run at budget S: batch i is (i − 1) mod (S + 1) batches stale."""
    out = []
    for step in range(1, n + 1):
        stale = (step - 1) % (s + 1)
        out.append({"step": step, "staleness/batches": float(stale), "ratio/clip_frac_low": 0.0,
                    "ratio/clip_frac_high": clip_of(step, stale), "ratio/std": 0.01 * stale,
                    "ratio/is_weight_std": float("nan"), "reward/mean": reward_of(step)})
    return out


def test_the_trend_is_least_squares_with_its_standard_error():
    xs = [1.0, 2.0, 3.0, 4.0, 5.0]
    ys = [1.1, 1.9, 3.2, 3.9, 5.1]
    got = trend(xs, ys)
    # by hand: slope = Σ(x−x̄)(y−ȳ)/Σ(x−x̄)² = 10/10; the residuals about 3.04 + (x − 3) square
    # to 0.072, so se = √(0.072 / (n − 2) / Σ(x−x̄)²)
    assert math.isclose(got["slope"], 1.0)
    assert math.isclose(got["se"], math.sqrt(0.072 / 3 / 10), rel_tol=1e-9)
    assert math.isclose(got["t"], 1.0 / got["se"])
    assert trend([1.0, 2.0], [0.0, 1.0]) == {"n": 2}  # too few points for a spread


def test_a_run_with_a_deep_budget_is_its_own_staleness_sweep():
    metrics = rows(48, 3, clip_of=lambda step, stale: 0.01 * stale + (0.002 if (step - 1) // 4 % 2 else 0.0),
                   reward_of=lambda step: 0.2 + 0.001 * step)
    study = staleness_study(metrics)
    assert list(study["by_staleness"]) == ["0", "1", "2", "3"]
    for level, row in study["by_staleness"].items():
        assert row["batches"] == 12
        assert math.isclose(row["clip_frac"]["mean"], 0.01 * float(level) + 0.001, abs_tol=1e-12)
        assert row["is_weight_std"] == {"n": 0}  # NaN rows are left out, not averaged in
    g = study["grouped"]
    assert g["median_staleness"] == 1.0
    assert g["clip_frac"]["low"]["n"] == 24 and g["clip_frac"]["high"]["n"] == 24
    assert math.isclose(g["clip_frac"]["difference"], 0.02, abs_tol=1e-12)
    assert g["clip_frac"]["t"] > 10
    r = study["reward_trend"]
    assert math.isclose(r["slope"], 0.001, rel_tol=1e-9) and r["se"] < 1e-12 and r["n"] == 48
    assert any("t =" in line for line in summary_lines(study))


def test_the_two_sided_p_value_is_students():
    from tether.runtime.study import two_sided_p

    assert math.isclose(two_sided_p(1.0, 1), 0.5, abs_tol=1e-12)  # Cauchy: P(|T| ≥ 1) = 1/2
    assert math.isclose(two_sided_p(0.0, 5), 1.0, abs_tol=1e-12)
    assert math.isclose(two_sided_p(2.228, 10), 0.05, abs_tol=2e-4)  # the tables' 5% point at df 10
    assert math.isclose(two_sided_p(2.0, 10), 0.07339, abs_tol=1e-4)
    assert math.isclose(two_sided_p(1.959964, 1e7), 0.05, abs_tol=1e-5)  # the normal limit
    assert two_sided_p(math.inf, 3) == 0.0


def test_the_seeds_grouping_leaves_the_middle_out_with_welchs_df():
    # S = 9: staleness 0 … 9 in turn; the seed compared ≤ 2 with ≥ 7
    metrics = rows(100, 9, clip_of=lambda step, stale: 0.01 * stale + 0.001 * (step % 3),
                   reward_of=lambda s: 0.5)
    study = staleness_study(metrics, low=2, high=7)
    g = study["grouped"]
    assert g["low_staleness"] == 2 and g["high_staleness"] == 7 and "median_staleness" not in g
    low = [r["ratio/clip_frac_high"] for r in metrics if r["staleness/batches"] <= 2]
    high = [r["ratio/clip_frac_high"] for r in metrics if r["staleness/batches"] >= 7]
    clip = g["clip_frac"]
    assert clip["low"]["n"] == len(low) == 30 and clip["high"]["n"] == len(high) == 30
    vl = sum((v - sum(low) / 30) ** 2 for v in low) / 29 / 30
    vh = sum((v - sum(high) / 30) ** 2 for v in high) / 29 / 30
    assert math.isclose(clip["df"], (vl + vh) ** 2 / (vl * vl / 29 + vh * vh / 29), rel_tol=1e-9)
    assert clip["p"] < 1e-10 and any("df =" in line and "≥ 7 vs ≤ 2" in line for line in summary_lines(study))
    import pytest

    from tether.errors import ConfigError

    with pytest.raises(ConfigError, match="high above low"):
        staleness_study(metrics, low=7, high=2)


def test_the_study_reports_the_seeds_clip_fraction_against_mu_and_the_weight_spread():
    """outside_clip_frac (|π_θ/μ − 1| > ε, the seed's and the reference's measure) and the
    π_old/μ spread, per staleness and grouped as the seed did, both in the printed summary."""
    metrics = rows(100, 9, clip_of=lambda step, stale: 0.0, reward_of=lambda s: 0.5)
    for m in metrics:
        stale = m["staleness/batches"]
        m["ratio/behavior_outside_clip_frac"] = 0.02 * stale + 0.001 * (m["step"] % 3)
        m["ratio/is_weight_std"] = 0.001 * stale + 0.0001 * (m["step"] % 2)
    study = staleness_study(metrics, low=2, high=7)
    assert math.isclose(study["by_staleness"]["9"]["outside_clip_frac"]["mean"], 0.18 + 0.001, abs_tol=1e-3)
    g = study["grouped"]["outside_clip_frac"]
    assert g["low"]["n"] == g["high"]["n"] == 30 and g["p"] < 1e-10
    lines = summary_lines(study)
    seeds = "outside the clip vs μ staleness ≥ 7 vs ≤ 2"
    assert any(line.startswith(seeds) and "p = " in line for line in lines)
    assert any(line.startswith("IS weight std staleness ≥ 7 vs ≤ 2") for line in lines)
    assert any(line.startswith("staleness 9:") and "IS weight std 9" in line for line in lines)
