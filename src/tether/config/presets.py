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
| flow_grpo (Liu et al. 2025, Flow-GRPO's reference configs) | ppo_clip | token_mean | 1e-4 / 1e-4 | yes, over the whole batch | no | closed form, β = 0.04; advantages clamped at ±5 |

flow_grpo is the flow family's reference setting (``train.adv_scope: batch`` is its
``global_std``, ``train.adv_clip: 5`` its ``adv_clip_max``); its β is in the reference's KL units
(``flow.kl_units: reference``, the default). Every other preset normalises per group and clamps
nothing. Every preset uses the grpo advantage; ``train.advantage`` (rloo, reinforce_pp) combines with any
of them, its own normalisation replacing the preset's std norm.

DAPO's dynamic sampling over-samples until every group has reward variance; the dapo preset drops
zero-variance groups from the loss instead, which removes the same (zero-advantage) groups without
generating more, and ``rollout.dynamic_sampling`` adds the over-sampling (``tether.rollout.dynamic``).
DAPO's overlong reward shaping is not part of the preset either.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tether import registry
from tether.errors import ConfigError

if TYPE_CHECKING:
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


PRESETS: dict[str, Preset] = {
    "grpo": Preset("ppo_clip", "seq_mean_token_mean", 0.2, 0.2, 0.0, True, False, 0.04, "k3"),
    "dapo": Preset("ppo_clip", "token_mean", 0.2, 0.28, 0.0, True, True, 0.0, "k3"),
    "dr_grpo": Preset("ppo_clip", "seq_mean_token_sum_norm", 0.2, 0.2, 0.0, False, False, 0.0, "k3"),
    "gspo": Preset("gspo", "seq_mean_token_mean", 3e-4, 4e-4, 0.0, True, False, 0.0, "k3"),
    "cispo": Preset("cispo", "token_mean", 1.0, 0.28, 0.0, True, False, 0.0, "k3"),
    "flow_grpo": Preset("ppo_clip", "token_mean", 1e-4, 1e-4, 0.0, True, False, 0.04, "k3", "batch", 5.0),
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
    filled = {key: getattr(p, key) for key in p.__dataclass_fields__ if getattr(train, key) is None}
    if not std_norm:
        filled["adv_std_norm"] = False  # the estimator defines its own scale, not the preset
        if train.adv_scope is None:
            filled["adv_scope"] = "group"
    return dataclasses.replace(train, **filled)
