"""Micro-batches packed by a token budget (``tether.train.packing``) on hand-computed lengths, and
the recipe rules of ``train.max_tokens_per_micro_batch``."""

import random

import pytest

torch = pytest.importorskip("torch")

from tether.config import load_config  # noqa: E402
from tether.errors import ConfigError  # noqa: E402
from tether.families.text.batch import TrainBatch  # noqa: E402
from tether.train.packing import Unit, by_tokens, lengths_of, pack, padding, units  # noqa: E402


def test_rows_alone_pack_longest_first_with_each_grid_within_the_budget():
    lengths = [10, 9, 3, 3, 2, 8]
    # longest first, each into the first micro-batch whose rows × longest row stays ≤ 20:
    # 10 | 10+9 (2×10) | 8 new | 3 → with 8 (2×8) | 3 new (3×8 = 24 > 20) | 2 → with the last 3
    parts = pack(units(range(6), lengths, 20), 20, padded=True)
    assert parts == [[0, 1], [2, 5], [3, 4]]


def test_a_row_over_the_budget_gets_a_micro_batch_of_its_own():
    assert pack(units(range(3), [30, 2, 2], 20), 20, padded=True) == [[0], [1, 2]]


def test_prompt_groups_stay_together_counting_their_prompt_once_and_are_cut_to_fit():
    # group 0: rows 0-3, prompt 5, completions 2 3 4 1; group 1: rows 4-5, prompt 2, completions 1 1
    lengths, prompts, groups = [7, 8, 9, 6, 3, 3], [5, 5, 5, 5, 2, 2], [0, 0, 0, 0, 1, 1]
    made = units(range(6), lengths, 14, prompts=prompts, groups=groups)
    # 5 + 2 + 3 + 4 = 14 fits; row 3 starts a new run of its group (5 + 1); group 1 is 2 + 1 + 1
    assert made == [Unit((0, 1, 2), 14, 9), Unit((3,), 6, 6), Unit((4, 5), 4, 3)]
    assert pack(made, 14, padded=False) == [[0, 1, 2], [3, 4, 5]]
    # a larger budget keeps the whole group in one unit
    assert units(range(6), lengths, 20, prompts=prompts, groups=groups)[0] == Unit((0, 1, 2, 3), 15, 9)


@pytest.mark.parametrize("padded", [True, False])
def test_every_row_is_in_exactly_one_micro_batch_within_the_budget(padded):
    rng = random.Random(0)
    for _ in range(200):
        n, budget = rng.randint(1, 40), rng.randint(8, 64)
        lengths = [min(budget, max(1, int(rng.expovariate(1 / 8)))) for _ in range(n)]
        rows = sorted(rng.sample(range(60), n))  # any global indices, ascending
        by_row = dict(zip(rows, lengths, strict=True))
        index = [by_row.get(r, 0) for r in range(60)]
        parts = pack(units(rows, index, budget), budget, padded=padded)
        assert sorted(r for p in parts for r in p) == rows
        for part in parts:
            assert part == sorted(part)
            cost = len(part) * max(index[r] for r in part) if padded else sum(index[r] for r in part)
            assert cost <= budget
        # first fit: no two micro-batches could have been one
        if padded:
            merged = [len(a + b) * max(index[r] for r in a + b) for a in parts for b in parts if a is not b]
            assert all(c > budget for c in merged)


def batch(rows):
    """A TrainBatch of right-padded rows given as (prompt length, completion length)."""
    width = max(p + c for p, c in rows)
    n = len(rows)
    attn = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width - 1)
    for i, (p, c) in enumerate(rows):
        attn[i, : p + c] = 1
        mask[i, p - 1: p + c - 1] = 1
    ids = torch.ones(n, width, dtype=torch.long)
    return TrainBatch(ids, attn, ids[:, 1:], mask, torch.zeros(n, width - 1), torch.zeros(n), 2,
                      torch.zeros(n, width - 1, dtype=torch.long), torch.zeros(n, dtype=torch.bool))


def test_lengths_padding_and_the_packing_of_a_train_batch():
    tb = batch([(3, 4), (3, 1), (2, 0), (2, 2)])  # a row of prompt only: its prompt is the whole row
    lengths, prompts = lengths_of(tb)
    assert lengths.tolist() == [7, 4, 2, 4] and prompts.tolist() == [3, 3, 2, 2]
    rows, groups = torch.tensor([0, 1, 2, 3]), torch.tensor([0, 0, 1, 1])
    # the model's own forward: rows × longest row; 3 × 4 = 12 > 8, and 2 × 7 > 12
    assert [p.tolist() for p in by_tokens(tb, rows, 8, shared=False, groups=groups)] == [[0], [1, 3], [2]]
    assert [p.tolist() for p in by_tokens(tb, rows, 12, shared=False, groups=groups)] == [[0], [1, 2, 3]]
    # shared prompts: group 0 is 3 + 4 + 1 = 8 tokens, group 1 is 2 + 0 + 2 = 4
    assert [p.tolist() for p in by_tokens(tb, rows, 12, shared=True, groups=groups)] == [[0, 1, 2, 3]]
    # real 7 + 4 + 2 + 4 = 17 tokens; grids 1 × 7 and 3 × 4 = 19 positions; the whole batch 4 × 7
    empty = torch.tensor([], dtype=torch.long)  # a rank's stand-in
    assert padding(tb, [torch.tensor([0]), torch.tensor([1, 2, 3]), empty]) == (17, 19)
    assert padding(tb, [rows]) == (17, 28)


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.max_tokens_per_micro_batch=100"],
     "train.max_tokens_per_micro_batch=100 is smaller than the longest sequence a run can produce: "
     "data.max_prompt_tokens=128 + rollout.max_new_tokens=32 = 160 tokens; raise it to at least 160, or "
     "lower data.max_prompt_tokens or rollout.max_new_tokens"),
    (["train.max_tokens_per_micro_batch=512", "train.micro_batch_size=4"],
     "are both set: micro-batches are made by tokens or by a count of sequences; "
     "set train.micro_batch_size=0"),
    (["model.family=agent", "data.task=kv_lookup", "train.max_tokens_per_micro_batch=512"],
     "needs a bound on a sequence's length, which model.family=agent takes from env.max_episode_tokens; "
     "set env.max_episode_tokens to at most 512"),
    (["model.family=agent", "data.task=kv_lookup", "env.max_episode_tokens=600",
      "train.max_tokens_per_micro_batch=512"], "env.max_episode_tokens=600 = 600 tokens"),
    (["model.family=flow", "data.task=shapes", "train.max_tokens_per_micro_batch=512"],
     "train.max_tokens_per_micro_batch=512 asks for micro-batches packed by tokens, which model.family=flow "
     "does not have"),
])
def test_a_token_budget_that_cannot_hold_a_sequence_is_refused_at_load(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)


def test_a_token_budget_that_holds_the_longest_sequence_is_accepted():
    assert load_config(None, ["train.max_tokens_per_micro_batch=160"]).train.max_tokens_per_micro_batch == 160
    cfg = load_config(None, ["model.family=agent", "data.task=kv_lookup", "env.max_episode_tokens=512",
                             "train.max_tokens_per_micro_batch=512"])
    assert cfg.train.max_tokens_per_micro_batch == 512
