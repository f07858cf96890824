"""Sections for the work around a run rather than in it: the supervised warm start that prepares a
model (``warmstart``) and the timings of ``tether plan``'s simulation (``plan``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from tether.config.fields import Resume, knob


@dataclass(frozen=True)
class WarmstartSection:
    """Supervised warm start on demonstrations, so RL starts from a non-trivial pass rate."""

    RESUME: ClassVar[Resume] = Resume.ACCEPTED

    target_pass_rate: float = knob(
        0.3, "Stop once held-out greedy pass@1 reaches this (leaves room for RL to show).", min=0, max=1
    )
    max_steps: int = knob(1500, "Most supervised steps.", min=1)
    max_seconds: float = knob(
        3600.0,
        "A safety ceiling on the warm start's seconds, far above what it takes: the warm start is "
        "decided by warmstart.max_steps and target_pass_rate, so the same model comes out on any "
        "machine; if this fires, the run says so (the model then depends on the machine's speed).",
        min=1,
    )
    batch_size: int = knob(64, "Demonstrations per step.", min=1)
    lr: float = knob(3e-3, "AdamW learning rate.", min=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = knob(
        "constant",
        "The warm start's learning rate: 'constant' at warmstart.lr, or decayed 'linear'ly or along a "
        "'cosine' to warmstart.lr × warmstart.min_lr_ratio at warmstart.max_steps. A model left at a "
        "high constant rate stops at a noisy point whose held-out figures any later training at a "
        "lower rate raises, RL or not (docs/benchmarks.md, the SD3 demo); a decay ends it settled.",
    )
    min_lr_ratio: float = knob(
        0.0, "Where a decaying warmstart.lr_schedule ends, as a fraction of warmstart.lr.", min=0, max=1
    )
    eval_every: int = knob(25, "Check held-out pass@1 every this many steps.", min=1)


@dataclass(frozen=True)
class PlanSection:
    """Timings for `tether plan`'s virtual-time simulation (not used by training)."""

    RESUME: ClassVar[Resume] = Resume.ACCEPTED

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
    seed: int = knob(0, "Seed for the generation-time jitter and the sequence lengths.", min=0)
    mean_length: float = knob(
        0.0,
        "Mean completion length in tokens (a run's response/length_mean); > 0 models each sequence: "
        "lengths geometric, capped at rollout.max_new_tokens, with this mean, a batch decoding one step "
        "per token of its longest, a step "
        "timed so a batch takes gen_time on average. Needed to plan async.inflight_update recompute "
        "and abort (their cost depends on how far each sequence got). 0 = each batch takes gen_time "
        "(with gen_jitter).",
        min=0,
    )
    prefill_cost: float = knob(
        0.0,
        "With mean_length: seconds to run one prefix token again, as a fraction of a decode step "
        "(async.inflight_update=recompute pays it for the whole prefix at every switch).",
        min=0,
    )
    turns: float = knob(
        0.0,
        "Agent family: the turns a rollout batch of episodes takes (its longest episode's: each is one "
        "wave of environment calls); with env_time, a batch takes gen_time + turns × env_time.",
        min=0,
        owner="family",
    )
    env_time: float = knob(
        0.0,
        "Agent family: seconds a rollout batch waits on its environment per turn (the slowest call of "
        "each wave); gen_time is then the engine's part alone.",
        min=0,
        owner="family",
    )
    train_time_steps: int = knob(
        0,
        "Flow family: the trained steps per trajectory (flow.train_steps, else flow.sde_window, else "
        "flow.steps) of the run train_time was measured on; the plan prices an update of the recipe's "
        "K trained steps at train_time × K / train_time_steps (generation, a step's cost unchanged, "
        "stays gen_time). 0 = measured at the recipe's own.",
        min=0,
        owner="family",
    )
