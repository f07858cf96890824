"""A reward as a Python function, handed straight to ``tether.train`` (docs/api.md).

    python examples/api/reward_function.py model.path=runs/models/demo-small

The command line's ``section.key=value`` words are overrides of the recipe below. No
``if __name__ == "__main__":`` is needed: Tether's worker processes import this file to find
``partial_credit`` and stop at the ``tether.train`` call.
"""

import sys

import tether


def partial_credit(prompt: str, completion: str, answer: str, fields: dict) -> float:
    """1 for the exact answer; otherwise the share of its characters in place, a little less for
    every character too many."""
    said = completion.strip()
    if said == answer:
        return 1.0
    right = sum(a == b for a, b in zip(said, answer, strict=False))
    return right / max(len(answer), 1) - 0.05 * max(len(said) - len(answer), 0)


recipe = {
    "data": {"task": "reverse", "difficulty": 3},  # reverse a short string of letters
    "rollout": {"batch_size": 4, "group_size": 4, "max_new_tokens": 8},
    "train": {"num_batches": 40, "lr": 1e-3},
}
summary = tether.train(recipe, sys.argv[1:], reward=partial_credit, run_dir="runs/api-reward")
print(f"trained {summary['trained_batches']} batches in {summary['wall_s']:.0f}s into {summary['run_dir']}")
