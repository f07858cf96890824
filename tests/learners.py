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
