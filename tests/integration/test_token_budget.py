"""``train.max_tokens_per_micro_batch``: micro-batches packed by tokens make the update that a fixed
count of sequences makes, in every loss aggregation, on a real tiny model and real engine samples
cut to a long tail of lengths (a prefix of a sample is a sample, with the same log-probs).

Adam's first step moves every weight by about ±lr whatever its gradient's size, so float32
round-off in a gradient that is zero in exact arithmetic becomes a step of random sign; at lr 5e-5
that floor is below the 1e-5 relative difference asserted (tests/integration/test_sharded_learner.py
says more). Packing the rows wrongly (a micro-batch's log-probs put back on other rows, a
denominator counted per micro-batch) moves the weights by far more.
"""

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_learner import sampled_batch, with_lengths  # noqa: E402

from configs import config  # noqa: E402
from learners import worst_relative  # noqa: E402
from tether.families.text.batch import to_train_batch, token_logprobs  # noqa: E402
from tether.modeling import load_causal_lm  # noqa: E402
from tether.train import packing  # noqa: E402
from tether.train.learner import TorchLearner  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
LENGTHS = [6, 1, 3, 2, 5, 6, 1, 1, 2, 4, 6, 3, 1, 1, 2, 6]  # completion lengths: short ones, a few long
BOUNDS = ("data.max_prompt_tokens=9", "rollout.max_new_tokens=6")  # the longest row: 9 + 6 = 15 tokens
BUDGET = 30
METRICS = ("loss/policy", "loss/total", "loss/kl", "ratio/mean", "ratio/max", "mismatch/k3", "train/entropy")


@pytest.fixture(scope="module")
def batch(tiny_model_dir):
    return with_lengths(sampled_batch(tiny_model_dir, seed=3)[0], LENGTHS)


def trained(model_dir, batch, **keys):
    learner = TorchLearner(model_dir, config(*BOUNDS, lr=5e-5, grad_clip=0.0, **keys))
    result = learner.train(copy.deepcopy(batch), train_version=0)
    return {n: p.detach().clone() for n, p in learner.model.named_parameters()}, result


# With the shared-prompt forward a group costs its prompt once plus its completions: 16, 18, 23
# and 19 tokens here, so a budget of 40 packs groups 0 and 2, then 1 and 3.
@pytest.mark.parametrize("case", [
    {"aggregation": "token_mean", "updates_per_batch": 2, "shared_prefix": False},
    {"aggregation": "seq_mean_token_mean", "updates_per_batch": 1, "shared_prefix": True, "budget": 40},
    {"aggregation": "seq_mean_token_sum", "updates_per_batch": 1, "shared_prefix": False, "kl_coef": 0.05},
    {"aggregation": "seq_mean_token_sum_norm", "updates_per_batch": 1, "shared_prefix": True, "kl_coef": 0.05,
     "budget": 40},
], ids=["token_mean", "seq_mean_token_mean-shared", "seq_mean_token_sum-kl", "dr_grpo-shared-kl"])
def test_a_token_budget_makes_the_update_of_a_fixed_count(tiny_model_dir, batch, case):
    case = dict(case)
    budget = case.pop("budget", BUDGET)
    fixed_weights, fixed = trained(tiny_model_dir, batch, micro_batch_size=4, **case)
    packed_weights, packed = trained(tiny_model_dir, batch, max_tokens_per_micro_batch=budget, **case)
    worst = worst_relative(packed_weights, fixed_weights)
    moved = worst_relative({n: torch.zeros_like(w) for n, w in fixed_weights.items()}, fixed_weights)
    print(f"\n{case['aggregation']}: token budget vs fixed count, max relative parameter difference "
          f"{worst:.1e}; micro-batches per update {packed.metrics['train/micro_batches']:g} vs "
          f"{fixed.metrics['train/micro_batches']:g}, padding {packed.metrics['train/pad_frac']:.2f} vs "
          f"{fixed.metrics['train/pad_frac']:.2f}")
    assert worst <= 1e-5 and moved > 0
    assert packed.committed_updates == fixed.committed_updates == case["updates_per_batch"]
    for key in METRICS:
        assert packed.metrics[key] == pytest.approx(fixed.metrics[key], rel=1e-4, abs=1e-6), key
    assert packed.metrics["train/micro_batches"] >= 2  # the budget did split each mini-batch
    if not case["shared_prefix"]:  # rows of like lengths together: less padding in the grids
        assert packed.metrics["train/pad_frac"] < fixed.metrics["train/pad_frac"]


def test_the_budget_packs_rows_out_of_order_and_keeps_prompt_groups_together(tiny_model_dir, batch):
    """What the cases above go through: micro-batches that are not runs of adjacent rows, and with
    the shared-prompt forward whole prompt groups (cut only where one is over the budget)."""
    _, tok = load_causal_lm(tiny_model_dir)
    tb = to_train_batch(batch.payload, tok.pad_token_id)
    rows, groups = torch.arange(tb.size), torch.arange(tb.size) // tb.group_size
    lengths, _ = packing.lengths_of(tb)
    own = packing.by_tokens(tb, rows, BUDGET, shared=False, groups=groups)
    assert sorted(torch.cat(own).tolist()) == rows.tolist()
    assert any((part.diff() > 1).any() for part in own)  # rows of a micro-batch need not be adjacent
    assert all(len(part) * int(lengths[part].max()) <= BUDGET for part in own)
    shared = packing.by_tokens(tb, rows, BUDGET, shared=True, groups=groups)
    for g in range(4):  # each group is in one micro-batch, or cut in runs because it is over the budget
        holding = [part for part in shared if (groups[part] == g).any()]
        assert len(holding) == 1 or sum(int(lengths[r]) for r in rows[groups == g]) > BUDGET


def test_a_micro_batch_runs_to_its_own_longest_row(tiny_model_dir, batch):
    """The model's own forward drops the columns past a micro-batch's longest row: the same
    log-probs on every real column, 0 past it, from a narrower forward."""
    model, tok = load_causal_lm(tiny_model_dir)
    tb = to_train_batch(batch.payload, tok.pad_token_id)
    short = torch.tensor([1, 6, 7, 12])  # completions of one token
    widths = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kw: widths.append(kw["input_ids"].shape[1]),
                                           with_kwargs=True)
    with torch.no_grad():
        whole, _ = token_logprobs(model, tb, 1.0)
        part, _ = token_logprobs(model, tb.rows(short), 1.0)
    hook.remove()
    longest = int(tb.attention_mask[short].sum(1).max())
    assert widths == [tb.input_ids.shape[1], longest] and longest < widths[0]
    assert part.shape == whole[short].shape
    torch.testing.assert_close(part[:, : longest - 1], whole[short][:, : longest - 1], atol=1e-6, rtol=1e-5)
    assert (part[:, longest - 1:] == 0).all()
