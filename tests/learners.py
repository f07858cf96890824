"""A learner of one process against learner ranks on the same batches, for the tests that check
they train alike (whole weights, flow models, adapters)."""

from __future__ import annotations

from procs import wait_gone


def trained(learner, batches) -> tuple[dict, list]:
    """(the weights after training ``batches`` in order, each batch's result)."""
    results = [learner.train(b, train_version=2 * i) for i, b in enumerate(batches)]
    return dict(learner.export_weights()), results  # gathered now: ranks' exports are lazy


def solo_and_ranks(model_dir, solo_cfg, ranks_cfg, batches) -> tuple[tuple[dict, list], tuple[dict, list]]:
    """``trained`` by a ``TorchLearner`` of ``solo_cfg``, then by ``ranks_cfg``'s rank processes,
    which are closed and gone afterwards."""
    from tether.train.learner import TorchLearner
    from tether.train.ranks import ProcessRanks, RankGroup

    solo = trained(TorchLearner(model_dir, solo_cfg), batches)
    group = RankGroup(ProcessRanks(ranks_cfg, model_dir, None))
    try:
        pids = list(group.pids)
        ranked = trained(group, batches)
    finally:
        group.close()
    assert wait_gone(pids) == []
    return solo, ranked


def worst_relative(weights: dict, reference: dict) -> float:
    """The largest difference of any tensor from ``reference``'s, relative to its largest value."""
    return max(((weights[n] - w).abs().max() / w.abs().max().clamp(min=1e-12)).item()
               for n, w in reference.items())


def sampled_batch_of(engine, prompts: list[list[int]], params, group_size: int):
    """A rollout batch of ``group_size`` samples of each of ``prompts`` from ``engine`` (seed 0),
    rewarded 0, 1, 0, 1, … so every group has something to learn from."""
    from tether.families.text.payload import ScoredBatch
    from tether.vocabulary import RolloutBatch

    groups = engine.generate(prompts, samples_per_prompt=group_size, params=params, seed=0)
    flat = [c for g in groups for c in g]
    scored = ScoredBatch(positions=list(range(len(prompts))), prompt_ids=prompts,
                         completion_ids=[c.token_ids for c in flat], logprobs=[c.logprobs for c in flat],
                         versions=[c.versions for c in flat],
                         rewards=[float(i % 2) for i in range(len(flat))],
                         finish_reasons=[c.finish_reason for c in flat], completions=[""] * len(flat),
                         group_size=group_size)
    return RolloutBatch(index=0, behavior_version=0, num_groups=len(prompts), group_size=group_size,
                        payload=scored)
