"""The flow family (``model.family: flow``): flow-matching image generators trained with Flow-GRPO
(docs/flow.md). A sample is an image's denoising trajectory; an action (a column of the training
tensors) is one SDE step.

- ``sde``: the sampling ODE as an SDE with the same marginals; each step a Gaussian policy;
- ``policy``: trajectories and the per-step log-probabilities, means and closed-form KL;
- ``model``: a tiny conditional DiT and its model directory, and ``load_flow_model``;
- ``pipeline``: a diffusers SD3-class pipeline as the model (``DiffusersFlow``);
- ``conditioning``: prompts' conditioning carried with a batch, and classifier-free guidance;
- ``scenes`` / ``task``: the built-in ``shapes`` task (prompts, drawn images, a pixel verifier)
  and image rewards;
- ``warmstart``: flow matching on drawn images until the model is sometimes right;
- ``rollout``: the engine and the worker's sampler, and the ``FlowBatch`` payload;
- ``learn``: the learner's side (``FlowPolicy``: a column is a denoising step);
- ``evaluate``: held-out reward and pass rate, and the image grids ``tether report`` shows;
- ``options``: its recipe section, ``flow``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tether.control.notes import AdmissionNote
from tether.errors import ConfigError
from tether.families.base import FamilyBase
from tether.families.flow.options import FlowSection
from tether.vocabulary import Capabilities, DataBundle, Progress

NOT_YET = "not supported by the flow family yet"
BUILD_KEYS = {"init_backbone": "backbone", "init_width": "init_width", "init_depth": "init_depth",
              "init_vae_steps": "vae_steps", "init_vae_reward": "vae_reward_target",
              "init_cond_dropout": "cond_dropout", "init_tokens": "init_tokens"}
"""The flow section's keys that shape a model Tether builds, and their names in its build record."""


class FlowFamily(FamilyBase):
    name = "flow"
    description = "flow-matching image generators (Flow-GRPO): a sample is a trajectory, an action a step"
    section = ("flow", FlowSection)
    keys = ("reward.function", "reward.functions", "reward.weights", "reward.on_error",
            "plan.train_time_steps")
    capabilities = Capabilities(
        engine_kind="step", inflight_updates=("drain", "keep", "recompute", "abort"),
        features=frozenset({"learner_ranks", "learner_actor", "datasets", "lora", "attribution"}),
        notes={"engine_kind": "its sampler runs the flow model's own denoising steps",
               "token_sampling": "a flow model's sampling is the flow section",
               "decoder": "a flow model's sampler has no native form",
               "dynamic_sampling": NOT_YET,
               "truncation": "trajectories are never truncated",
               "shared_prefix": "no prompt prefix is shared",
               "mixed_precision": "its learner computes in float32; flow.dtype sets its engine's"})
    warmstart_fields = ("loss", "pass_at_1", "reward")

    def resolve(self, cfg: Any, explicit: set[str]) -> Any:
        from tether.families.flow.options import resolve_flow

        return resolve_flow(cfg, explicit)

    def check(self, cfg: Any) -> None:
        from tether.families.flow.options import FlowSection
        from tether.families.flow.pipeline import check_pipeline, check_resolution, is_pipeline, own_settings
        from tether.families.flow.sde import check_sde
        from tether.families.flow.tiny_sd3 import SD3_VAE_FACTOR

        own_shift = 0.0
        if (Path(cfg.model.path) / "model_index.json").is_file():  # before any process loads it
            check_pipeline(cfg.model.path)
        built = is_pipeline(cfg.model.path)
        own = own_settings(cfg.model.path) if built else None
        # a pipeline model.create_if_missing is to build (flow.init_backbone=sd3) is one already
        to_build = sd3_to_build(cfg)
        if own is not None:
            own_shift, factor = own
            check_resolution(cfg.flow.resolution, factor, cfg.model.path)
        elif to_build:
            check_resolution(cfg.flow.resolution, SD3_VAE_FACTOR, cfg.model.path)
        check_sde(cfg.flow.noise_level, cfg.flow.shift, cfg.flow.steps, own_shift=own_shift,
                  sde_type=cfg.flow.sde_type)
        check_window(cfg.flow)
        if cfg.plan.mean_length or cfg.plan.prefill_cost:
            raise ConfigError("plan.mean_length and plan.prefill_cost model text completions; a flow "
                              f"trajectory takes flow.steps={cfg.flow.steps} steps, which tether plan reads "
                              "instead (and a switch recomputes nothing): drop them")
        if cfg.flow.dtype != "float32" and not (built or to_build):
            raise ConfigError(f"flow.dtype={cfg.flow.dtype} is for a diffusers pipeline's engine; the "
                              "built-in model samples in float32: drop it")
        defaults = FlowSection()
        sd3_keys = ("init_tokens", "init_vae_steps", "init_vae_reward")
        named = [f"flow.{key}={getattr(cfg.flow, key)}" for key in sd3_keys
                 if getattr(cfg.flow, key) != getattr(defaults, key)]
        if cfg.flow.init_backbone == "dit" and named:
            verb, them = ("is", "it") if len(named) == 1 else ("are", "them")
            raise ConfigError(f"{', '.join(named)} {verb} for the tiny SD3 pipeline flow.init_backbone=sd3 "
                              "builds (its tokenizer and VAE); the built-in DiT (flow.init_backbone=dit) has "
                              f"neither: set flow.init_backbone=sd3, or drop {them}")
        if cfg.flow.resolution and not (built or to_build):
            raise ConfigError(f"flow.resolution={cfg.flow.resolution} sizes a diffusers pipeline's images; "
                              f"model.path {cfg.model.path} is the built-in model, whose size is fixed: "
                              "drop it")

    def norm_constant(self, cfg: Any) -> int:
        return trained_steps(cfg.flow)

    def plan_lengths(self, cfg: Any) -> tuple[float, int]:
        """Every trajectory takes exactly flow.steps denoising steps (an abort's waste is the steps
        taken before the switch, for every trajectory of the batch)."""
        return float(cfg.flow.steps), cfg.flow.steps

    def plan_train_scale(self, cfg: Any) -> float:
        """An update's cost over that of one timed at ``plan.train_time_steps`` trained steps per
        trajectory: the learner's forward and backward run over N·K (x_t, t) pairs, K the trained
        steps (``trained_steps``); 1 when that key is 0 (timed at the recipe's own)."""
        timed = cfg.plan.train_time_steps
        return trained_steps(cfg.flow) / timed if timed else 1.0

    def notes(self, cfg: Any) -> list[AdmissionNote]:
        """Guidance settings that run, but do not do what they seem to; recompute, which is keep
        here; one initial noise a group for groups of one; and, with ``train.algorithm:
        flow_grpo``, the recipe's own trained steps where they are not the reference's (the recipe
        named them: ``resolve_flow`` fills them otherwise)."""
        from tether.families.flow.options import preset_train_steps

        f = cfg.flow
        reference, own = preset_train_steps(f), []
        mine = (f.train_steps, f.train_step_choice)
        if cfg.train.algorithm == "flow_grpo" and mine != (reference, "first"):
            own.append(AdmissionNote(
                "not_the_reference_steps", f"flow.train_steps={f.train_steps}, flow.train_step_choice="
                f"{f.train_step_choice} (the recipe's) stand instead of train.algorithm=flow_grpo's "
                f"trained steps: flow.train_steps={reference}, flow.train_step_choice=first"))
        if f.same_latent and cfg.rollout.group_size == 1:
            own.append(AdmissionNote(
                "same_latent_alone", "flow.same_latent=true has no effect at rollout.group_size=1: a "
                "group of one image has no other to share its initial noise with; raise "
                "rollout.group_size (Flow-GRPO: 24) or drop flow.same_latent"))
        from tether.control import inflight_mode

        if inflight_mode(cfg.async_.inflight_update).recomputes_prefix:
            own.append(AdmissionNote(
                "recompute_is_keep", "async.inflight_update=recompute runs as keep on the flow family, at "
                "no extra cost: a denoising step reads only x_t and the prompt's encoding (word ids, or a "
                "frozen text encoder's), no cache an older version computed, so every step after a switch "
                "is already wholly the new version's, which is what recompute adds to keep for text"))
        return own + self._guidance_notes(f) + self._untrained_branch_notes(cfg)

    @staticmethod
    def _guidance_notes(f: Any) -> list[AdmissionNote]:
        """w = 0 (the prompts do nothing), 0 < w < 1 (less of the prompt than no guidance), and a
        negative prompt without guidance."""
        if 0 < f.guidance_scale < 1:
            return [AdmissionNote(
                "guidance_below_one",
                f"flow.guidance_scale={f.guidance_scale:g} blends the two branches, v = "
                f"{1 - f.guidance_scale:g}·v_u + {f.guidance_scale:g}·v_c: every velocity holds less of the "
                "prompt than with no guidance at all (1), the rest the unconditional branch's. Guidance "
                "that follows the prompt more closely is above 1 (SD3: 4.5); 1 turns it off")]
        if f.guidance_scale == 0:
            return [AdmissionNote(
                "unconditional", "flow.guidance_scale=0 makes every velocity the unconditional branch's, "
                "v = v_u + 0·(v_c − v_u) (conditioned on "
                f"{'flow.negative_prompt' if f.negative_prompt else 'the empty prompt'}): the prompts have "
                "no effect on sampling or training. 1 turns guidance off (the conditional branch alone); "
                "above 1 guides (SD3: 4.5)")]
        if f.guidance_scale == 1 and f.negative_prompt:
            return [AdmissionNote(
                "unused_negative_prompt", f"flow.negative_prompt={f.negative_prompt!r} has no effect at "
                "flow.guidance_scale=1 (no guidance: the unconditional branch is never run); set "
                "flow.guidance_scale above 1 to guide away from it, or drop it")]
        return []

    @staticmethod
    def _untrained_branch_notes(cfg: Any) -> list[AdmissionNote]:
        """Guidance with a model built here without condition dropout, whose unconditional branch
        (the empty prompt, all <pad>) it never trained on: read from its build record, or from
        flow.init_cond_dropout when it is yet to be built. Nothing for a model with no record (a
        user's pipeline: its own training is unknown here)."""
        from tether.data.prepare import built_settings

        f = cfg.flow
        if f.guidance_scale == 1:
            return []
        path = Path(cfg.model.path)
        if (path / "warmstart.json").is_file():
            dropout = built_settings(path).get("cond_dropout")
        elif not path.exists() and cfg.model.create_if_missing:
            dropout = f.init_cond_dropout
        else:
            return []
        if dropout != 0:
            return []
        branch = "flow.negative_prompt's" if f.negative_prompt else "the empty prompt's (all <pad>)"
        return [AdmissionNote(
            "untrained_unconditional", f"flow.guidance_scale={f.guidance_scale:g} guides against "
            f"{branch} velocity, but {path} is {'to be ' if not path.exists() else ''}built with "
            "flow.init_cond_dropout=0: its warm start never trained that branch, so guidance subtracts a "
            "velocity it never learned. Build it with flow.init_cond_dropout above 0 (0.1, as Stable "
            "Diffusion drops 10 % of captions) or set flow.guidance_scale=1")]

    def build_model(self, cfg: Any, out: Path, on_progress: Progress | None) -> str:
        """A new tiny flow model (the flow section's size) warm-started by flow matching on drawn
        images of the train split (``tether.families.flow.warmstart``)."""
        import logging

        from tether.families.flow import scenes
        from tether.families.flow.model import FlowModelConfig
        from tether.families.flow.rollout import sampling_of
        from tether.families.flow.warmstart import flow_warmstart

        data = self.data(cfg, out)
        if cfg.flow.init_backbone == "sd3":
            return self._build_sd3(cfg, out, data, on_progress)
        config = FlowModelConfig(vocab=scenes.WORDS, width=cfg.flow.init_width, depth=cfg.flow.init_depth,
                                 patch=4)
        logging.getLogger("tether.data").info("building a flow model (width %d, depth %d); warm-starting it",
                                              config.width, config.depth)
        warm = flow_warmstart(out, config, data.train, data.eval, self.scorer(cfg), settings=cfg.warmstart,
                              seed=cfg.run.seed, threads=cfg.train.threads, eval_steps=cfg.flow.eval_steps,
                              sampling=sampling_of(cfg), cond_dropout=cfg.flow.init_cond_dropout,
                              on_progress=on_progress)
        return (f"warm start: held-out reward {warm.before['reward']:.3f} → {warm.after['reward']:.3f}, "
                f"pass@1 {100 * warm.pass_at_1_before:.1f}% → {100 * warm.pass_at_1_after:.1f}% in "
                f"{warm.steps} steps, {warm.seconds:.0f}s")

    def _build_sd3(self, cfg: Any, out: Path, data: Any, on_progress: Progress | None) -> str:
        """A tiny SD3 pipeline, its VAE trained on drawn scenes and its transformer warm-started
        (``tether.families.flow.sd3_warmstart``)."""
        import logging

        from tether.families.flow.sd3_warmstart import sd3_warmstart

        logging.getLogger("tether.data").info(
            "building a tiny SD3 pipeline (width %d, depth %d); training its VAE until its "
            "reconstructions earn %g (at most %d steps), then warm-starting its transformer",
            cfg.flow.init_width, cfg.flow.init_depth, cfg.flow.init_vae_reward, cfg.flow.init_vae_steps)
        warm = sd3_warmstart(out, data.train, data.eval, self.scorer(cfg), cfg, on_progress=on_progress)
        return (f"warm start: held-out reward {warm.before['reward']:.3f} → {warm.after['reward']:.3f}, "
                f"pass@1 {100 * warm.pass_at_1_before:.1f}% → {100 * warm.pass_at_1_after:.1f}% in "
                f"{warm.steps} steps, {warm.seconds:.0f}s")

    def build_differences(self, cfg: Any, path: Path) -> list[str]:
        from tether.config.features import changed_keys
        from tether.data.prepare import built_settings
        from tether.families.flow.model import read_config
        from tether.families.flow.pipeline import is_pipeline

        built = built_settings(path)
        if not built:  # a user's pipeline is used as it is: the build keys the recipe sets do nothing
            return changed_keys(cfg, (f"flow.{key}" for key in BUILD_KEYS))
        if is_pipeline(path):  # one flow.init_backbone=sd3 built
            return [f"flow.{key}: built with {built[field]}, the recipe says {getattr(cfg.flow, key)}"
                    for key, field in BUILD_KEYS.items()
                    if field in built and built[field] != getattr(cfg.flow, key)]
        config = read_config(path)
        return [f"flow.{key}: built with {have}, the recipe says {getattr(cfg.flow, key)}"
                for key, have in (("init_backbone", "dit"), ("init_width", config.width),
                                  ("init_depth", config.depth),
                                  ("init_cond_dropout", built.get("cond_dropout", 0.0)))
                if have != getattr(cfg.flow, key)]

    def scorer(self, cfg: Any) -> Any:
        from tether.families.flow.task import flow_scorer

        return flow_scorer(cfg)

    def data(self, cfg: Any, model_path: Path) -> DataBundle:
        from tether.families.flow.task import flow_data

        return flow_data(cfg)

    def sampler(self, cfg: Any, model_path: str, stop_text: str, *, device: Any, threads: int, seed: int):
        from tether.families.flow.rollout import FlowSampler

        return FlowSampler(cfg, model_path, device=device)

    def policy(self, cfg: Any):
        from tether.families.flow.learn import FlowPolicy

        return FlowPolicy(cfg.flow.train_steps, cfg.flow.train_step_choice, cfg.flow.kl_units,
                          cfg_grad=cfg.flow.cfg_grad, cfg=cfg)

    def evaluator(self, cfg: Any, model: Any, tokenizer: Any, data: DataBundle, score: Any, *,
                  num_samples: int | None = None, run_dir: Path | None = None):
        """Held-out reward; with ``run_dir``, pictures of the fixed held-out prompts at every
        evaluation (``samples/``, which ``tether report`` lays out)."""
        from tether.families.flow.evaluate import FlowEvaluator
        from tether.families.flow.rollout import sampling_of

        k = cfg.eval.num_samples if num_samples is None else num_samples
        model.attach_pipeline()  # the learner's pipeline model is its transformer alone
        return FlowEvaluator(model, data.eval, score, eval_steps=cfg.flow.eval_steps,
                             sampling=sampling_of(cfg, model), seed=cfg.eval_seed, num_samples=k,
                             images_to=None if run_dir is None else run_dir / "samples",
                             negative_prompt=cfg.flow.negative_prompt)

    def eval_summary(self, cfg: Any, metrics: Mapping[str, float], samples: int) -> list[str]:
        return [f"  ODE ({cfg.flow.eval_steps} steps): pass@1 {metrics['eval/pass_at_1']:.1%}, mean reward "
                f"{metrics['eval/reward_mean']:.3f}",
                f"  {cfg.flow.sde_type.upper()} ({cfg.flow.steps} steps, noise {cfg.flow.noise_level:g}): "
                f"pass@1 {metrics['eval/sampled_pass_at_1']:.1%}, mean reward "
                f"{metrics['eval/sampled_reward_mean']:.3f}  ({samples} per prompt)"]

    def report(self, run_dir: Path, evals: list[dict[str, Any]], out: Path) -> list[Path]:
        """``samples.png``: the held-out prompts' images at evaluations across the run."""
        from tether.families.flow.evaluate import report_samples

        pictures = sorted((run_dir / "samples").glob("step_*.png"))
        return [report_samples(pictures, evals, out / "samples.png")] if pictures else []


def sd3_to_build(cfg: Any) -> bool:
    """Whether ``model.create_if_missing`` will build the tiny SD3 pipeline at ``model.path``
    (``flow.init_backbone: sd3``, nothing there yet): the settings of a pipeline apply to it."""
    path = Path(cfg.model.path)
    empty = not path.exists() or (path.is_dir() and not any(path.iterdir()))
    return bool(cfg.model.create_if_missing) and cfg.flow.init_backbone == "sd3" and empty


def trained_steps(flow: FlowSection) -> int:
    """K: the steps of each trajectory the learner trains: ``flow.train_steps``, else the SDE
    window's, else all ``flow.steps``."""
    return flow.train_steps or flow.sde_window or flow.steps


def check_window(flow: FlowSection) -> None:
    """Refuse an SDE window or trained steps that do not fit the trajectory, naming the keys."""
    if flow.sde_window > flow.steps:
        raise ConfigError(f"flow.sde_window={flow.sde_window} exceeds the flow.steps={flow.steps} steps of "
                          "a trajectory; lower it (0 makes every step an SDE step)")
    if flow.sde_window_range and not flow.sde_window:
        raise ConfigError(f"flow.sde_window_range={flow.sde_window_range} places an SDE window, but "
                          "flow.sde_window is 0 (every step is an SDE step): set flow.sde_window, or drop "
                          "flow.sde_window_range")
    if flow.sde_window_range and not flow.sde_window <= flow.sde_window_range <= flow.steps:
        raise ConfigError(f"flow.sde_window_range={flow.sde_window_range} must hold the flow.sde_window="
                          f"{flow.sde_window} steps and lie within the flow.steps={flow.steps} of a "
                          f"trajectory: set it from {flow.sde_window} to {flow.steps} (0 = anywhere)")
    if flow.sde_window_slide and not 0 < flow.sde_window < flow.steps:
        raise ConfigError(f"flow.sde_window_slide={flow.sde_window_slide} slides an SDE window, but "
                          f"flow.sde_window={flow.sde_window} of flow.steps={flow.steps} leaves nothing to "
                          "slide: set flow.sde_window below flow.steps, or drop flow.sde_window_slide")
    if flow.sde_window and flow.train_steps > flow.sde_window:
        raise ConfigError(f"flow.train_steps={flow.train_steps} exceeds the flow.sde_window="
                          f"{flow.sde_window} SDE steps of a trajectory (the only steps that are actions, "
                          "with log-probabilities): lower it, or set 0 to train every step of the window")
    if flow.train_steps > flow.steps:
        raise ConfigError(f"flow.train_steps={flow.train_steps} exceeds the flow.steps="
                          f"{flow.steps} steps of a trajectory; lower it (0 trains all of them)")
    windowed = 0 < flow.sde_window < flow.steps
    if flow.sde_type == "cps" and (not windowed or (flow.sde_window_range or flow.steps) == flow.steps):
        last = flow.steps - 1
        where = (f"the flow.sde_window of {flow.sde_window} can reach it" if windowed
                 else "every step is an SDE step (flow.sde_window=0)")
        raise ConfigError(
            f"flow.sde_type=cps: the last step, into t = 0, has no noise (s·sin(a·π/2) = 0 at s = 0), so it "
            f"is the ODE's step and no policy action, but {where}: keep the window off it with "
            f"flow.sde_window_range={last} (or less); every other step: flow.sde_window={last} "
            f"flow.sde_window_range={last}")


FAMILY = FlowFamily()
