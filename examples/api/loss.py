"""A loss of your own, registered by name and chosen by ``train.loss`` (docs/api.md,
docs/training.md). The script registers it; ``tether.train`` makes the run's other processes
register it too (this file becomes one of the run's ``run.plugins``).

    python examples/api/loss.py model.path=runs/models/demo-small
"""

import sys

import torch

import tether


@tether.register_loss("clipped_reinforce")
def clipped_reinforce(x, s):
    """REINFORCE with the importance ratio clipped and detached: −clip(ρ)·A·log π_θ per token."""
    ratio = torch.exp(x.logp - x.anchor_logp).detach().clamp(1 - s.clip_low, 1 + s.clip_high)
    loss = -ratio * x.advantages[:, None] * x.logp  # (N, T): per token, unreduced
    return loss, {"ratio/mean": (ratio * x.mask).sum() / x.mask.sum().clamp(min=1)}


def partial_credit(prompt, completion, answer, fields):
    said = completion.strip()
    return sum(a == b for a, b in zip(said, answer, strict=False)) / max(len(answer), 1) - 0.05 * len(said)


recipe = {
    "data": {"task": "reverse", "difficulty": 3},
    "rollout": {"batch_size": 4, "group_size": 4, "max_new_tokens": 8},
    "train": {"num_batches": 40, "lr": 1e-3, "loss": "clipped_reinforce"},
}
summary = tether.train(recipe, sys.argv[1:], reward=partial_credit, run_dir="runs/api-loss")
print(f"trained {summary['trained_batches']} batches in {summary['wall_s']:.0f}s into {summary['run_dir']}")
