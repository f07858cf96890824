"""The flow family's side of the learner: a ``FlowBatch`` as training tensors, and the per-step
log-probabilities, entropies and KL terms the shared loss code needs.

The learner (``tether.train.learner.TorchLearner``) is written against a *policy family*: token
columns for a language model, denoising steps here. Each step of a trajectory is one column of
the (N, T) tensors, so the advantages (one per sample, shared by all its steps), the PPO clip per
step, the anchors, the TIS/mask corrections, the aggregations and every ratio metric are the very
code language models train with. The KL to the reference model is the closed form for two
Gaussians of the same std (``tether.flow.policy.gaussian_kl``), not a sampled estimator.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from tether.errors import ConfigError
from tether.flow.model import FlowModel
from tether.flow.policy import gaussian_entropy, gaussian_kl, step_logprobs


@dataclass(frozen=True)
class FlowTrainBatch:
    """N = B·G trajectories of T steps."""

    latents: torch.Tensor  # (N, T + 1, C, H, W)
    words: torch.Tensor  # (N, L)
    times: torch.Tensor  # (T + 1,)
    mask: torch.Tensor  # (N, T) ones: every step is an action
    behavior_logp: torch.Tensor  # (N, T) the engine's log-probs
    rewards: torch.Tensor  # (N,)
    group_size: int
    behavior_versions: torch.Tensor  # (N, T)
    truncated: torch.Tensor  # (N,) bool, all False (a trajectory always has its T steps)
    noise_level: float

    @property
    def size(self) -> int:
        return self.latents.shape[0]

    def to(self, device: torch.device) -> FlowTrainBatch:
        if self.latents.device == device:
            return self
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor) and f.name != "times"}
        return dataclasses.replace(self, **moved)

    def rows(self, index: torch.Tensor | slice) -> FlowTrainBatch:
        return dataclasses.replace(
            self, latents=self.latents[index], words=self.words[index], mask=self.mask[index],
            behavior_logp=self.behavior_logp[index], rewards=self.rewards[index],
            behavior_versions=self.behavior_versions[index], truncated=self.truncated[index])


def to_flow_batch(payload) -> FlowTrainBatch:
    """Tensors of a ``tether.flow.rollout.FlowBatch``; refuses one without the engine's log-probs."""
    if payload.logprobs is None or not len(payload.logprobs):
        raise ConfigError("the rollout batch carries no engine log-probs, which the loss needs for its ratio "
                          "and corrections")
    logp = torch.tensor(payload.logprobs, dtype=torch.float32)  # a copy: Ray's arrays are read-only
    if not torch.isfinite(logp).all():
        raise ValueError("the engine's step log-probs contain non-finite values")
    n, steps = logp.shape
    return FlowTrainBatch(
        latents=torch.tensor(payload.latents, dtype=torch.float32),
        words=torch.tensor(payload.words, dtype=torch.long),
        times=torch.tensor(payload.times, dtype=torch.float32), mask=torch.ones(n, steps), behavior_logp=logp,
        rewards=torch.as_tensor(payload.rewards, dtype=torch.float32), group_size=payload.group_size,
        behavior_versions=torch.as_tensor(payload.versions, dtype=torch.long),
        truncated=torch.zeros(n, dtype=torch.bool), noise_level=payload.noise_level)


class FlowPolicy:
    """What the learner asks of the flow family."""

    name = "flow"

    def load(self, path: str | Path):
        """(model, tokenizer): the flow model has a fixed word vocabulary, no tokenizer to save."""
        return FlowModel.from_pretrained(path), None

    def batch(self, payload) -> FlowTrainBatch:
        return to_flow_batch(payload)

    def forward(self, model, batch: FlowTrainBatch, *, with_entropy: bool = False, forward=None):
        """(log-probs (n, T), entropies (n, T) or None, the KL's basis: each step's mean in units
        of its std, μ/σ (n, T, C, H, W))."""
        logp, means, stds = step_logprobs(model, batch.latents, batch.words, batch.times, batch.noise_level)
        entropy = gaussian_entropy(stds).to(logp.device).expand_as(logp) if with_entropy else None
        return logp, entropy, means / stds.to(means.device).view(1, -1, *[1] * (means.dim() - 2))

    def kl(self, basis: torch.Tensor, ref_basis: torch.Tensor, estimator: str) -> torch.Tensor:
        """Closed-form KL per step, (n, T): with both means in units of the shared σ,
        ‖μ_θ − μ_ref‖²/(2σ²) is half the squared distance (``estimator`` is for sampled token KLs;
        not used here)."""
        return gaussian_kl(basis, ref_basis, torch.ones(basis.shape[1]))

    def fast_forward(self, model, enabled: bool):
        return None
