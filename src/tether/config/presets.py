"""Algorithm presets: named bundles of loss, aggregation, clip range and advantage settings.

Each follows its paper; any key set in the recipe wins over the preset, and the resolved values
are what the run's config records.

| preset | loss | aggregation | ε_low / ε_high | std norm | drop 0-std groups | KL |
|---|---|---|---|---|---|---|
| grpo (Shao et al. 2024, DeepSeekMath) | ppo_clip | seq_mean_token_mean | 0.2 / 0.2 | yes | no | k3, β = 0.04 |
| dapo (Yu et al. 2025) | ppo_clip | token_mean | 0.2 / 0.28 (clip-higher) | yes | yes (dynamic sampling) | none |
| dr_grpo (Liu et al. 2025) | ppo_clip | seq_mean_token_sum_norm | 0.2 / 0.2 | no | no | none |
| gspo (Zheng et al. 2025) | gspo | seq_mean_token_mean | 3e-4 / 4e-4 | yes | no | none |
| cispo (MiniMax-M1, 2025) | cispo | token_mean | 1.0 / 0.28 (no lower bound) | yes | no | none |
| flow_grpo (Liu et al. 2025, Flow-GRPO's reference configs) | ppo_clip | token_mean | 1e-4 / 1e-4 | yes, over the whole batch | yes | closed form, β = 0.04; advantages clamped at ±5 |

flow_grpo is the flow family's reference setting, whole (docs/flow.md lists each key with the
reference's value and line): ``train.adv_scope: batch`` is its ``global_std``, ``train.adv_clip: 5``
its ``adv_clip_max``, its β is in the reference's KL units (``flow.kl_units: reference``, the
default); it also sets keys that have a default of their own (``Preset.sets``: the ratio against the
behaviour policy, two updates a batch, the reference's AdamW, LoRA and EMA), and the flow family takes
its timestep fraction 0.99 (``tether.families.flow.options.resolve_flow``). Every other preset
normalises per group, clamps nothing and leaves those keys at their defaults. Every preset uses
the grpo advantage; ``train.advantage`` (rloo, reinforce_pp) combines with any of them, its own
normalisation replacing the preset's std norm.

DAPO's dynamic sampling over-samples until every group has reward variance; the dapo preset drops
zero-variance groups from the loss instead, which removes the same (zero-advantage) groups without
generating more, and ``rollout.dynamic_sampling`` adds the over-sampling (``tether.rollout.dynamic``).
DAPO's overlong reward shaping is not part of the preset either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tether import registry
from tether.errors import ConfigError

if TYPE_CHECKING:
    from tether.config.config import Config
    from tether.config.schema import TrainSection


@dataclass(frozen=True)
class Preset:
    loss: str
    aggregation: str
    clip_low: float
    clip_high: float
    dual_clip: float
    adv_std_norm: bool
    drop_zero_std: bool
    kl_coef: float
    kl_estimator: str
    adv_scope: str = "group"
    adv_clip: float = 0.0
    sets: tuple[tuple[str, Any, str], ...] = ()
    """(dotted key of a core section, value, the key it follows): keys with a default of their own
    that the preset changes unless the recipe names them or the key they follow (``apply_sets``)."""


# Flow-GRPO's reference (yifan123/flow_grpo at ac4c86e): the ratio against the sampler's log-probs
# (scripts/train_sd3.py:886), so no proximal weight to truncate; two optimizer updates per sampled
# batch (config/grpo.py:48, gradient_accumulation_steps = num_batches_per_epoch // 2); AdamW at 3e-4
# with weight decay 1e-4 (config/base.py:63, 69) on LoRA adapters of rank 32, α 64
# (config/base.py:25, scripts/train_sd3.py:430-431); an EMA of the weights at decay 0.9 every 8th
# optimizer step, evaluated on (config/grpo.py:55, scripts/train_sd3.py:445, 955).
FLOW_GRPO_SETS = (("train.anchor", "behavior", ""), ("correction.tis", "none", "train.anchor"),
                  ("train.updates_per_batch", 2, ""), ("train.lr", 3e-4, ""), ("train.weight_decay", 1e-4, ""),
                  ("train.lora_rank", 32, ""), ("train.lora_alpha", 64.0, "train.lora_rank"),
                  ("train.ema_decay", 0.9, ""), ("train.ema_every", 8, "train.ema_decay"))


PRESETS: dict[str, Preset] = {
    "grpo": Preset("ppo_clip", "seq_mean_token_mean", 0.2, 0.2, 0.0, True, False, 0.04, "k3"),
    "dapo": Preset("ppo_clip", "token_mean", 0.2, 0.28, 0.0, True, True, 0.0, "k3"),
    "dr_grpo": Preset("ppo_clip", "seq_mean_token_sum_norm", 0.2, 0.2, 0.0, False, False, 0.0, "k3"),
    "gspo": Preset("gspo", "seq_mean_token_mean", 3e-4, 4e-4, 0.0, True, False, 0.0, "k3"),
    "cispo": Preset("cispo", "token_mean", 1.0, 0.28, 0.0, True, False, 0.0, "k3"),
    "flow_grpo": Preset("ppo_clip", "token_mean", 1e-4, 1e-4, 0.0, True, True, 0.04, "k3", "batch", 5.0,
                         FLOW_GRPO_SETS),
}


def preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown algorithm {name!r}; valid ones are: {', '.join(PRESETS)}") from None


def resolve_preset(train: TrainSection) -> TrainSection:
    """Fill every key left null from the ``train.algorithm`` preset."""
    p = preset(train.algorithm)
    # Whether the estimator reads train.adv_std_norm is what it declared (register_advantage's
    # std_norm). A resolved config holds adv_std_norm: false for one that does not, and every
    # process of a run resolves its config again: false is what resolution writes, so only true
    # is refused.
    std_norm = bool(registry.advantages.meta(train.advantage).get("std_norm"))
    if not std_norm and train.adv_std_norm:
        readers = [n for n in registry.advantages.names() if registry.advantages.meta(n).get("std_norm")]
        raise ConfigError(f"train.adv_std_norm has no effect with train.advantage={train.advantage} (its "
                          "normalisation is part of the estimator); leave train.adv_std_norm unset, or "
                          f"use an estimator that reads it: train.advantage={' or '.join(readers)}")
    filled = {key: getattr(p, key) for key in p.__dataclass_fields__
              if key != "sets" and getattr(train, key) is None}
    if not std_norm:
        filled["adv_std_norm"] = False  # the estimator defines its own scale, not the preset
        if train.adv_scope is None:
            filled["adv_scope"] = "group"
    return dataclasses.replace(train, **filled)


def apply_sets(config: Config, explicit: Collection[str]) -> Config:
    """``config`` with its preset's ``sets`` keys, each unless ``explicit`` (the dotted keys the
    recipe names) has it or the key it follows (a recipe's own train.anchor=proximal keeps
    correction.tis at its default; its own train.lora_rank, train.lora_alpha). A resolved config
    names every key, so resolving it again changes nothing."""
    by_section: dict[str, dict[str, Any]] = {}
    for key, value, follows in preset(config.train.algorithm).sets:
        if key not in explicit and follows not in explicit:
            section, name = key.split(".", 1)
            by_section.setdefault(section, {})[name] = value
    return dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **values)
                                          for section, values in by_section.items()})
