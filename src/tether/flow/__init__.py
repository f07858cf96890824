"""The second model family: flow-matching image generators trained with Flow-GRPO (issue 17).

Built so far: the sampler's mathematics (``tether.flow.sde``). Not yet: the model, the rewards,
the family seam in the loop, the learner's per-step objective (docs/flow.md is to come).
"""
