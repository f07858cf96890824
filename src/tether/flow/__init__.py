"""The second policy family: flow-matching image generators trained with Flow-GRPO (issue 17;
docs/flow.md).

- ``sde``: the sampling ODE as an SDE with the same marginals; each step a Gaussian policy;
- ``policy``: trajectories and the per-step log-probabilities, means and closed-form KL;
- ``model``: a tiny conditional DiT and its model directory;
- ``scenes`` / ``task``: the built-in ``shapes`` task (prompts, drawn images, a pixel verifier)
  and image rewards;
- ``warmstart``: flow matching on drawn images until the model is sometimes right;
- ``rollout``: the engine and the worker's sampler, and the ``FlowBatch`` payload;
- ``learn``: the learner's side (``FlowPolicy``: a column is a denoising step);
- ``evaluate``: held-out reward and pass rate, and the image grids ``tether report`` shows.
"""
