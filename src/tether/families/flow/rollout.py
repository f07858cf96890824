"""The flow family's side of a rollout worker: the engine that samples trajectories, and the
scored batch it sends back (``FlowBatch``, the payload the flow learner trains on).

A rollout batch is B prompts × G images, each a trajectory of T denoising steps: SDE steps with
every step's log-probability under the engine's weights and the version that sampled it, or, with
an SDE window (``flow.sde_window`` = K), K such steps among ODE steps, of which the batch records
only the window's (the learner trains nothing else). Arrays travel as numpy (pickled through the
worker's pipe or Ray's object store; no shared-memory handles).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from tether.data.rewards import score_all
from tether.errors import RolloutError
from tether.families.flow import conditioning
from tether.families.flow.model import load_flow_model
from tether.families.flow.policy import FlowSampling, Trajectories, sample
from tether.procinfo import peak_rss_mb
from tether.rollout.model_engine import ModelEngine
from tether.vocabulary import WorkItem, version_shares


class _Restart(Exception):
    """Weights switched under ``abort`` before denoising step ``step``: the trajectories start over."""

    def __init__(self, step: int) -> None:
        super().__init__(step)
        self.step = step


class FlowEngine(ModelEngine):
    """Samples trajectories with its own copy of the weights; stamps its version on every step.

    Watched (``async.inflight_update`` keep, recompute or abort), it takes up newer weights between
    two denoising steps: a step reads only x_t, the time and the prompt's conditioning (frozen text
    encoders), so there is no cache an older version wrote; under keep the trajectories go on with
    the new weights, each step stamped with the version that took it, and recompute is keep (it
    would recompute a cache, and there is none); under abort they start again from fresh noise
    under the new weights (the steps taken are counted as wasted)."""

    def __init__(self, model, sampling: FlowSampling, *, version: int = 0, negative_prompt: str = "") -> None:
        super().__init__(model.requires_grad_(False), version=version)
        self.sampling = sampling
        self.negative = model.encode_prompts([negative_prompt]) if sampling.guided else None
        """The unconditional prompt's conditioning (one row), when guided; the text encoders never
        change, so it is computed once."""
        self.switches = 0  # since the last ``take_counts``
        self.wasted_steps = 0  # trajectory steps thrown away by abort

    def take_counts(self) -> tuple[int, int]:
        """(trajectory steps wasted by abort, weight switches) since the last call."""
        counts = (self.wasted_steps, self.switches)
        self.wasted_steps = self.switches = 0
        return counts

    def _before(self, step: int) -> int:
        """Before denoising step ``step``: between two steps, a watched engine takes up newer
        weights (under abort the trajectories then start over); the version the model holds."""
        if step > 0 and self.poll is not None and self.poll() is not None:
            self.switches += 1
            if self.inflight.restarts:
                raise _Restart(step)
        return self._version

    def generate(self, cond: dict[str, torch.Tensor], *, seed: int, group: int = 1,
                 batch: int | None = None) -> Trajectories:
        """One trajectory per row of ``cond``, on the CPU: its window's latents (N, K + 1, C, H, W)
        and step log-probs (N, K), the version of each window step, and the final latents (K = T
        without a window; the window drawn by ``seed``, or placed by the rollout batch index
        ``batch`` when it slides). The same seed, batch, weights and prompts give the same
        trajectories (a trajectory started over draws on from the same generator). ``group``: the
        rows of one prompt's group, consecutive (one initial noise each with ``same_latent``)."""
        generator = torch.Generator().manual_seed(seed)
        cond = conditioning.to(cond, self.device)
        while True:
            try:
                out = sample(self.model, cond, self.sampling, generator=generator, negative=self.negative,
                             poll=self._before, window=self.sampling.window_steps(seed, batch), group=group)
            except _Restart as restart:
                self.wasted_steps += restart.step * conditioning.num_rows(cond)
                continue
            return Trajectories(out.latents.cpu(), out.logprobs.cpu(), out.versions, out.first_step,
                                out.final.cpu())


@dataclass
class FlowBatch:
    """B prompts × G trajectories; per-sample rows in group order (sample s of prompt b at b·G + s)."""

    positions: list[int]
    prompts: list[str]
    cond: dict[str, np.ndarray]
    """Each prompt's conditioning (B rows; sample i's is row i // G): word ids, or text embeddings."""
    latents: np.ndarray
    """(N, K + 1, C, H, W) float32: x at the K + 1 times of ``times`` (all T + 1, t_0 = 1 noise …
    t_T = 0 the image, without an SDE window)."""
    logprobs: np.ndarray
    """(N, K) float32: each SDE step's log-probability (per coordinate) under the engine's weights."""
    versions: list[list[int]]
    """(N × K) the policy version that sampled each SDE step."""
    rewards: list[float]
    times: np.ndarray
    """(K + 1,) the times of the recorded steps (from t_{first_step} on)."""
    noise_level: float
    group_size: int
    metrics: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    """The work item's seed: it drew the trajectories' noise, and draws the steps the learner trains."""
    negative: dict[str, np.ndarray] | None = None
    """The unconditional prompt's conditioning (one row), when sampled with guidance."""
    guidance_scale: float = 1.0
    """Classifier-free guidance w the trajectories were sampled with (the learner's forward uses it)."""
    first_step: int = 0
    """The SDE window's first step (0 without a window): recorded step i is denoising step
    ``first_step`` + i of the trajectory."""
    sde_type: str = "sde"
    """The SDE steps' rule the trajectories were sampled with (``flow.sde_type``)."""

    @property
    def num_groups(self) -> int:
        return len(self.prompts)

    def check(self) -> None:
        """Refuse a batch whose groups are not intact (raises ``ValueError``)."""
        n = self.num_groups * self.group_size
        sizes = {"positions": (len(self.positions), self.num_groups),
                 "cond": (conditioning.num_rows(self.cond), self.num_groups),
                 "latents": (len(self.latents), n), "logprobs": (len(self.logprobs), n),
                 "versions": (len(self.versions), n), "rewards": (len(self.rewards), n)}
        wrong = {k: got for k, (got, want) in sizes.items() if got != want}
        if wrong:
            raise ValueError(f"flow batch is not whole: {wrong} (expected {self.num_groups} groups of "
                             f"{self.group_size})")
        steps = len(self.times) - 1
        if self.latents.shape[1] != steps + 1 or self.logprobs.shape[1] != steps or \
                any(len(v) != steps for v in self.versions):
            raise ValueError(f"flow batch trajectories do not have the {steps} steps of its times")

    def version_shares(self) -> dict[int, float]:
        return version_shares(self.versions)

    def sample_lines(self) -> list[dict]:
        """What ``samples.jsonl`` holds of each image (``metrics.record_every``): its prompt and
        reward, and the versions of its steps."""
        g = self.group_size
        return [{"position": self.positions[i // g], "group": i // g, "sample": i % g,
                 "prompt": self.prompts[i // g], "reward": self.rewards[i],
                 "versions": [min(self.versions[i]), max(self.versions[i])]}
                for i in range(len(self.rewards))]


class FlowSampler:
    """The flow model, its engine and the image reward of one worker."""

    def __init__(self, cfg, model_path: str, *, device: torch.device) -> None:
        self.cfg = cfg
        model = load_flow_model(model_path, cfg).to(device)
        if cfg.flow.dtype == "bfloat16":  # the SDE step stays float32 (conditioning.velocity)
            model.to(torch.bfloat16)
        self.sampling = sampling_of(cfg, model)
        self.engine = FlowEngine(model, self.sampling, negative_prompt=cfg.flow.negative_prompt)
        self.switches = cfg.budget().mode.switches
        """The engine takes up weights between denoising steps: a batch reports how often, and its waste."""
        self.score = cfg.family().scorer(cfg)

    def close(self) -> None:
        """Nothing to release besides the engine."""

    def generate(self, item: WorkItem) -> FlowBatch:
        t0 = time.perf_counter()
        g = item.group_size
        model = self.engine.model
        cond = model.encode_prompts([ex.prompt for _, ex in item.examples])  # once per prompt
        per_sample = conditioning.rows(cond, torch.arange(len(item.examples)).repeat_interleave(g))
        out = self.engine.generate(per_sample, seed=item.seed, group=g, batch=item.batch_index)
        check_finite(out, self.sampling)
        generate_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        pixels = model.decode(out.final)
        decode_s = time.perf_counter() - t0
        pairs = [(item.examples[i // g][1], image) for i, image in enumerate(pixels)]
        rewards, errors = score_all(self.score, pairs, on_error=self.cfg.reward.on_error)
        score_s = time.perf_counter() - t0
        n = len(rewards)
        mean = sum(rewards) / n
        metrics = {
            "reward/mean": mean,
            "reward/std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / n),
            "reward/errors": float(errors),
            "reward/pass_frac": sum(r >= 1.0 for r in rewards) / n,
            "time/generate": generate_s,
            "time/decode": decode_s,
            "time/score": score_s,
            "throughput/gen_images_per_s": n / max(generate_s, 1e-9),
            "throughput/gen_steps_per_s": n * self.sampling.steps / max(generate_s, 1e-9),
            "memory/rollout_peak_mb": peak_rss_mb(),
            "flow/window_start": float(out.first_step),
        }
        metrics.update(self.score.take_parts())  # reward.functions: each part's mean
        if self.switches:  # weights taken up between denoising steps (async.inflight_update)
            wasted, switches = self.engine.take_counts()
            metrics.update({"rollout/weight_switches": float(switches), "rollout/wasted_steps": float(wasted),
                            "staleness/multi_version_seq_frac": float(len(set(out.versions)) > 1)})
        negative = self.engine.negative
        first, k = out.first_step, out.logprobs.shape[1]
        return FlowBatch(positions=[p for p, _ in item.examples],
                         prompts=[ex.prompt for _, ex in item.examples],
                         cond=conditioning.as_numpy(cond), latents=out.latents.numpy(),
                         logprobs=out.logprobs.numpy(), versions=[list(out.versions) for _ in range(n)],
                         rewards=rewards, first_step=first,
                         times=self.sampling.times()[first:first + k + 1].numpy(),
                         noise_level=self.sampling.noise_level,
                         group_size=g, metrics=metrics, seed=item.seed,
                         negative=None if negative is None else conditioning.as_numpy(negative),
                         guidance_scale=self.sampling.guidance_scale, sde_type=self.sampling.sde_type)


def check_finite(out: Trajectories, sampling: FlowSampling) -> None:
    """Refuse a batch whose SDE went non-finite, naming the first such step and the settings that
    shape it (a model whose weights went non-finite gives the same; the message says both)."""
    bad = ~torch.isfinite(out.latents.flatten(2)).all(2)[:, 1:] | ~torch.isfinite(out.logprobs)
    if not bad.any():
        if torch.isfinite(out.final).all():
            return
        j = sampling.steps - 1  # an ODE step after the window: named by the last one
    else:
        j = out.first_step + int(bad.any(0).nonzero()[0])
    times = sampling.times()
    raise RolloutError(
        f"the SDE sampled non-finite values at step {j} of {sampling.steps} (t = {float(times[j]):.6g} → "
        f"{float(times[j + 1]):.6g}) under flow.sde_type={sampling.sde_type}, flow.noise_level="
        f"{sampling.noise_level:g}, flow.shift="
        f"{sampling.shift:g}, flow.steps={sampling.steps}, flow.guidance_scale={sampling.guidance_scale:g}: "
        "lower flow.noise_level or flow.guidance_scale, or bring flow.shift nearer 1 (docs/flow.md, "
        "\"Bounds\"); with settings inside them, the model's weights may have gone non-finite")


def sampling_of(cfg, model=None) -> FlowSampling:
    """How the recipe's trajectories are sampled (its ``flow`` section), with ``model``'s own
    time schedule (a diffusers scheduler's sigmas) when given."""
    f = cfg.flow
    schedule = () if model is None else tuple(float(t) for t in model.times(f.steps, f.shift))
    return FlowSampling(steps=f.steps, noise_level=f.noise_level, shift=f.shift,
                        guidance_scale=f.guidance_scale, schedule=schedule, window=f.sde_window,
                        window_range=f.sde_window_range, window_slide=f.sde_window_slide,
                        sde_type=f.sde_type, same_latent=f.same_latent)
