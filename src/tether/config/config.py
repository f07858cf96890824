"""The whole configuration: recipe YAML plus dotted overrides, validated once, strictly."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tether.config.backends import RaySection, VllmSection
from tether.config.fields import build_section, closest, section_fields
from tether.config.flow import FlowSection
from tether.config.schema import (
    SECTIONS,
    AsyncSection,
    CheckpointSection,
    CorrectionSection,
    DataSection,
    EvalSection,
    MetricsSection,
    ModelSection,
    PlanSection,
    RewardSection,
    RolloutSection,
    RunSection,
    TrainSection,
    WarmstartSection,
)
from tether.control import BudgetSettings
from tether.errors import ConfigError


@dataclass(frozen=True)
class Config:
    """A validated recipe. Build it with ``load_config`` or ``Config.from_dict``."""

    run: RunSection = dataclasses.field(default_factory=RunSection)
    async_: AsyncSection = dataclasses.field(default_factory=AsyncSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    ray: RaySection = dataclasses.field(default_factory=RaySection)
    vllm: VllmSection = dataclasses.field(default_factory=VllmSection)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    correction: CorrectionSection = dataclasses.field(default_factory=CorrectionSection)
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    flow: FlowSection = dataclasses.field(default_factory=FlowSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    reward: RewardSection = dataclasses.field(default_factory=RewardSection)
    warmstart: WarmstartSection = dataclasses.field(default_factory=WarmstartSection)
    plan: PlanSection = dataclasses.field(default_factory=PlanSection)
    metrics: MetricsSection = dataclasses.field(default_factory=MetricsSection)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Config:
        data = {} if data is None else data
        if not isinstance(data, Mapping):
            raise ConfigError(f"a recipe must be a mapping of sections, got {type(data).__name__}")
        home = _key_homes()
        built: dict[str, Any] = {}
        for name, value in data.items():
            if name not in SECTIONS:
                hint = closest(str(name), SECTIONS)
                if hint:
                    raise ConfigError(f"unknown section {name!r}; did you mean {hint!r}?")
                if name in home:
                    homes = " or ".join(f"{h}.{name}" for h in home[name])
                    raise ConfigError(f"unknown section {name!r}; {name} is a key: {homes}")
                raise ConfigError(
                    f"unknown section {name!r}; valid sections are: {', '.join(SECTIONS)}"
                )
            built[_attr(name)] = build_section(SECTIONS[name], value or {}, name, home)
        config = cls(**built)
        config = dataclasses.replace(config, train=_resolve_preset(config.train))
        config.check()
        return config

    def check(self) -> None:
        """Rules that span keys: each refuses a combination that cannot run or a key that would
        have no effect, naming what to change."""
        self._check_data()
        self._check_training()
        self._check_corrections()
        self._check_ray()
        self._check_vllm()
        self._check_inflight()
        self._check_world()
        self._check_flow()

    def _check_data(self) -> None:
        d = self.data
        if bool(d.task) == bool(d.dataset):
            raise ConfigError(
                "set exactly one of data.task (a built-in task) and data.dataset (a local dataset); "
                f"got data.task={d.task!r}, data.dataset={d.dataset!r}"
            )
        if d.eval_dataset and not d.dataset:
            raise ConfigError("data.eval_dataset is set but data.dataset is not; built-in tasks have "
                              "their own held-out split")
        if self.reward.function == "task" and not d.task:
            raise ConfigError("reward.function=task scores with a built-in task's verifier, but "
                              "data.task is empty; choose exact_match, numeric_match, math or "
                              "path/to/file.py:function")
        r, default = self.rollout, RolloutSection()
        if not r.dynamic_sampling and (r.dynamic_sampling_max_draws, r.dynamic_sampling_on_short) != (
                default.dynamic_sampling_max_draws, default.dynamic_sampling_on_short):
            raise ConfigError("rollout.dynamic_sampling_max_draws / dynamic_sampling_on_short have no effect "
                              "with rollout.dynamic_sampling=false; set rollout.dynamic_sampling=true, or "
                              f"leave them at {default.dynamic_sampling_max_draws} and "
                              f"{default.dynamic_sampling_on_short!r}")
        if self.eval.num_samples > 1 and not self.eval.interval:
            raise ConfigError(f"eval.num_samples={self.eval.num_samples} has no effect with evaluation "
                              "off (eval.interval=0); set eval.interval too, or eval.num_samples=1")

    def _check_training(self) -> None:
        t, rw = self.train, self.reward
        if t.advantage != "grpo" and t.adv_scope != "group":
            raise ConfigError(f"train.adv_scope={t.adv_scope} has no effect with "
                              f"train.advantage={t.advantage}; set train.adv_scope=group, or use "
                              "train.advantage=grpo (with adv_scope=batch it is REINFORCE++-baseline)")
        if self.rollout.group_size < 2:
            raise ConfigError("rollout.group_size=1 trains nothing: every advantage is a sample's reward "
                              "relative to its prompt group's mean, so a group of one always has advantage "
                              "0; set rollout.group_size to 2 or more (GRPO-family runs use 4 to 64)")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", t.device):
            raise ConfigError(f"train.device must be 'cpu', 'cuda' or 'cuda:N' (a GPU index), "
                              f"got {t.device!r}")
        if rw.overlong_buffer > self.rollout.max_new_tokens:
            raise ConfigError(f"reward.overlong_buffer={rw.overlong_buffer} is longer than "
                              f"rollout.max_new_tokens={self.rollout.max_new_tokens}; the buffer is the last "
                              "part of the completion budget, so lower it")
        if rw.overlong_penalty != 1.0 and not rw.overlong_buffer:
            raise ConfigError(f"reward.overlong_penalty={rw.overlong_penalty} has no effect with "
                              "reward.overlong_buffer=0 (off); set the buffer too, or "
                              "reward.overlong_penalty=1")
        if t.min_lr_ratio and t.lr_schedule == "constant":
            raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio} has no effect with "
                              "train.lr_schedule=constant; set train.lr_schedule=linear or cosine, or "
                              "set train.min_lr_ratio=0")
        if t.warmup_steps > t.num_batches * t.updates_per_batch:
            raise ConfigError(f"train.warmup_steps={t.warmup_steps} is longer than the run's "
                              f"{t.num_batches * t.updates_per_batch} optimizer updates "
                              "(train.num_batches × train.updates_per_batch), so the rate would never "
                              "reach train.lr; lower train.warmup_steps")

    def _check_corrections(self) -> None:
        c, default = self.correction, CorrectionSection()
        if self.train.anchor == "behavior" and c.tis != "none":
            raise ConfigError(
                f"correction.tis={c.tis} weights the loss by π_prox/μ, which needs "
                "train.anchor=proximal; with train.anchor=behavior the ratio is already taken "
                "against μ. Set correction.tis=none or train.anchor=proximal"
            )
        if c.tis == "none" and c.tis_cap != default.tis_cap:
            raise ConfigError(f"correction.tis_cap={c.tis_cap:g} has no effect with correction.tis=none "
                              f"(no truncation); set correction.tis=token or sequence, or "
                              f"correction.tis_cap={default.tis_cap:g}")
        if c.mask == "none" and (c.mask_low, c.mask_high) != (default.mask_low, default.mask_high):
            raise ConfigError(f"correction.mask_low/mask_high ({c.mask_low:g}, {c.mask_high:g}) have no "
                              "effect with correction.mask=none; set correction.mask=token, sequence or "
                              f"geometric, or leave the bounds at {default.mask_low:g} and "
                              f"{default.mask_high:g}")
        if c.mask_low >= c.mask_high:
            raise ConfigError("correction.mask_low must be below correction.mask_high")

    def _check_ray(self) -> None:
        r = self.ray
        if self.rollout.backend != "ray" and (r.address or r.local_cpus or r.cpus_per_worker
                                              or r.gpus_per_worker or r.learner != "driver"
                                              or r.learner_placement != "PACK"):
            raise ConfigError("the ray section is set but rollout.backend is "
                              f"{self.rollout.backend!r}; set rollout.backend=ray to use it, or remove "
                              "the ray keys")
        if r.learner_placement != "PACK" and (r.learner != "actor" or self.train.world_size == 1):
            raise ConfigError(f"ray.learner_placement={r.learner_placement} places learner ranks, which "
                              "exist only with ray.learner=actor and train.world_size > 1; set both, or "
                              "remove ray.learner_placement")

    def _check_world(self) -> None:
        t, r = self.train, self.rollout
        if t.world_size == 1:
            if self.checkpoint.sharded:
                raise ConfigError("checkpoint.sharded=true has no effect with train.world_size=1 (one "
                                  "process writes the whole state); set train.world_size > 1, or leave "
                                  "it false")
            return
        groups = r.batch_size // t.updates_per_batch  # the fewest whole groups a mini-batch can hold
        if groups < t.world_size:
            raise ConfigError(f"train.world_size={t.world_size} ranks split each mini-batch by whole prompt "
                              f"groups, but rollout.batch_size={r.batch_size} over train.updates_per_batch="
                              f"{t.updates_per_batch} mini-batches leaves some with {groups}; raise "
                              "rollout.batch_size, or lower train.updates_per_batch or train.world_size")
        if t.device.startswith("cuda:"):
            raise ConfigError(f"train.device={t.device} names one GPU, but train.world_size={t.world_size} "
                              "ranks use cuda:0 … cuda:N-1; set train.device=cuda")

    def _check_inflight(self) -> None:
        self.budget()  # the control plane's own rules (async.sync_when_idle has no effect without draining)

    def _check_vllm(self) -> None:
        if self.rollout.engine == "vllm" and self.rollout.decoder != "auto":
            raise ConfigError(f"rollout.decoder={self.rollout.decoder} is the built-in engine's; "
                              "with rollout.engine=vllm, vLLM decodes. Remove the key, or set "
                              "rollout.engine=torch")
        if self.rollout.engine != "vllm" and self.vllm != VllmSection():
            raise ConfigError("the vllm section is set but rollout.engine is "
                              f"{self.rollout.engine!r}; set rollout.engine=vllm to use it, or remove "
                              "the vllm keys")

    def _check_flow(self) -> None:
        if self.model.family != "flow":
            if self.flow != FlowSection():
                raise ConfigError("the flow section is set but model.family is 'lm'; set model.family=flow "
                                  "to train a flow model, or remove the flow keys")
            return
        if self.flow.train_steps > self.flow.steps:
            raise ConfigError(f"flow.train_steps={self.flow.train_steps} exceeds the "
                              f"flow.steps={self.flow.steps} steps of a trajectory; lower it (0 trains all "
                              "of them)")
        refused = [(key, why) for key, why in _flow_refusals(self) if why]
        if refused:
            key, why = refused[0]
            raise ConfigError(f"{key} {why} with model.family=flow (docs/flow.md lists what applies)")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every key, defaults included, in recipe form."""
        return {
            name: {k: (list(v) if isinstance(v, tuple) else v)
                   for k, v in dataclasses.asdict(getattr(self, _attr(name))).items()}
            for name in SECTIONS
        }

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def budget(self) -> BudgetSettings:
        """The control plane's settings from this recipe."""
        return BudgetSettings(
            max_staleness=self.async_.max_staleness,
            updates_per_batch=self.train.updates_per_batch,
            max_inflight=self.async_.max_inflight,
            total_batches=self.train.num_batches,
            eval_interval=self.eval.interval,
            save_interval=self.checkpoint.interval,
            on_stale=self.async_.on_stale,
            max_consecutive_drops=self.async_.max_consecutive_drops,
            sync_when_idle=self.async_.sync_when_idle,
            inflight_update=self.async_.inflight_update,
        )


def _flow_refusals(c: Config):
    """(key, why it is refused or '') for every key the flow family does not use or support yet."""
    r, t, m = c.rollout, c.train, ModelSection()
    sampling = [k for k in ("max_new_tokens", "temperature", "top_k", "top_p")
                if getattr(r, k) != getattr(RolloutSection(), k)]
    rules = [
        (f"rollout.{sampling[0] if sampling else ''}", bool(sampling),
         "samples tokens; a flow model's sampling is the flow section"),
        ("rollout.engine=vllm", r.engine != "torch", "serves language models"),
        (f"rollout.decoder={r.decoder}", r.decoder != "auto",
         "decodes language models; a flow model's sampler has no native form"),
        ("rollout.dynamic_sampling", r.dynamic_sampling, "is not supported yet"),
        ("ray.learner=actor", c.ray.learner != "driver", "is not supported yet (ray.learner=driver)"),
        (f"async.inflight_update={c.async_.inflight_update}", c.async_.inflight_update != "drain",
         "is not supported yet (drain only)"),
        (f"train.world_size={t.world_size}", t.world_size > 1, "is not supported yet (one learner process)"),
        ("metrics.attribution", c.metrics.attribution, "is not supported yet"),
        ("data.dataset", bool(c.data.dataset), "is a text dataset; use data.task=shapes"),
        ("reward.overlong_buffer", bool(c.reward.overlong_buffer), "shapes lengths; trajectories have none"),
        ("train.mask_truncated", t.mask_truncated, "has no effect: trajectories are never truncated"),
        ("train.shared_prefix=false", not t.shared_prefix, "has no effect: no prompt prefix is shared"),
        ("model.init_arch / init_size", (c.model.init_arch, c.model.init_size) != (m.init_arch, m.init_size),
         "build language models; use flow.init_width / init_depth"),
    ]
    return [(key, why if on else "") for key, on, why in rules]


def _resolve_preset(train: TrainSection) -> TrainSection:
    """Fill every key left null from the ``train.algorithm`` preset."""
    from tether.train.algorithms import preset

    p = preset(train.algorithm)
    if train.advantage != "grpo" and train.adv_std_norm is not None:
        raise ConfigError(f"train.adv_std_norm has no effect with train.advantage={train.advantage} (its "
                          "normalisation is part of the estimator); leave train.adv_std_norm unset, or "
                          "use train.advantage=grpo")
    filled = {key: getattr(p, key) for key in p.__dataclass_fields__ if getattr(train, key) is None}
    if train.advantage != "grpo":
        filled["adv_std_norm"] = False  # the estimator defines its own scale, not the preset
    return dataclasses.replace(train, **filled)


def _attr(section: str) -> str:
    return "async_" if section == "async" else section


def _key_homes() -> dict[str, list[str]]:
    """Key name → the sections that have a key of that name."""
    seen: dict[str, list[str]] = {}
    for section, cls in SECTIONS.items():
        for key in section_fields(cls):
            seen.setdefault(key, []).append(section)
    return seen


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'async.max_staleness=3'`` → ``(['async', 'max_staleness'], 3)`` (value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    path, _, raw = text.partition("=")
    parts = path.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(
            f"override {text!r}: the key must be section.key (e.g. async.max_staleness=3)"
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: cannot parse value {raw!r}: {exc}") from exc
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Set each ``section.key=value`` into a copy of ``data``."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in data.items()}
    for text in overrides:
        (section, key), value = parse_override(text)
        current = out.setdefault(section, {})
        if not isinstance(current, dict):
            raise ConfigError(f"override {text!r}: section {section!r} in the recipe is not a mapping")
        current[key] = value
    return out


def read_recipe(path: str | Path) -> dict[str, Any]:
    """Read a YAML recipe into a plain mapping, with errors that name the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"recipe {str(p)!r} does not exist (give a path to a YAML file)")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe {str(p)!r} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {str(p)!r} must be a mapping of sections, got {type(data).__name__}")
    return data


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Recipe (optional) + overrides → a validated ``Config``."""
    data = read_recipe(path) if path is not None else {}
    return Config.from_dict(apply_overrides(data, overrides))


__all__ = ["AsyncSection", "CheckpointSection", "Config", "CorrectionSection", "DataSection", "EvalSection",
           "ModelSection",
           "PlanSection", "RewardSection", "RolloutSection", "RunSection", "TrainSection",
           "WarmstartSection", "apply_overrides", "load_config", "parse_override", "read_recipe"]
