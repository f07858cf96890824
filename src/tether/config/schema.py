"""Every recipe key: sections, defaults, allowed values, and one sentence on what each does.

``docs/reference.md`` is generated from this file (``tether config reference``); a test keeps
the two in step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tether.config.fields import knob


@dataclass(frozen=True)
class RunSection:
    """The run as a whole."""

    seed: int = knob(0, "Seed for every random choice Tether makes (data order, sampling, init).", min=0)
    wandb_project: str = knob(
        "",
        "Also log to Weights & Biases under this project (needs `pip install wandb`; set "
        "WANDB_MODE=offline where there is no network). Empty = off.",
    )


@dataclass(frozen=True)
class AsyncSection:
    """Asynchrony: how far generation may run ahead of training."""

    max_staleness: int = knob(
        1,
        "S, in whole rollout batches: how many batches old the policy that generated a batch may "
        "be when that batch trains. 0 is synchronous (exactly on-policy); the budget in updates is "
        "S × train.updates_per_batch and S + 1 batches may be outstanding per published snapshot.",
        min=0,
    )
    max_inflight: int = knob(
        2,
        "Generations (rollout batches) that may run concurrently. More than max_staleness + 1 is "
        "never used.",
        min=1,
    )
    on_stale: Literal["error", "drop"] = knob(
        "error",
        "What to do with a batch above the staleness budget when it reaches the trainer: 'error' "
        "fails closed; 'drop' drops it, counts it (async/dropped_batches) and logs it.",
    )
    max_consecutive_drops: int = knob(
        16,
        "With on_stale=drop: fail the run after this many stale batches in a row instead of "
        "dropping forever (admission makes stale batches impossible unless something is broken).",
        min=1,
    )
    sync_when_idle: bool = knob(
        False,
        "Also publish weights after any step at which no generation is in flight and the trainer "
        "has new weights (sync reason 'idle'), not only when the budget or an eval/save forces it. "
        "It never waits for generation and lowers staleness; at S >= 1 with training the slower "
        "side it keeps the generator busy (see docs/concepts.md). Costs one publication per such step.",
    )
    wait_timeout_s: float = knob(
        600.0,
        "Seconds the trainer waits for a rollout batch (also each batch a sync drains) before "
        "failing the run with an error that names the worker and the batch; outstanding work is then "
        "abandoned at once.",
        min=0.001,
    )


FROM_PRESET = "null = from train.algorithm"


@dataclass(frozen=True)
class TrainSection:
    """The learner: schedule, algorithm, optimizer."""

    num_batches: int = knob(20, "Rollout batches to train on in the whole run.", min=1)
    updates_per_batch: int = knob(
        1,
        "U: optimizer updates made from one rollout batch (it is split into U mini-batches).",
        min=1,
    )
    algorithm: Literal["grpo", "dapo", "dr_grpo", "gspo", "cispo"] = knob(
        "dapo",
        "Preset of loss, aggregation, clip range and advantage settings from its paper (see "
        "docs/training.md); any of those keys set explicitly wins over the preset.",
    )
    loss: Literal["ppo_clip", "gspo", "cispo"] | None = knob(None, f"Policy loss ({FROM_PRESET}).")
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
    advantage: Literal["grpo", "rloo", "reinforce_pp"] = knob(
        "grpo",
        "Advantage estimator: 'grpo' (reward minus its group's mean, optionally over the std), "
        "'rloo' (reward minus the mean of the other samples of its prompt, not normalised) or "
        "'reinforce_pp' (REINFORCE++: reward minus the batch mean, over the batch std). See "
        "docs/training.md.",
    )
    adv_std_norm: bool | None = knob(
        None, f"With train.advantage=grpo: divide advantages by the reward std ({FROM_PRESET})."
    )
    mask_truncated: bool = knob(
        False,
        "Leave completions cut off at rollout.max_new_tokens out of the loss (DAPO's overlong "
        "filtering, TRL's mask_truncated_completions); they still count in their group's baseline.",
    )
    adv_scope: Literal["group", "batch"] = knob(
        "group", "With train.advantage=grpo: whose std normalises advantages, each prompt group's or "
        "the whole batch's ('batch' is REINFORCE++-baseline)."
    )
    drop_zero_std: bool | None = knob(
        None, f"Drop groups whose rewards are all equal from the loss ({FROM_PRESET})."
    )
    kl_coef: float | None = knob(
        None, f"β of a KL penalty to the frozen initial model; 0 = off ({FROM_PRESET}).", min=0
    )
    kl_estimator: Literal["k1", "k2", "k3"] | None = knob(None, f"KL estimator ({FROM_PRESET}).")
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
    micro_batch_size: int = knob(
        0, "Sequences per forward/backward inside a mini-batch (gradient accumulation); 0 = all.", min=0
    )
    threads: int = knob(
        1, "torch threads in the trainer process (in each rank's, with world_size > 1).", min=1
    )
    world_size: int = knob(
        1,
        "Learner ranks: 1 = one process (the driver's, or ray.learner=actor's). N > 1 = N ranks training "
        "one FSDP2-sharded model (gloo on CPU; NCCL on GPUs): processes of this machine (rank r on "
        "cuda:r), or with ray.learner=actor one Ray actor per rank. Each mini-batch is split across them "
        "by whole prompt groups, with the single-process update (docs/distributed.md); every mini-batch "
        "needs at least N prompt groups.",
        min=1,
    )
    device: str = knob(
        "cpu",
        "Where the learner trains and evaluates: 'cpu', or 'cuda' / 'cuda:N' (a CUDA build of torch "
        "and a GPU; float32). Each publication copies the weights to host memory for the workers. "
        "With ray.learner=actor the actor requests one GPU.",
    )
    shared_prefix: bool = knob(
        True,
        "Run each group's prompt once in the training forward (its samples attend to the shared "
        "prompt's keys and values) instead of once per sample: same log-probs and gradients, the "
        "prompt's work divided by the group size. Llama/Qwen2/Qwen3 models; others use their own "
        "forward (logged at start).",
    )


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


@dataclass(frozen=True)
class RolloutSection:
    """What one rollout batch is and who generates it."""

    batch_size: int = knob(8, "Prompts per rollout batch.", min=1)
    group_size: int = knob(4, "Samples per prompt; advantages are relative within a group.", min=1)
    num_workers: int = knob(1, "Rollout workers (engines) generating concurrently.", min=1)
    backend: Literal["local", "ray"] = knob(
        "local",
        "Where rollout workers run: 'local' = worker processes on this machine, weights through "
        "shared memory; 'ray' = Ray actors (see the ray section and docs/distributed.md), weights "
        "through Ray's object store. The learner runs in the driver process unless ray.learner=actor.",
    )
    threads_per_worker: int = knob(
        1, "torch threads in each rollout worker (on 2 cores: 1 for generation, 1 for training).", min=1
    )
    engine: Literal["torch", "vllm"] = knob(
        "torch",
        "What generates in each worker: 'torch' = the built-in PyTorch engine (any Hugging Face causal "
        "LM; right for tiny models and tests); 'vllm' = vLLM (paged attention, continuous batching; "
        "needs vLLM installed: `make vllm` on CPU, `pip install 'tether[vllm]'` on GPUs; see the vllm "
        "section and docs/rollout.md). Both return the log-probs of the distribution they sample from.",
    )
    dynamic_sampling: bool = knob(
        False,
        "DAPO's dynamic sampling: a rollout batch is complete only when it holds batch_size prompt "
        "groups whose rewards are not all equal; the worker draws further prompts (from the batch's "
        "own slice of a second pass over the data, so resume stays exact) until it does. Reported as "
        "rollout/prompts_drawn and rollout/filtered_groups.",
    )
    dynamic_sampling_max_draws: int = knob(
        3,
        "With dynamic_sampling: a batch generates at most this many times batch_size prompts in all "
        "(DAPO's max_num_gen_batches).",
        min=2,
    )
    dynamic_sampling_on_short: Literal["error", "partial"] = knob(
        "error",
        "With dynamic_sampling, when the draws run out first: 'error' fails the run naming the batch; "
        "'partial' completes the batch with zero-variance groups it drew (rollout/short_groups).",
    )
    max_new_tokens: int = knob(32, "Most tokens sampled per completion.", min=1)
    temperature: float = knob(
        1.0, "Sampling temperature (> 0); the trainer's log-probs use the same temperature.", min=1e-6
    )
    top_k: int = knob(0, "Sample from the k most likely tokens only (0 = off).", min=0)
    top_p: float = knob(
        1.0, "Sample from the smallest set of tokens whose probability reaches p (1 = off).", min=1e-6, max=1
    )


@dataclass(frozen=True)
class EvalSection:
    """Held-out evaluation at hard boundaries."""

    interval: int = knob(
        0,
        "Evaluate every this many trained batches, and at the end (0 = off). Each evaluation is a "
        "hard boundary: in-flight work is drained and the current weights published first.",
        min=0,
    )
    num_samples: int = knob(
        1,
        "Completions sampled per held-out prompt (at the rollout settings) besides the greedy one: "
        "eval/sampled_reward_mean is their mean (mean@k), eval/sampled_pass_at_1 the share fully "
        "right and, above 1, eval/pass_at_k the share of prompts with at least one fully right.",
        min=1,
    )


@dataclass(frozen=True)
class CheckpointSection:
    """Checkpoints at hard boundaries."""

    interval: int = knob(
        0,
        "Save every this many trained batches, and at the end (0 = off). Each save is a hard "
        "boundary: in-flight work is drained and the current weights published first.",
        min=0,
    )
    keep: int = knob(3, "Keep the newest this many checkpoints (0 = keep all).", min=0)
    sharded: bool = knob(
        False,
        "With train.world_size > 1: each rank writes its own shards of the model and optimizer "
        "(torch.distributed.checkpoint), so no process ever holds the whole state; a resume at any "
        "world size reshards them, and `tether eval` and model.path read them. false = gathered "
        "whole on rank 0 into the single-process format.",
    )


@dataclass(frozen=True)
class ModelSection:
    """The policy model: any local Hugging Face causal LM directory."""

    path: str = knob(
        "runs/models/demo-small",
        "Local directory holding the model and tokenizer (loaded with AutoModelForCausalLM and "
        "AutoTokenizer, offline). A real checkpoint works as well as a tiny one.",
    )
    create_if_missing: bool = knob(
        False,
        "When model.path does not exist, build a tiny model there (model.init_arch, "
        "model.init_size) and warm-start it on the recipe's data (the warmstart section).",
    )
    init_arch: Literal["qwen3", "llama"] = knob(
        "qwen3", "Architecture of a model built by create_if_missing."
    )
    init_size: Literal["tiny", "small", "base"] = knob(
        "small", "Size preset of a built model: tiny ≈ 0.1M, small ≈ 3M, base ≈ 25M parameters."
    )


@dataclass(frozen=True)
class DataSection:
    """Prompts and reference answers: a built-in task or a local dataset."""

    task: str = knob(
        "arithmetic",
        "Built-in task (arithmetic, countdown, reverse, sort; see `tether tasks`). Set it to '' "
        "when data.dataset is used.",
    )
    difficulty: int = knob(0, "Difficulty of the built-in task (0 = the task's default).", min=0)
    dataset: str = knob(
        "",
        "Local dataset instead of a task: a .jsonl, .json, .parquet or .csv file, a folder written "
        "by datasets' save_to_disk (FOLDER#SPLIT picks a split), or path/to/file.py:function "
        "returning rows.",
    )
    eval_dataset: str = knob(
        "",
        "Held-out dataset in the same forms. Empty with data.dataset set: the last data.num_eval "
        "rows (after a seeded shuffle) are held out.",
    )
    prompt_column: str = knob("prompt", "Dataset column holding the prompt text.")
    answer_column: str = knob("answer", "Dataset column holding the reference answer.")
    chat_template: bool = knob(
        False, "Wrap each prompt as a user turn with the tokenizer's chat template (it must have one)."
    )
    max_prompt_tokens: int = knob(128, "Longest prompt, in tokens.", min=1)
    on_long_prompt: Literal["skip", "error"] = knob(
        "skip", "A prompt over max_prompt_tokens is skipped and counted ('skip'), or fails the run ('error')."
    )
    num_train: int = knob(5000, "Training examples to generate from a built-in task.", min=1)
    num_eval: int = knob(200, "Held-out examples to evaluate on.", min=1)


@dataclass(frozen=True)
class RewardSection:
    """How completions are scored (inside the rollout workers) and shaped (by the learner)."""

    function: str = knob(
        "task",
        "'task' (the built-in task's verifier), exact_match, numeric_match, math (needs the math "
        "extra), or path/to/file.py:function with signature (prompt, completion, answer, fields) -> float.",
    )
    on_error: Literal["raise", "zero"] = knob(
        "raise",
        "A reward function that raises or returns a non-finite value: fail the batch and the run "
        "('raise'), or score that sample 0 and count it in reward/errors ('zero').",
    )
    overlong_buffer: int = knob(
        0,
        "DAPO's soft overlong punishment: over the last this many tokens before "
        "rollout.max_new_tokens, a completion's reward falls linearly by up to "
        "reward.overlong_penalty (added by the learner before advantages). 0 = off.",
        min=0,
    )
    overlong_penalty: float = knob(
        1.0, "The punishment at rollout.max_new_tokens, with reward.overlong_buffer set.", min=0
    )


@dataclass(frozen=True)
class WarmstartSection:
    """Supervised warm start on demonstrations, so RL starts from a non-trivial pass rate."""

    target_pass_rate: float = knob(
        0.3, "Stop once held-out greedy pass@1 reaches this (leaves room for RL to show).", min=0, max=1
    )
    max_steps: int = knob(1500, "Most supervised steps.", min=1)
    max_seconds: float = knob(170.0, "Stop after this many seconds of training.", min=1)
    batch_size: int = knob(64, "Demonstrations per step.", min=1)
    lr: float = knob(3e-3, "AdamW learning rate.", min=0)
    eval_every: int = knob(25, "Check held-out pass@1 every this many steps.", min=1)


@dataclass(frozen=True)
class PlanSection:
    """Timings for `tether plan`'s virtual-time simulation (not used by training)."""

    gen_time: float = knob(1.0, "Seconds to generate and score one rollout batch on one engine.", min=0)
    gen_jitter: float = knob(
        0.0, "Coefficient of variation of generation time (lognormal); 0 = constant.", min=0
    )
    train_time: float = knob(1.0, "Seconds per optimizer update.", min=0)
    sync_time: float = knob(0.0, "Seconds to publish weights to the engines.", min=0)
    eval_time: float = knob(0.0, "Seconds per evaluation.", min=0)
    save_time: float = knob(0.0, "Seconds per checkpoint.", min=0)
    commits: list[int] = knob(
        [],
        "Committed updates per consumed batch, cycled (e.g. [2, 1, 2]); empty = always U. Models "
        "steps whose non-finite gradients were skipped.",
        min=0,
    )
    seed: int = knob(0, "Seed for the generation-time jitter.", min=0)


@dataclass(frozen=True)
class RaySection:
    """The Ray backend (used when rollout.backend=ray)."""

    address: str = knob(
        "",
        "Ray cluster to connect to ('auto', 'host:6379' or 'ray://host:10001'); empty = start a "
        "local Ray instance for this run (no dashboard, no usage reporting, temp dir in the run "
        "directory) and shut it down at the end.",
    )
    local_cpus: int = knob(
        0, "CPUs the local Ray instance offers (0 = all of this machine's). Ignored with ray.address.",
        min=0,
    )
    cpus_per_worker: float = knob(
        0.0, "CPUs each rollout actor requests (0 = rollout.threads_per_worker).", min=0
    )
    learner: Literal["driver", "actor"] = knob(
        "driver",
        "Where the learner (and held-out evaluation) runs: 'driver' = in the `tether train` "
        "process; 'actor' = in a Ray actor of its own requesting train.threads CPUs, its weights "
        "going straight from it to the object store. With 'actor' on a cluster, the run directory "
        "must be on a filesystem the learner's node sees (it writes the checkpoints).",
    )
    learner_placement: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = knob(
        "PACK",
        "With ray.learner=actor and train.world_size > 1: the Ray placement group strategy of the "
        "ranks' bundles (train.threads CPUs each, plus one GPU when train.device is CUDA), reserved "
        "together before any rank starts. PACK = as few nodes as fit (one node's fast links when it "
        "has room); STRICT_PACK = one node or refuse; SPREAD / STRICT_SPREAD = across nodes.",
    )
    gpus_per_worker: float = knob(
        0.0,
        "GPUs each rollout actor requests; above 0 the actor's engine samples on its GPU (CUDA, "
        "float32 weights copied in at every publication; fractions share a GPU). 0 = sample on "
        "CPUs. The learner trains where train.device says.",
        min=0,
    )


@dataclass(frozen=True)
class VllmSection:
    """The vLLM engine (used when rollout.engine=vllm)."""

    dtype: Literal["float32", "bfloat16", "float16"] = knob(
        "float32",
        "Weights and activations in vLLM. float32 = the learner's precision, so the engine's log-probs "
        "are the learner's to ~1e-6; bfloat16 is faster on GPUs and adds a train–inference mismatch "
        "that mismatch/numeric_* report and correction.* are for. (vLLM's own 'auto' would run a "
        "float32 model in bfloat16, so Tether asks for a dtype.)",
    )
    gpu_memory_utilization: float = knob(
        0.9, "Share of its GPU's memory vLLM may take for weights and KV cache (GPU only).", min=0.05, max=1
    )
    cpu_kv_cache_gb: float = knob(
        1.0, "GiB of memory for vLLM's KV cache when it samples on CPU (VLLM_CPU_KVCACHE_SPACE).", min=0.1
    )
    enforce_eager: bool = knob(
        True,
        "Run the model eagerly; false lets vLLM capture CUDA graphs / compile (faster decoding on "
        "a GPU, a slower start).",
    )
    enable_prefix_caching: bool = knob(
        True,
        "Share the KV cache of a prompt's prefix between its group's samples; the cache is reset at "
        "every publication, so nothing computed under older weights is reused.",
    )


SECTIONS: dict[str, type] = {
    "run": RunSection,
    "async": AsyncSection,
    "train": TrainSection,
    "rollout": RolloutSection,
    "ray": RaySection,
    "vllm": VllmSection,
    "eval": EvalSection,
    "checkpoint": CheckpointSection,
    "correction": CorrectionSection,
    "model": ModelSection,
    "data": DataSection,
    "reward": RewardSection,
    "warmstart": WarmstartSection,
    "plan": PlanSection,
}
"""Section name → section class, in the order the reference documents them."""
