"""Corrections on ρ = π_old/μ: truncated IS, masks, outliers, ESS and mismatch numbers."""

import math

import pytest

torch = pytest.importorskip("torch")

from tether.config.schema import CorrectionSection  # noqa: E402
from tether.train.corrections import correct  # noqa: E402

OLD = torch.tensor([[math.log(3.0), math.log(0.5)]])  # log π_old, with μ = 1 → ρ = [3, 0.5]
MU = torch.zeros(1, 2)
MASK = torch.ones(1, 2)


def flat(t):
    return [v for row in t.tolist() for v in row]


def run(**kw):
    return correct(OLD, MU, MASK, CorrectionSection(**kw), weigh=True)


def test_truncated_importance_weights():
    assert flat(run(tis="token", tis_cap=2.0).weights) == pytest.approx([2.0, 0.5])
    assert flat(run(tis="sequence", tis_cap=2.0).weights) == pytest.approx([1.5, 1.5])  # 3·0.5
    assert flat(run(tis="sequence", tis_cap=1.2).weights) == pytest.approx([1.2, 1.2])
    assert flat(run(tis="none").weights) == pytest.approx([3.0, 0.5])  # the full π_prox/μ
    unweighted = correct(OLD, MU, MASK, CorrectionSection(), weigh=False)
    assert unweighted.weights.tolist() == [[1.0, 1.0]]


def test_importance_weight_spread_and_tails_are_reported():
    m = run(tis="token", tis_cap=2.0).metrics  # weights [2, 0.5]
    assert m["ratio/is_weight_mean"] == pytest.approx(1.25)
    assert m["ratio/is_weight_std"] == pytest.approx(0.75)  # population std of [2, 0.5]
    assert (m["ratio/is_weight_min"], m["ratio/is_weight_max"]) == pytest.approx((0.5, 2.0))


def test_masks():
    assert run(mask="token").keep.tolist() == [[0.0, 1.0]]         # 3 > 2 dropped; 0.5 kept
    assert run(mask="sequence").keep.tolist() == [[1.0, 1.0]]      # product 1.5 in [0.5, 2]
    assert run(mask="geometric").keep.tolist() == [[1.0, 1.0]]     # sqrt(1.5) = 1.22
    assert run(mask="sequence", mask_high=1.4).keep.tolist() == [[0.0, 0.0]]
    assert run(outlier_token=2.5).keep.tolist() == [[0.0, 0.0]]    # ρ = 3 > 2.5 drops the sequence
    assert run(outlier_token=4.0).keep.tolist() == [[1.0, 1.0]]


def test_metrics():
    m = run(tis="token", tis_cap=2.0, mask="token").metrics
    assert m["ratio/is_weight_mean"] == pytest.approx(1.25)
    assert m["ratio/is_weight_max"] == pytest.approx(2.0)
    assert m["ratio/masked_frac"] == pytest.approx(0.5)
    # ESS of the effective weights [0 (masked), 0.5]: 0.25 / (2 · 0.25) = 0.5
    assert m["ratio/ess"] == pytest.approx(0.5)
    assert run(tis="token").metrics["ratio/ess"] == pytest.approx(2.5 ** 2 / (2 * 4.25))  # 0.735
    # |log ρ| = [1.0986, 0.6931]; k3 = ρ − 1 − log ρ = [0.9014, 0.1931]
    assert m["mismatch/logprob_abs_diff_mean"] == pytest.approx((math.log(3) + math.log(2)) / 2)
    assert m["mismatch/logprob_abs_diff_max"] == pytest.approx(math.log(3))
    assert m["mismatch/k3"] == pytest.approx((3 - 1 - math.log(3) + 0.5 - 1 + math.log(2)) / 2)


def test_tokens_off_the_mask_are_ignored():
    mask = torch.tensor([[1.0, 0.0]])
    c = correct(OLD, MU, mask, CorrectionSection(mask="token"), weigh=True)
    assert c.keep.tolist() == [[0.0, 0.0]]
    assert c.metrics["mismatch/logprob_abs_diff_max"] == pytest.approx(math.log(3))


def test_numeric_mismatch_counts_only_tokens_sampled_with_the_same_weights():
    old = torch.tensor([[0.0, -1.0, -2.0]])
    mu = torch.tensor([[1e-6, -1.5, -2.0]])  # token 0: numerics only; token 1: a stale token
    mask = torch.ones(1, 3)
    same = torch.tensor([[True, False, True]])
    m = correct(old, mu, mask, CorrectionSection(), weigh=True, same_weights=same).metrics
    assert m["mismatch/logprob_abs_diff_max"] == pytest.approx(0.5)  # staleness and numerics mixed
    assert m["mismatch/numeric_logprob_abs_diff_max"] == pytest.approx(1e-6)  # numerics alone
    assert m["mismatch/numeric_logprob_abs_diff_mean"] == pytest.approx(0.5e-6)
    assert m["mismatch/numeric_token_frac"] == pytest.approx(2 / 3)
    none = correct(old, mu, mask, CorrectionSection(), weigh=True,
                   same_weights=torch.zeros(1, 3, dtype=torch.bool)).metrics
    assert none["mismatch/numeric_token_frac"] == 0.0
    assert "mismatch/numeric_logprob_abs_diff_max" not in none  # undefined: the learner reports NaN
