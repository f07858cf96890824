"""The flow family's side of the learner: a ``FlowBatch`` as training tensors, and the per-step
log-probabilities, entropies and KL terms the shared loss code needs.

The learner (``tether.train.learner.TorchLearner``) is written against a family's *policy*: token
columns for the text family, denoising steps here. Each step of a trajectory is one column of
the (N, T) tensors, so the advantages (one per sample, shared by all its steps), the PPO clip per
step, the anchors, the TIS/mask corrections, the aggregations and every ratio metric are the very
code language models train with. The KL to the reference model is the closed form for two
Gaussians of the same std (``tether.families.flow.policy.gaussian_kl``), not a sampled estimator.

With ``flow.train_steps`` = K < T the learner trains K of each trajectory's T steps: the columns
are then those K steps, and an update costs K/T of the full one. ``flow.train_step_choice`` says
which: ``random`` draws them per trajectory (DDPO's way), seeded by the rollout batch's own seed so
every rank and every resumed run trains the same steps of the same batch; ``first`` trains steps
0 … K − 1 of every trajectory, as Flow-GRPO's reference does with ``timestep_fraction`` = K/T (at
its configs' 0.99 that leaves out the last, low-noise step).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from tether.errors import ConfigError, RolloutError
from tether.families.base import PolicyBase
from tether.families.flow import conditioning
from tether.families.flow.model import load_flow_model
from tether.families.flow.policy import gaussian_entropy, gaussian_kl, step_logprobs


@dataclass(frozen=True)
class FlowTrainBatch:
    """N = B·G trajectories of T steps."""

    latents: torch.Tensor  # (N, T + 1, C, H, W)
    cond: dict[str, torch.Tensor]  # each prompt's conditioning, B rows
    prompt_of: torch.Tensor  # (N,) each trajectory's row of cond
    times: torch.Tensor  # (T + 1,)
    steps: torch.Tensor  # (N, K) the trained steps of each trajectory (indices into 0 … T − 1)
    mask: torch.Tensor  # (N, K) ones: every step is an action
    behavior_logp: torch.Tensor  # (N, K) the engine's log-probs of those steps
    rewards: torch.Tensor  # (N,)
    group_size: int
    behavior_versions: torch.Tensor  # (N, K)
    truncated: torch.Tensor  # (N,) bool, all False (a trajectory always has its T steps)
    noise_level: float
    negative: dict[str, torch.Tensor] | None = None  # the unconditional prompt's (one row), when guided
    guidance_scale: float = 1.0
    sde_type: str = "sde"  # the steps' rule (``flow.sde_type``)
    episode: None = None  # a trajectory is one row (``Policy.batch``)

    @property
    def size(self) -> int:
        return self.latents.shape[0]

    def to(self, device: torch.device) -> FlowTrainBatch:
        if self.latents.device == device:
            return self
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor) and f.name != "times"}
        moved["cond"] = conditioning.to(self.cond, device)
        if self.negative is not None:
            moved["negative"] = conditioning.to(self.negative, device)
        return dataclasses.replace(self, **moved)

    def sample_cond(self) -> dict[str, torch.Tensor]:
        """Each trajectory's conditioning, (N, …) rows."""
        return conditioning.rows(self.cond, self.prompt_of)

    def rows(self, index: torch.Tensor | slice) -> FlowTrainBatch:
        return dataclasses.replace(
            self, latents=self.latents[index], prompt_of=self.prompt_of[index], steps=self.steps[index],
            mask=self.mask[index],
            behavior_logp=self.behavior_logp[index], rewards=self.rewards[index],
            behavior_versions=self.behavior_versions[index], truncated=self.truncated[index])


def trained_steps(n: int, steps: int, k: int, seed: int, choice: str = "random") -> torch.Tensor:
    """(n, k) step indices, sorted: with ``choice`` random, drawn without replacement per
    trajectory from ``steps`` (the same for the same ``seed``); with ``first``, steps 0 … k − 1 of
    every trajectory (the reference's ``timestep_fraction``). All of them, in order, when ``k`` is
    0 or ``steps``."""
    if k <= 0 or k >= steps:
        return torch.arange(steps).expand(n, -1).clone()
    if choice == "first":
        return torch.arange(k).expand(n, -1).clone()
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(n, steps, generator=generator).argsort(1)[:, :k].sort(1).values


def to_flow_batch(payload, train_steps: int = 0, choice: str = "random") -> FlowTrainBatch:
    """Tensors of a ``tether.families.flow.rollout.FlowBatch``, with ``train_steps`` of each trajectory's
    steps (0: all; which ones: ``choice``); refuses one without the engine's log-probs."""
    if payload.logprobs is None or not len(payload.logprobs):
        raise ConfigError("the rollout batch carries no engine log-probs, which the loss needs for its ratio "
                          "and corrections")
    logp = torch.tensor(payload.logprobs, dtype=torch.float32)  # a copy: Ray's arrays are read-only
    if not torch.isfinite(logp).all():
        times = ", ".join(f"{float(t):.4g}" for t in payload.times)
        raise RolloutError(f"the engine's step log-probs contain non-finite values (flow.noise_level="
                           f"{payload.noise_level:g}, flow.guidance_scale={payload.guidance_scale:g}, times "
                           f"{times}: flow.shift and flow.steps set them); lower flow.noise_level or "
                           "flow.guidance_scale, or bring flow.shift nearer 1 (docs/flow.md, \"Bounds\")")
    n, steps = logp.shape
    chosen = trained_steps(n, steps, train_steps, payload.seed, choice)
    return FlowTrainBatch(
        latents=torch.tensor(payload.latents, dtype=torch.float32),
        cond=conditioning.as_tensors(payload.cond),
        prompt_of=torch.arange(payload.num_groups).repeat_interleave(payload.group_size),
        times=torch.tensor(payload.times, dtype=torch.float32), steps=chosen,
        mask=torch.ones(chosen.shape), behavior_logp=logp.gather(1, chosen),
        rewards=torch.as_tensor(payload.rewards, dtype=torch.float32), group_size=payload.group_size,
        behavior_versions=torch.as_tensor(payload.versions, dtype=torch.long).gather(1, chosen),
        truncated=torch.zeros(n, dtype=torch.bool), noise_level=payload.noise_level,
        negative=None if payload.negative is None else conditioning.as_tensors(payload.negative),
        guidance_scale=payload.guidance_scale, sde_type=payload.sde_type)


class FlowPolicy(PolicyBase):
    """What the learner asks of the flow family (``tether.vocabulary.Policy``)."""

    def __init__(self, train_steps: int = 0, choice: str = "random", kl_units: str = "exact", *,
                 cfg_grad: str = "full", cfg=None) -> None:
        self.cfg = cfg
        """The recipe, for a pipeline's prompt length and size (held-out evaluation encodes prompts)."""
        self.train_steps = train_steps
        """K: steps of each trajectory trained (0: all T)."""
        self.choice = choice
        """Which K: ``random`` per trajectory, or the ``first`` K (``flow.train_step_choice``)."""
        self.kl_units = kl_units
        """``exact``: each step's KL over its own variance σ_t²·|dt|; ``reference``: over σ_t², as
        Flow-GRPO's reference code computes it (``flow.kl_units``): |dt| times the exact one."""
        self.cfg_grad = cfg_grad
        """With guidance, gradients through both branches (``full``) or the conditional one alone
        (``conditional``; ``flow.cfg_grad``)."""

    def load(self, path: str | Path, *, dtype: torch.dtype = torch.float32):
        """(model, tokenizer): the trained part of the flow model (a pipeline's transformer, without
        its text encoders and VAE: conditioning comes with the batch); no tokenizer to save. Read
        whole, then cast to ``dtype`` (a flow model is small beside its load's other costs)."""
        model = load_flow_model(path, self.cfg, whole=False)
        return (model if dtype == torch.float32 else model.to(dtype)), None

    def save(self, model, tokenizer, folder: Path) -> None:
        model.save_pretrained(folder)

    def write_folder(self, model, folder: Path, weights: dict[str, torch.Tensor] | None) -> None:
        """A model folder of ``weights`` gathered from learner ranks (None: its config alone)."""
        model.write_folder(folder, weights)

    def read_weights(self, folder: Path) -> dict[str, torch.Tensor]:
        """The parameters a checkpoint's model folder holds, by the names the model gives them."""
        from safetensors.torch import load_file

        from tether.families.flow.pipeline import is_pipeline

        if not is_pipeline(folder):
            return load_file(str(folder / "model.safetensors"))
        files = sorted((folder / "transformer").glob("*.safetensors"))
        return {f"transformer.{name}": tensor for file in files
                for name, tensor in load_file(str(file)).items()}

    def batch(self, payload) -> FlowTrainBatch:
        return to_flow_batch(payload, self.train_steps, self.choice)

    def forward(self, model, batch: FlowTrainBatch, *, with_entropy: bool = False, forward=None):
        """(log-probs (n, K), entropies (n, K) or None, the KL's basis: each step's mean in units
        of its std, μ/σ (n, K, C, H, W); with ``kl_units`` reference, of σ_t = std/√|dt|)."""
        logp, means, stds = step_logprobs(model, batch.latents, batch.sample_cond(), batch.times,
                                          batch.noise_level, batch.steps, negative=batch.negative,
                                          guidance=batch.guidance_scale,
                                          detach_uncond=self.cfg_grad == "conditional",
                                          sde_type=batch.sde_type)
        entropy = gaussian_entropy(stds) if with_entropy else None
        scale = stds
        # σ_t = std / √|dt|: the KL the reference's code computes for its SDE; for CPS it divides by
        # the step's own std (its std_dev_t), the exact KL
        if self.kl_units == "reference" and batch.sde_type == "sde":
            times = batch.times.to(stds.device, torch.float64)
            dt = (times[batch.steps] - times[batch.steps + 1]).abs()
            scale = (stds.double() / dt.sqrt()).to(stds.dtype)
        return logp, entropy, means / scale.view(*scale.shape, *[1] * (means.dim() - 2))

    def kl(self, basis: torch.Tensor, ref_basis: torch.Tensor, estimator: str) -> torch.Tensor:
        """Closed-form KL per step, (n, T): with both means in units of the shared σ,
        ‖μ_θ − μ_ref‖²/(2σ²) is half the squared distance (``estimator`` is for sampled token KLs;
        not used here)."""
        return gaussian_kl(basis, ref_basis, torch.ones(basis.shape[:2]))

    def fast_forward(self, model, enabled: bool):
        return None

    def layers(self, model) -> list[torch.nn.Module]:
        """The transformer's blocks: the built-in DiT's, or a diffusers transformer's."""
        return model.layers()
