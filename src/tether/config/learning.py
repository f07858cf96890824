"""The learner's sections: how it trains (``train``) and the corrections on π_old/μ it applies
(``correction``). Re-exported by ``tether.config.schema``, which lists every section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tether import registry
from tether.config.fields import Resume, knob
from tether.errors import ConfigError

FROM_PRESET = "null = from train.algorithm"


@dataclass(frozen=True)
class TrainSection:
    """The learner: schedule, algorithm, optimizer."""

    num_batches: int = knob(
        20, "Rollout batches to train on in the whole run.", min=1,
        resume=Resume.ACCEPTED,
    )
    updates_per_batch: int = knob(
        1,
        "U: optimizer updates made from one rollout batch (it is split into U mini-batches).",
        min=1,
        resume=Resume.SCHEDULE,
    )
    algorithm: Literal["grpo", "dapo", "dr_grpo", "gspo", "cispo", "flow_grpo"] = knob(
        "dapo",
        "Preset of loss, aggregation, clip range and advantage settings from its paper (see "
        "docs/training.md; flow_grpo also sets Flow-GRPO's anchor, updates per batch, lr, weight decay, EMA, "
        "LoRA and timestep fraction); any of those keys set explicitly wins over the preset.",
    )
    loss: str | None = knob(None, f"Policy loss ({FROM_PRESET}).", choices=registry.losses)
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                         "seq_mean_token_sum_norm"] | None = knob(
        None, f"How per-token losses reduce to one number ({FROM_PRESET})."
    )
    clip_low: float | None = knob(None, f"ε_low: the ratio is clipped at 1 − ε_low ({FROM_PRESET}).", min=0)
    clip_high: float | None = knob(
        None, f"ε_high: the ratio is clipped at 1 + ε_high ({FROM_PRESET}).", min=0
    )
    dual_clip: float | None = knob(
        None, f"Dual clip c > 1 bounds negative-advantage losses at c·|A|; 0 = off ({FROM_PRESET}).", min=0
    )
    advantage: str = knob(
        "grpo",
        "Advantage estimator: 'grpo' (reward minus its group's mean, optionally over the std), "
        "'rloo' (reward minus the mean of the other samples of its prompt, not normalised) or "
        "'reinforce_pp' (REINFORCE++: reward minus the batch mean, over the batch std). See "
        "docs/training.md.",
        choices=registry.advantages,
    )
    adv_std_norm: bool | None = knob(
        None, "With an advantage estimator registered with std_norm=True (grpo): divide advantages by the "
        f"reward std ({FROM_PRESET}); refused with the others, whose normalisation is their own."
    )
    mask_truncated: bool = knob(
        False,
        "Leave completions cut off at rollout.max_new_tokens out of the loss (DAPO's overlong "
        "filtering, TRL's mask_truncated_completions); they still count in their group's baseline.",
        feature="truncation",
    )
    adv_scope: Literal["group", "batch"] | None = knob(
        None, "With an estimator registered with std_norm=True (grpo): whose std normalises advantages, each "
        "prompt group's or "
        f"the whole batch's ('batch' is REINFORCE++-baseline; {FROM_PRESET})."
    )
    adv_clip: float | None = knob(
        None, "Clamp every advantage to [−c, c] after the estimator (Flow-GRPO's reference: 5); the share "
              f"clamped is train/adv_clipped_frac. 0 = off ({FROM_PRESET}).", min=0
    )
    drop_zero_std: bool | None = knob(
        None, f"Drop groups whose rewards are all equal from the loss ({FROM_PRESET})."
    )
    kl_coef: float | None = knob(
        None, f"β of a KL penalty to the frozen initial model; 0 = off ({FROM_PRESET}).", min=0
    )
    kl_estimator: str | None = knob(None, f"KL estimator ({FROM_PRESET}).", choices=registry.kl_estimators)
    anchor: Literal["behavior", "proximal"] = knob(
        "proximal",
        "What the ratio is taken against: 'behavior' = the engine's log-probs μ directly; "
        "'proximal' = the trainer's recomputation π_prox at the start of each batch, with the loss "
        "weighted by π_prox/μ (decoupled PPO, as in AReaL).",
    )
    lr: float = knob(1e-6, "AdamW learning rate after warm-up.", min=0)
    warmup_steps: int = knob(0, "Optimizer updates of linear warm-up from 0 to train.lr.", min=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = knob(
        "constant",
        "Learning rate after warm-up: 'constant' at train.lr, or decayed 'linear'ly or along a "
        "'cosine' to train.lr × train.min_lr_ratio at the run's last planned update "
        "(train.num_batches × train.updates_per_batch).",
    )
    min_lr_ratio: float = knob(
        0.0, "Where a decaying train.lr_schedule ends, as a fraction of train.lr.", min=0, max=1
    )
    weight_decay: float = knob(0.0, "AdamW weight decay.", min=0)
    adam_beta1: float = knob(0.9, "AdamW β1.", min=0, max=1)
    adam_beta2: float = knob(0.999, "AdamW β2.", min=0, max=1)
    grad_clip: float = knob(1.0, "Clip the gradient's global norm to this (0 = off).", min=0)
    ema_decay: float = knob(
        0.0,
        "Keep an exponential moving average of the trained weights (Flow-GRPO's EMA) and evaluate on it: "
        "after optimizer update n (0-based) with n + 1 a multiple of train.ema_every, ema ← ema + (1 − d)"
        "·(θ − ema), d = min((1 + n)/(10 + n), train.ema_decay). Rollouts and updates use the trained "
        "weights; checkpoints hold both. 0 = off; below 1 (docs/training.md, 'EMA').",
        min=0,
    )
    ema_every: int = knob(
        1, "Optimizer updates between two EMA updates (Flow-GRPO's 8); needs train.ema_decay.", min=1
    )
    micro_batch_size: int = knob(
        0, "Sequences per forward/backward inside a mini-batch (gradient accumulation); 0 = all. The "
        "update is the same whatever it is (to float32 rounding), so a resume may change it.", min=0,
        resume=Resume.ACCEPTED,
    )
    max_tokens_per_micro_batch: int = knob(
        0,
        "Pack each mini-batch's sequences into micro-batches by tokens instead of train.micro_batch_size "
        "sequences: longest first, at most this many tokens a forward (rows × the longest row with the "
        "model's own forward; each group's prompt once plus its completions with the shared-prompt one). "
        "The same update; at least the longest sequence a run can produce (data.max_prompt_tokens + "
        "rollout.max_new_tokens); 0 = off (docs/training.md).",
        min=0, resume=Resume.ACCEPTED, feature="token_budget",
    )
    threads: int = knob(
        1, "torch threads in the trainer process (in each rank's, with world_size > 1).", min=1,
        resume=Resume.ACCEPTED,
    )
    world_size: int = knob(
        1,
        "Learner ranks: 1 = one process (the driver's, or ray.learner=actor's). N > 1 = N ranks training "
        "one FSDP2-sharded model (gloo on CPU; NCCL on GPUs): processes of this machine (rank r on "
        "cuda:r), or with ray.learner=actor one Ray actor per rank. Each mini-batch is split across them "
        "by whole prompt groups, with the single-process update (docs/distributed.md); every mini-batch "
        "needs at least N prompt groups.",
        min=1,
        resume=Resume.ACCEPTED, feature="learner_ranks",
    )
    lora_rank: int = knob(
        0,
        "LoRA (through PEFT): train rank-r adapters on the targeted linear layers instead of every "
        "weight, publish only the adapters, and use the base with the adapters off as the KL reference "
        "(no second copy). 0 = train every weight (docs/lora.md).",
        min=0,
        feature="lora",
    )
    lora_alpha: float = knob(
        16.0, "LoRA's α, above 0: an adapter adds (α/r)·B·A to its layer's weight.", min=0.0
    )
    lora_dropout: float = knob(
        0.0,
        "PEFT's LoRA dropout: each adapter's input dropped at this rate in the learner's forwards (the "
        "engines never drop). The ratio's numerator then comes from a random sub-network of the policy "
        "the engine sampled, and ratio/* and mismatch/* carry that noise; every other dropout of a "
        "policy is off (docs/training.md). The learner then runs the model's own forward, not the "
        "shared-prompt one.",
        min=0.0,
        max=0.99,
    )
    lora_targets: list[str] = knob(
        ["all-linear"],
        "Which linear layers get adapters: PEFT's target_modules, names or name suffixes (q_proj, v_proj) "
        "or all-linear (every linear layer but the output head).",
    )
    activation_checkpointing: bool = knob(
        False,
        "Recompute each layer's activations in the backward (the family's layers: a language model's "
        "decoder layers, the flow transformer's blocks) instead of keeping them from the forward: the "
        "update's activation memory falls to each layer's input, for one more forward of every layer. "
        "Same gradients; forwards without gradients (π_old, the reference, evaluations) are unchanged. "
        "Learner ranks too (docs/training.md).",
        resume=Resume.ACCEPTED,
    )
    device: str = knob(
        "cpu",
        "Where the learner trains and evaluates: 'cpu', or 'cuda' / 'cuda:N' (a CUDA build of torch "
        "and a GPU; its precision is train.dtype). Publications reach the workers by rollout.weight_sync. "
        "With ray.learner=actor the actor requests one GPU.",
        resume=Resume.ACCEPTED,
    )
    dtype: Literal["float32", "bfloat16"] = knob(
        "float32",
        "The learner's compute precision. float32 = everything in float32; bfloat16 = float32 master "
        "weights and AdamW state, forwards (training, π_old, the KL reference, held-out evaluation) in "
        "bfloat16 under torch.autocast (FSDP2 ranks: MixedPrecisionPolicy), log-softmax and loss in "
        "float32. It adds a train–inference mismatch that mismatch/numeric_* report (docs/training.md, "
        "'Precision').",
        resume=Resume.ACCEPTED, feature="mixed_precision",
    )
    reduce_dtype: Literal["float32", "bfloat16"] = knob(
        "float32",
        "With train.dtype=bfloat16 and train.world_size > 1: the dtype gradients are summed over ranks "
        "in (FSDP2's reduce_dtype); bfloat16 halves that traffic and rounds each sum.",
        resume=Resume.ACCEPTED, feature="mixed_precision",
    )
    cpu_offload: bool = knob(
        False,
        "With train.world_size > 1 on CUDA: keep each rank's parameter shards, gradients and AdamW state "
        "in host memory (FSDP2's CPUOffloadPolicy), copying a unit's shards to the GPU for its forward "
        "and backward and running the optimizer step on the CPU: GPU memory for activations and the "
        "gathered units only, at the cost of host-device copies and a CPU optimizer step. Not yet run "
        "on a GPU.",
        resume=Resume.ACCEPTED, feature="learner_ranks",
    )
    shared_prefix: bool = knob(
        True,
        "Run each group's prompt once in the training forward (its samples attend to the shared "
        "prompt's keys and values) instead of once per sample: same log-probs and gradients, the "
        "prompt's work divided by the group size. Llama/Qwen2/Qwen3 models, learner ranks too "
        "(train.world_size > 1); others use their own forward (logged at start).",
        feature="shared_prefix",
    )

    def check_ema(self) -> None:
        """``train.ema_decay`` below 1, and ``train.ema_every`` only with it."""
        if self.ema_decay >= 1:
            raise ConfigError(f"train.ema_decay={self.ema_decay}: at 1 or above the average never moves "
                              "from the starting weights (or moves away from the trained ones); set it "
                              "below 1 (Flow-GRPO's 0.9), or 0 for no EMA")
        if self.ema_every != 1 and not self.ema_decay:
            raise ConfigError(f"train.ema_every={self.ema_every} has no effect with train.ema_decay=0 (no "
                              "EMA is kept); set train.ema_decay, or remove train.ema_every")


@dataclass(frozen=True)
class CorrectionSection:
    """Corrections on π_old/μ, the trainer's recomputation against the engine's log-probs."""

    tis: Literal["none", "token", "sequence"] = knob(
        "token",
        "Truncated importance sampling of the proximal anchor's weight π_prox/μ: per token, per "
        "sequence, or 'none' (the full weight). Needs train.anchor=proximal.",
    )
    tis_cap: float = knob(2.0, "Upper cap of the truncated weight.", min=1)
    mask: Literal["none", "token", "sequence", "geometric"] = knob(
        "none",
        "Mask tokens whose ρ = π_old/μ is outside [mask_low, mask_high] ('token'), or whole "
        "sequences by the product ('sequence') or geometric mean ('geometric') of ρ.",
    )
    mask_low: float = knob(0.5, "Lower bound of the kept ρ.", min=0)
    mask_high: float = knob(2.0, "Upper bound of the kept ρ.", min=1)
    outlier_token: float = knob(
        0.0, "T > 1 masks any sequence holding a token with ρ > T or ρ < 1/T (0 = off).", min=0
    )
