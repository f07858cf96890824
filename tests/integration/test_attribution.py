"""``metrics.attribution``: each token's log π_old/μ split into staleness (log π_old/π_v) and
numerics (log π_v/μ), with real engine samples and a real learner."""

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_learner import sampled_batch  # noqa: E402

from configs import config  # noqa: E402
from tether.families.text.batch import to_train_batch, token_logprobs  # noqa: E402
from tether.modeling import load_causal_lm  # noqa: E402
from tether.train.learner import TorchLearner  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_on_policy_the_staleness_part_is_zero_and_the_numeric_part_is_the_mismatch(tiny_model_dir):
    batch, _tok = sampled_batch(tiny_model_dir, seed=0)
    learner = TorchLearner(tiny_model_dir, config("metrics.attribution=true", "async.max_staleness=0",
                                                  lr=1e-3))
    m = learner.train(batch, train_version=0).metrics
    assert m["attribution/token_frac"] == 1.0
    assert m["attribution/staleness_logratio_abs_max"] == 0.0
    assert m["attribution/staleness_share"] == 0.0
    assert m["attribution/numeric_logratio_abs_mean"] == pytest.approx(m["mismatch/logprob_abs_diff_mean"],
                                                                      rel=1e-5, abs=1e-9)
    assert m["attribution/numeric_logratio_abs_max"] == pytest.approx(m["mismatch/logprob_abs_diff_max"],
                                                                     rel=1e-5, abs=1e-9)
    assert m["attribution/numeric_logratio_abs_max"] < 1e-4  # the engine computes what the learner does
    assert m["attribution/versions_kept"] == 1.0 and m["attribution/memory_mb"] > 0


def test_a_stale_batch_splits_into_what_the_updates_changed_and_the_engine_numerics(tiny_model_dir):
    """A batch sampled at v0 trains after two updates: its staleness part is the learner's change
    since v0, computed here independently (the v0 model's and the trained model's forwards), the
    numeric part the engine's tiny difference from v0, and the two add up to the total."""
    stale, tok = sampled_batch(tiny_model_dir, seed=0)
    fresh = [sampled_batch(tiny_model_dir, seed=s)[0] for s in (1, 2)]
    learner = TorchLearner(tiny_model_dir, config("metrics.attribution=true", "async.max_staleness=2",
                                                  lr=3e-3))
    for v, b in enumerate(fresh):  # versions 0 → 2 (the batches' own tokens stamped v0 as well)
        payload = dataclasses.replace(b.payload, versions=[[v] * len(x) for x in b.payload.versions])
        learner.train(dataclasses.replace(b, payload=payload, behavior_version=v), train_version=v)
    assert learner.attribution is not None and sorted(learner.attribution.copies) == [0, 1]
    tb = to_train_batch(stale.payload, tok.pad_token_id)
    with torch.no_grad():
        now = token_logprobs(learner.model, tb, 1.0)[0]
        v0 = token_logprobs(load_causal_lm(tiny_model_dir)[0].eval(), tb, 1.0)[0]
    m = learner.train(stale, train_version=2).metrics
    mask = tb.mask.bool()
    expected_stale = (now - v0)[mask].abs()
    expected_numeric = (v0 - tb.behavior_logp)[mask].abs()
    assert m["attribution/token_frac"] == 1.0
    assert m["attribution/staleness_logratio_abs_mean"] == pytest.approx(float(expected_stale.mean()),
                                                                        rel=1e-4)
    assert m["attribution/staleness_logratio_abs_max"] == pytest.approx(float(expected_stale.max()), rel=1e-4)
    assert m["attribution/numeric_logratio_abs_max"] == pytest.approx(float(expected_numeric.max()), abs=1e-5)
    assert m["attribution/staleness_logratio_abs_mean"] > 100 * m["attribution/numeric_logratio_abs_mean"]
    assert m["attribution/residual_abs_max"] < 1e-6  # staleness + numerics = the total, to float precision
    assert 0.99 < m["attribution/staleness_share"] <= 1.0
    total = m["attribution/total_logratio_abs_mean"]
    assert total == pytest.approx(m["mismatch/logprob_abs_diff_mean"], rel=1e-5)
    # version 0 is now out of the budget's reach (train version 2, budget 2 keeps 0 … 2)
    assert sorted(learner.attribution.copies) == [0, 1, 2]
    learner.train(fresh[0], train_version=3)
    assert sorted(learner.attribution.copies) == [1, 2, 3]


def test_tokens_of_a_version_the_learner_never_held_are_left_out_and_counted(tiny_model_dir):
    batch, _tok = sampled_batch(tiny_model_dir, seed=0)
    learner = TorchLearner(tiny_model_dir, config("metrics.attribution=true", "async.max_staleness=4",
                                                  lr=1e-3))
    learner.train(batch, train_version=0)
    m = learner.train(batch, train_version=5).metrics  # v0 is out of reach, as after a resume
    assert m["attribution/token_frac"] == 0.0
    assert "attribution/staleness_logratio_abs_mean" not in m
