"""DAPO's dynamic sampling in a real worker's engine and reward, in process: what a batch holds,
where its extra prompts come from, and what happens when the draws run out."""

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from configs import pool_settings
from tether.data.stream import PromptStream
from tether.data.tasks import get_task
from tether.rollout.dynamic import DynamicSampling, ShortBatchError, informative
from tether.rollout.settings import WorkerSpec
from tether.rollout.worker import Rollout
from tether.vocabulary import SamplingParams, WorkItem

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
SPARSE = Path(__file__).parent / "sparse_reward.py"
EXAMPLES = get_task("reverse").examples("train", 200, difficulty=3)
B, G = 4, 3


@pytest.fixture(scope="module")
def rollout(tiny_model_dir):
    return Rollout(WorkerSpec(0, pool_settings(tiny_model_dir, f"reward.function={SPARSE}:reward")))


def item(index, dynamic):
    main = PromptStream(EXAMPLES, B, seed=0)
    extra = PromptStream(EXAMPLES, dynamic.extra_per_batch(B) if dynamic else 1, seed=0, name="extra")
    return WorkItem(batch_index=index, version=0, examples=main.batch(index), group_size=G,
                    params=SamplingParams(max_new_tokens=4), seed=index, dynamic=dynamic,
                    extra_examples=[(-1 - p, ex) for p, ex in extra.batch(index)] if dynamic else [])


def groups(batch):
    return [batch.rewards[i * G:(i + 1) * G] for i in range(batch.num_groups)]


def test_a_batch_holds_batch_size_informative_groups_drawn_in_order(rollout):
    plain = rollout.generate(item(1, None))
    assert not all(informative(g) for g in groups(plain))  # about half the prompts score 0 always
    batch = rollout.generate(item(1, DynamicSampling(max_draws=3)))
    batch.check()
    assert batch.num_groups == B and all(informative(g) for g in groups(batch))
    # the batch's own prompts first (those that were informative), then its extra slice in order
    own = [p for p, g in zip(plain.positions, groups(plain), strict=True) if informative(g)]
    assert batch.positions[:len(own)] == own
    extras = [p for p in batch.positions if p < 0]
    assert extras == sorted(extras, reverse=True) and len(extras) == B - len(own)
    m = batch.metrics
    assert m["rollout/prompts_drawn"] >= B + len(extras)
    assert m["rollout/filtered_groups"] >= B - len(own) and m["rollout/short_groups"] == 0
    # the same item gives the same batch: nothing depends on timing or on other batches
    again = rollout.generate(item(1, DynamicSampling(max_draws=3)))
    assert (again.positions, again.rewards) == (batch.positions, batch.rewards)


def test_when_the_draws_run_out_the_run_fails_or_trains_on_what_it_found(rollout):
    # two draws of batch_size prompts cannot find four informative groups for every batch index
    for index in range(40):
        try:
            rollout.generate(item(index, DynamicSampling(max_draws=2)))
        except ShortBatchError as exc:
            assert f"in batch {index} after drawing" in str(exc)
            assert "rollout.dynamic_sampling_on_short=partial" in str(exc)
            break
    else:
        pytest.fail("no batch ran short in 40 tries")
    partial = rollout.generate(item(index, DynamicSampling(max_draws=2, on_short="partial")))
    partial.check()
    assert partial.num_groups == B
    short = int(partial.metrics["rollout/short_groups"])
    assert short > 0 and sum(not informative(g) for g in groups(partial)) == short
    assert partial.metrics["rollout/prompts_drawn"] == 2 * B  # every prompt of its slice was tried
