"""The flow family's own recipe section (``flow``; ``Family.section``): Flow-GRPO's sampler and the
tiny model a run builds. Refused unless ``model.family=flow`` (``tether.config.features``).

``train.algorithm: flow_grpo`` also sets the reference's timestep fraction here (``resolve_flow``):
the first int(0.99·T) steps of every trajectory (every step of an SDE window, when there is one),
unless the recipe names ``flow.train_steps`` or ``flow.train_step_choice``; the run's config records
what was resolved.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from tether.config.fields import knob


@dataclass(frozen=True)
class FlowSection:
    """Flow-matching image generators trained with Flow-GRPO (used when model.family=flow)."""

    steps: int = knob(
        8,
        "T: SDE denoising steps of each training sample, each one policy action with its own "
        "log-probability, ratio and clip (Flow-GRPO's denoising reduction: fewer than evaluation); with "
        "flow.sde_window, K of them are, the others ODE steps.",
        min=1,
    )
    train_steps: int = knob(
        0,
        "K: steps of each trajectory the learner trains on (which ones: flow.train_step_choice); an "
        "update then costs about K/T of one over all T steps. 0 = all T. At most flow.steps.",
        min=0,
    )
    train_step_choice: Literal["random", "first"] = knob(
        "random",
        "Which flow.train_steps of each trajectory: random = drawn per trajectory (DDPO's way); first = "
        "steps 0 … K − 1 of every trajectory, Flow-GRPO's reference (timestep_fraction = K/T in order; at "
        "its 0.99 the last, low-noise step is left out).",
        choices=("random", "first"),
    )
    cfg_grad: Literal["full", "conditional"] = knob(
        "full",
        "With classifier-free guidance in the training forward (flow.guidance_scale ≠ 1), which branches "
        "the gradient flows through: full = both, the gradient of the guided velocity the sampler used "
        "(Flow-GRPO's newer upstream); conditional = the unconditional branch detached, v = sg[v_u] + "
        "w·(v_c − sg[v_u]) (the reference at ac4c86e; train.algorithm: flow_grpo sets it). docs/flow.md, "
        "\"Guidance gradients\".",
        choices=("full", "conditional"),
    )
    sde_window: int = knob(
        0,
        "K: an SDE window (Flow-GRPO-Fast's, MixGRPO's): only K consecutive steps of each trajectory "
        "are SDE steps, policy actions with log-probabilities, ratios, advantages and KL; the steps "
        "before and after are the deterministic ODE's, and a batch records the window's steps alone. "
        "An update then costs about K/T of one over all T; generation costs the same. The window's "
        "place: flow.sde_window_range. 0 = every step is an SDE step. At most flow.steps.",
        min=0,
    )
    sde_window_range: int = knob(
        0,
        "R: the SDE window lies within steps 0 … R − 1 of each trajectory, its start drawn uniformly "
        "from 0 … R − K once per rollout batch (from the batch's seed: a resume and every learner "
        "rank see the same window). Small R keeps the window among the early, high-noise steps, "
        "where Flow-GRPO-Fast places it. 0 = flow.steps (anywhere). Needs flow.sde_window; from "
        "flow.sde_window to flow.steps.",
        min=0,
    )
    sde_window_slide: int = knob(
        0,
        "N > 0: the SDE window slides instead of being drawn (MixGRPO's progressive schedule): rollout "
        "batch b's window starts at step (b // N) mod (R − K + 1), so it starts at the first, "
        "highest-noise step, moves one step later every N batches, and returns to the first after "
        "the last start within flow.sde_window_range (MixGRPO's roll-back; its FLUX recipe: 25 "
        "iterations a step). The same batch index gives the same window on a resume and on every "
        "rank. 0 = drawn by the batch's seed. Needs flow.sde_window below flow.steps.",
        min=0,
    )
    same_latent: bool = knob(
        False,
        "Every image of a prompt's group starts from the same initial noise (Flow-GRPO's "
        "sample.same_latent, DanceGRPO's shared initialization noise): the group's images then differ "
        "only by the SDE steps' noise, the steps the advantage credits, not by where they started. "
        "The noise is still new for every group and batch. false = independent noise for every image.",
    )
    kl_units: Literal["reference", "exact"] = knob(
        "reference",
        "Units of the closed-form KL that train.kl_coef weighs. reference = ‖μ_θ − μ_ref‖²/(2σ_t²), as "
        "Flow-GRPO's reference code computes it, so its β carries over; exact = over each step's own "
        "variance σ_t²·|dt|, the KL of the two step Gaussians, 1/|dt| times larger (T times at uniform "
        "steps: β_exact = β_reference·|dt|). With flow.sde_type=cps the reference divides by the step's "
        "own variance too: both are the exact KL.",
        choices=("reference", "exact"),
    )
    eval_steps: int = knob(
        16, "Steps of the deterministic ODE sampler that held-out evaluation and the warm start use.", min=1
    )
    sde_type: Literal["sde", "cps"] = knob(
        "sde",
        "The SDE steps' rule. sde = Flow-GRPO's SDE, σ_t = a·√(t/(1 − t)) with a = flow.noise_level; "
        "cps = Coefficients-Preserving Sampling (Wang & Yu, arXiv 2509.05952; Flow-GRPO's newer upstream, "
        "noise level 0.8 there): a step to time s blends the model's own estimates of image and noise "
        "and draws s·sin(a·π/2) of fresh noise, so the noise keeps the schedule's coefficient at every "
        "step (Flow-GRPO's SDE adds more at coarse steps). cps needs an SDE window off the last step, "
        "which has no noise (flow.sde_window, flow.sde_window_range ≤ flow.steps − 1); its a runs to 1. "
        "docs/flow.md, \"CPS\".",
        choices=("sde", "cps"),
    )
    noise_level: float = knob(
        0.7,
        "a in the SDE's σ_t = a·√(t/(1 − t)) (in CPS's s·sin(a·π/2): flow.sde_type): how much each step "
        "explores; Flow-GRPO uses 0.7 (0.8 with CPS). 0 would be "
        "the ODE, whose steps have no density, and near it a step's log-probability is float32 rounding "
        "divided by a vanishing σ (the ratios are noise), so at least 0.01; at most 2, where the first "
        "step's factor on x, 1 − a²/2, reaches −1 (above, samples blow up), and lower where flow.shift "
        "makes a step's r = |dt|/(1 − t) larger than 1 (a ≤ 2/√r, checked at load; docs/flow.md, "
        "\"Bounds\"); with CPS at most 1.",
        min=0.01, allowed="0.01–2; lower where flow.shift lengthens a step, checked at load; with cps 0.01–1",
    )
    shift: float = knob(
        0.0,
        "Timestep shift of the sampling schedule towards the noise end, as SD3's scheduler does (t ↦ "
        "s·t/(1 + (s − 1)·t)); training trajectories and the evaluation ODE both use it. 0 = the model's "
        "own: uniform (1) for the built-in model, a diffusers pipeline's scheduler shift (SD3: 3) and its "
        "sigmas. Otherwise 0.1–20: below, float32 rounding moves the first time off 1 (NaN at 1e-12); above, "
        "the last steps' noise grows as shift/flow.steps (NaN at 1e6).",
        min=0.0, allowed="0, the model's own, or 0.1–20",
    )
    guidance_scale: float = knob(
        1.0,
        "Classifier-free guidance w in sampling and in the training forward, v = v_u + w·(v_c − v_u) "
        "(both branches through the trained model, as Flow-GRPO's reference does; which carry "
        "gradients: flow.cfg_grad); 1 = none. The reference uses 4.5 with SD3.5.",
        min=0.0,
    )
    negative_prompt: str = knob(
        "", "The unconditional branch's prompt when flow.guidance_scale ≠ 1 (the reference: empty)."
    )
    resolution: int = knob(
        0,
        "Image size in pixels of a diffusers pipeline's samples (a multiple of its VAE's factor); 0 = the "
        "transformer's sample_size × that factor. The built-in model's size is fixed.",
        min=0,
    )
    dtype: Literal["float32", "bfloat16"] = knob(
        "float32",
        "Precision of a diffusers pipeline in the rollout engine (transformer, VAE, text encoders); the SDE "
        "step, the log-probs and the learner stay float32. bfloat16 is faster on GPUs and adds a "
        "train–inference mismatch that the ratios and mismatch/* metrics show and correction.* corrects.",
        choices=("float32", "bfloat16"),
    )
    init_backbone: Literal["dit", "sd3"] = knob(
        "dit",
        "What model.create_if_missing builds: dit = the built-in conditional DiT over 16×16 RGB; sd3 = "
        "a tiny diffusers Stable Diffusion 3 pipeline (transformer, VAE, two CLIP text encoders, SD3's "
        "scheduler) whose VAE is first trained here on drawn scenes (flow.init_vae_steps), then the "
        "transformer warm-started on its latents (docs/flow.md).",
        choices=("dit", "sd3"),
    )
    init_tokens: Literal["characters", "words"] = knob(
        "characters",
        "With flow.init_backbone=sd3 (refused with dit): the built pipeline's CLIP tokenizer. "
        "'characters': one token a character, so data.max_prompt_tokens must hold a prompt's letters; "
        "'words': BPE merges that hold each word of the shapes task whole, as a real CLIP vocabulary "
        "holds common words (any other text keeps its characters), so a prompt is a token a word and a "
        "short data.max_prompt_tokens (8) halves the transformer's text stream.",
        choices=("characters", "words"),
    )
    init_vae_steps: int = knob(
        3000, "With flow.init_backbone=sd3 (refused with dit): the most optimizer steps of the VAE's "
        "training on drawn scenes (it stops earlier at flow.init_vae_reward; a warning if it never gets "
        "there).", min=1
    )
    init_vae_reward: float = knob(
        1.0, "With flow.init_backbone=sd3 (refused with dit): the VAE trains until the shapes verifier's "
        "mean reward on its reconstructions of drawn scenes (every scene, held-out ones too; checked every "
        "250 steps) reaches this: the most any image the pipeline decodes can score. 1 = every "
        "reconstruction earns the full reward.", min=0, max=1
    )
    init_width: int = knob(96, "Width of a flow model built by model.create_if_missing (every flow.init_* "
                           "key set with a model Tether did not build is named in a warning).", min=8)
    init_depth: int = knob(3, "Transformer blocks of a flow model built by model.create_if_missing.", min=1)
    init_cond_dropout: float = knob(
        0.1,
        "Share of the warm start's images of a flow model built by model.create_if_missing that are "
        "trained with the empty prompt (all <pad>), so the unconditional branch guidance uses "
        "(flow.guidance_scale ≠ 1, flow.negative_prompt empty) is learned; Stable Diffusion's base models "
        "drop 10 % of captions. 0 = every image with its prompt.",
        min=0.0, max=0.9,
    )


TIMESTEP_FRACTION = 0.99
"""Flow-GRPO's reference ``train.timestep_fraction`` (config/grpo.py): it trains the first
int(0.99·T) steps of each trajectory, all but the last, low-noise one."""


def reference_train_steps(steps: int) -> int:
    """K = int(0.99·T), at least 1 (the reference's ``num_train_timesteps``)."""
    return max(1, int(steps * TIMESTEP_FRACTION))


def preset_train_steps(flow: FlowSection) -> int:
    """What ``train.algorithm: flow_grpo`` sets ``flow.train_steps`` to: the reference's int(0.99·T),
    or 0 (the whole window) with an SDE window."""
    return 0 if flow.sde_window else reference_train_steps(flow.steps)


def resolve_flow(cfg: Any, explicit: set[str]) -> Any:
    """``cfg`` with ``train.algorithm: flow_grpo``'s flow keys (the reference's timestep fraction:
    ``flow.train_steps`` = int(0.99·T), ``flow.train_step_choice: first``; its guidance gradient,
    ``flow.cfg_grad: conditional``) for those the recipe does not name; any other algorithm, or keys
    the recipe names, are left as they are. With an SDE window (``flow.sde_window`` = K) the window's
    K steps are the trained ones, as Flow-GRPO-Fast trains them, so ``flow.train_steps`` stays 0
    (every window step)."""
    if cfg.train.algorithm != "flow_grpo":
        return cfg
    flow = cfg.section("flow")
    fills: dict[str, Any] = {}
    if "flow.train_steps" not in explicit:
        fills["train_steps"] = preset_train_steps(flow)
    if "flow.train_step_choice" not in explicit:
        fills["train_step_choice"] = "first"
    if "flow.cfg_grad" not in explicit:  # the reference at ac4c86e detaches v_u (train_sd3.py:190)
        fills["cfg_grad"] = "conditional"
    return dataclasses.replace(cfg, plugin_sections={**cfg.plugin_sections,
                                                     "flow": dataclasses.replace(flow, **fills)})
