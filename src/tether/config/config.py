"""The whole configuration: recipe YAML plus dotted overrides, validated once, strictly.

The core sections are fields of ``Config``; the own section of a family, an engine or a backend
(``section``: ``flow``, ``vllm``, ``ray``) is a plug-in section, read as ``cfg.section(name)`` or
``cfg.<name>``. A recipe's ``run.plugins`` are imported first, so a plug-in family, engine, loss or
task is known while the rest is read. A ``Config`` pickles as its recipe, rebuilt (and checked) on
arrival, so it crosses into rollout workers, learner ranks and Ray actors however its plug-ins were loaded.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from tether import registry
from tether.config import features, keys
from tether.config.fields import build_section, closest, section_fields
from tether.config.presets import apply_sets, resolve_preset
from tether.config.recipe import apply_overrides, parse_override, read_recipe
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
from tether.errors import ConfigError, PluginError
from tether.vocabulary import DynamicSampling, SamplingParams


@dataclass(frozen=True)
class Config:
    """A validated recipe. Build it with ``load_config`` or ``Config.from_dict``."""

    run: RunSection = dataclasses.field(default_factory=RunSection)
    async_: AsyncSection = dataclasses.field(default_factory=AsyncSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    correction: CorrectionSection = dataclasses.field(default_factory=CorrectionSection)
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    reward: RewardSection = dataclasses.field(default_factory=RewardSection)
    warmstart: WarmstartSection = dataclasses.field(default_factory=WarmstartSection)
    plan: PlanSection = dataclasses.field(default_factory=PlanSection)
    metrics: MetricsSection = dataclasses.field(default_factory=MetricsSection)
    plugin_sections: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The own sections of the chosen family, engine and backend, by name."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Config:
        data = {} if data is None else data
        if not isinstance(data, Mapping):
            raise ConfigError(f"a recipe must be a mapping of sections, got {type(data).__name__}")
        run = build_section(RunSection, data.get("run") or {}, "run", _key_homes(SECTIONS))
        registry.load_plugins(run.plugins)  # before anything they may register is looked up
        sections = {**SECTIONS, **plugin_section_classes()}
        home = _key_homes(sections)
        built: dict[str, Any] = {}
        plugins: dict[str, Any] = {}
        for name, value in data.items():
            if name not in sections:
                raise ConfigError(_unknown_section(str(name), sections, home))
            section = build_section(sections[name], value or {}, name, home)
            if name in SECTIONS:
                built[_attr(name)] = section
            else:
                plugins[name] = section
        config = cls(**built, plugin_sections=plugins)
        explicit = {f"{name}.{key}" for name, value in data.items() if isinstance(value, Mapping)
                    for key in value}  # the keys the recipe names: they win over the preset
        config = apply_sets(dataclasses.replace(config, train=resolve_preset(config.train)), explicit)
        config = config.family().resolve(config, explicit)  # a family's keys that follow the preset
        config.check()
        return config._own_sections_only()

    def __reduce__(self):
        return (_rebuild, (self.to_dict(),))

    def __getattr__(self, name: str) -> Any:
        """A plug-in section as an attribute (``cfg.flow``), at its defaults when the recipe does not
        set it (a family's own checks read it before the recipe keeps only the chosen family's)."""
        sections = self.__dict__.get("plugin_sections", {})
        if name in sections:
            return sections[name]
        if not name.startswith("_") and "plugin_sections" in self.__dict__:
            classes = plugin_section_classes()
            if name in classes:
                return classes[name]()
        raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r}")

    @property
    def eval_seed(self) -> int:
        """The seed of the held-out evaluation: ``eval.seed``, or ``run.seed`` when it is unset."""
        return self.run.seed if self.eval.seed is None else self.eval.seed

    def section(self, name: str) -> Any:
        """The section called ``name`` in recipe form (``async``, ``flow``): the chosen family's
        own section at its defaults when the recipe does not set it."""
        if name in SECTIONS:
            return getattr(self, _attr(name))
        if name in self.plugin_sections:
            return self.plugin_sections[name]
        classes = plugin_section_classes()
        if name in classes:
            return classes[name]()
        raise KeyError(name)

    def has_section(self, name: str) -> bool:
        return name in SECTIONS or name in plugin_section_classes()

    def family(self):
        """The chosen policy family (``tether.vocabulary.Family``)."""
        return registry.families.get(self.model.family)

    def _own_sections_only(self) -> Config:
        """The sections of the chosen family, engine and backend (defaults when unset); the others'
        (all at their defaults, or the check refused them) dropped."""
        chosen = (self.family(), registry.engines.get(self.rollout.engine),
                  registry.backends.get(self.rollout.backend))
        own = [plugin.section[0] for plugin in chosen if plugin.section is not None]
        return dataclasses.replace(self, plugin_sections={name: self.section(name) for name in own})

    def check(self) -> None:
        """Rules that span keys: each refuses a combination that cannot run or a key that would
        have no effect, naming what to change."""
        self._check_data()
        self._check_training()
        self._check_corrections()
        self._check_world()
        self._check_inflight()
        self._check_plugins()

    def _check_data(self) -> None:
        d = self.data
        if bool(d.task) == bool(d.dataset):
            raise ConfigError(
                "set exactly one of data.task (a built-in task) and data.dataset (a local dataset); "
                f"got data.task={d.task!r}, data.dataset={d.dataset!r}"
            )
        if (d.system_prompt or d.chat_template_kwargs) and not d.chat_template:
            key = "data.system_prompt" if d.system_prompt else "data.chat_template_kwargs"
            raise ConfigError(f"{key} is given to the chat template, but data.chat_template is false; set "
                              f"data.chat_template=true, or leave {key} empty")
        if d.eval_dataset and not d.dataset:
            raise ConfigError("data.eval_dataset is set but data.dataset is not; built-in tasks have "
                              "their own held-out split")
        # a family that does not declare reward.function scores samples its own way (agent: the env)
        scored = "reward.function" in self.family().keys
        rw = self.reward
        if rw.functions and rw.function != "task":
            raise ConfigError(f"reward.function={rw.function} and reward.functions={rw.functions} are both "
                              "set; put every reward in reward.functions (with reward.weights)")
        if rw.weights and len(rw.weights) != len(rw.functions):
            raise ConfigError(f"reward.weights has {len(rw.weights)} weights for {len(rw.functions)} "
                              "reward.functions; give one weight per function (or none: 1 each)")
        named = rw.functions or [rw.function]
        if scored and "task" in named and not d.task:
            raise ConfigError("reward.function=task scores with a built-in task's verifier, but "
                              "data.task is empty; choose "
                              f"{', '.join(registry.rewards.names())} or path/to/file.py:function")
        if scored:
            for spec in named:
                rw.check_name(spec)
        r, default = self.rollout, RolloutSection()
        if not r.dynamic_sampling and (r.dynamic_sampling_max_draws, r.dynamic_sampling_on_short) != (
                default.dynamic_sampling_max_draws, default.dynamic_sampling_on_short):
            raise ConfigError("rollout.dynamic_sampling_max_draws / dynamic_sampling_on_short have no effect "
                              "with rollout.dynamic_sampling=false; set rollout.dynamic_sampling=true, or "
                              f"leave them at {default.dynamic_sampling_max_draws} and "
                              f"{default.dynamic_sampling_on_short!r}")
        if r.on_worker_loss == "replace" and r.max_worker_restarts == 0:
            raise ConfigError("rollout.on_worker_loss=replace with rollout.max_worker_restarts=0 would "
                              "replace no worker; set rollout.max_worker_restarts to 1 or more, or "
                              "rollout.on_worker_loss=stop")
        if r.on_worker_loss == "stop" and r.max_worker_restarts != default.max_worker_restarts:
            raise ConfigError(f"rollout.max_worker_restarts={r.max_worker_restarts} has no effect with "
                              "rollout.on_worker_loss=stop; set rollout.on_worker_loss=replace, or leave "
                              f"it at {default.max_worker_restarts}")
        if self.eval.num_samples > 1 and not self.eval.interval:
            raise ConfigError(f"eval.num_samples={self.eval.num_samples} has no effect with evaluation "
                              "off (eval.interval=0); set eval.interval too, or eval.num_samples=1")

    def _check_training(self) -> None:
        t, rw = self.train, self.reward
        estimator = registry.advantages.meta(t.advantage)
        if not estimator.get("std_norm") and t.adv_scope != "group":
            raise ConfigError(f"train.adv_scope={t.adv_scope} has no effect with "
                              f"train.advantage={t.advantage}; set train.adv_scope=group, or use "
                              "train.advantage=grpo (with adv_scope=batch it is REINFORCE++-baseline)")
        smallest = estimator.get("min_group_size", 2)
        if self.rollout.group_size < smallest:
            raise ConfigError(f"rollout.group_size={self.rollout.group_size} trains nothing with "
                              f"train.advantage={t.advantage}: its baseline is the other samples of a "
                              "sample's own prompt group, so a group of one always has advantage 0; set "
                              f"rollout.group_size to {smallest} or more (GRPO-family runs use 4 to 64), or "
                              "train.advantage=reinforce_pp, whose baseline is the whole batch")
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
        for name, section in (("train", t), ("warmstart", self.warmstart)):
            if section.min_lr_ratio and section.lr_schedule == "constant":
                raise ConfigError(f"{name}.min_lr_ratio={section.min_lr_ratio} has no effect with "
                                  f"{name}.lr_schedule=constant; set {name}.lr_schedule=linear or cosine, "
                                  f"or set {name}.min_lr_ratio=0")
        if t.warmup_steps > t.num_batches * t.updates_per_batch:
            raise ConfigError(f"train.warmup_steps={t.warmup_steps} is longer than the run's "
                              f"{t.num_batches * t.updates_per_batch} optimizer updates "
                              "(train.num_batches × train.updates_per_batch), so the rate would never "
                              "reach train.lr; lower train.warmup_steps")
        if t.reduce_dtype != "float32" and (t.dtype == "float32" or t.world_size == 1):
            raise ConfigError(f"train.reduce_dtype={t.reduce_dtype} has no effect with train.dtype="
                              f"{t.dtype} and train.world_size={t.world_size} (the dtype FSDP2 ranks sum "
                              "bfloat16 gradients in); remove it, or set train.dtype=bfloat16 and "
                              "train.world_size > 1")
        if t.cpu_offload and (t.world_size == 1 or not t.device.startswith("cuda")):
            raise ConfigError(f"train.cpu_offload=true offloads FSDP2 ranks' shards from GPUs to host "
                              f"memory; with train.device={t.device} and train.world_size={t.world_size} "
                              "there is nothing to offload: set train.device=cuda and train.world_size > 1, "
                              "or remove train.cpu_offload")
        t.check_ema()
        self._check_lora()

    def _check_lora(self) -> None:
        t = self.train
        if not t.lora_rank:
            defaults = (("lora_alpha", 16.0), ("lora_dropout", 0.0), ("lora_targets", ["all-linear"]))
            for key, default in defaults:
                if getattr(t, key) != default:
                    raise ConfigError(f"train.{key}={getattr(t, key)} has no effect with train.lora_rank=0 "
                                      "(every weight trains); set train.lora_rank, or remove it")
            if self.rollout.lora_apply != "merge":
                raise ConfigError(f"rollout.lora_apply={self.rollout.lora_apply} has no effect with "
                                  "train.lora_rank=0 (no adapters are published); remove it")
            return
        if t.lora_alpha <= 0:
            raise ConfigError(f"train.lora_alpha={t.lora_alpha}: an adapter adds (α/r)·B·A to its layer, so "
                              "with α = 0 the adapters change nothing and every gradient is 0; set a "
                              f"positive α (e.g. train.lora_alpha={2 * t.lora_rank}, twice the rank)")
        if not t.lora_targets:
            raise ConfigError("train.lora_targets is empty: name the layers to adapt (e.g. [q_proj, v_proj]) "
                              "or use [all-linear]")
        if self.checkpoint.sharded:
            raise ConfigError(f"checkpoint.sharded=true with train.lora_rank={t.lora_rank}: a checkpoint "
                              "holds the adapters alone, gathered whole (megabytes); drop checkpoint.sharded")

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

    def _check_plugins(self) -> None:
        """The chosen family, engine and backend: what is theirs, what they can do, their own
        rules (``tether.config.features``)."""
        features.check_ownership(self)
        family = self.family()
        features.check_capabilities(self, family)
        if self.data.task:
            task = registry.tasks.get(self.data.task)
            if task.family != family.name:
                theirs = [n for n in registry.tasks.names() if registry.tasks.get(n).family == family.name]
                raise ConfigError(f"data.task={self.data.task} is a task of model.family={task.family}; "
                                  f"model.family={family.name} has: "
                                  f"{', '.join(theirs) or 'none built in (use data.dataset)'}")
        registry.engines.get(self.rollout.engine).check(self)
        registry.backends.get(self.rollout.backend).check(self)
        family.check(self)
        self._check_token_budget(family)

    def _check_token_budget(self, family: Any) -> None:
        """A token budget holds the longest sequence the family can produce, and is not set with
        a count of sequences (which of the two would make the micro-batches is then unclear)."""
        t = self.train
        budget = t.max_tokens_per_micro_batch
        if not budget:
            return
        if t.micro_batch_size:
            raise ConfigError(f"train.max_tokens_per_micro_batch={budget} and train.micro_batch_size="
                              f"{t.micro_batch_size} are both set: micro-batches are made by tokens or by a "
                              "count of sequences; set train.micro_batch_size=0 to pack by tokens")
        longest, keys = family.longest_sequence(self)
        if longest is None:
            raise ConfigError(f"train.max_tokens_per_micro_batch={budget} needs a bound on a sequence's "
                              f"length, which model.family={family.name} takes from {keys}; set {keys} "
                              f"to at most {budget}")
        if budget < longest:
            names = re.sub("=[^ ]*", "", keys).replace(" + ", " or ")
            raise ConfigError(f"train.max_tokens_per_micro_batch={budget} is smaller than the longest "
                              f"sequence a run can produce: {keys} = {longest} tokens; raise it to at "
                              f"least {longest}, or lower {names}")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every key, defaults included, in recipe form (the chosen family's section too)."""
        names = [*SECTIONS, *self.plugin_sections]
        return {
            name: {k: (list(v) if isinstance(v, tuple) else v)
                   for k, v in dataclasses.asdict(self.section(name)).items()}
            for name in names
        }

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def sampling(self) -> SamplingParams:
        """How the token engines sample (the rollout section)."""
        r = self.rollout
        return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_k=r.top_k,
                              top_p=r.top_p)

    def dynamic_sampling(self) -> DynamicSampling | None:
        """DAPO's dynamic sampling (the rollout.dynamic_sampling* keys), or None when it is off."""
        r = self.rollout
        return DynamicSampling(r.dynamic_sampling_max_draws, r.dynamic_sampling_on_short) \
            if r.dynamic_sampling else None

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
            drain_at_turns=self.family().drains_at_turns(self),
        )


def _rebuild(data: dict[str, Any]) -> Config:
    return Config.from_dict(data)


PLUGIN_KINDS = ("backends", "engines", "families")
"""The registries whose entries may own a recipe section (``section``: name, class)."""


_section_classes: dict[tuple[int, bool], dict[str, type]] = {}


def plugin_section_classes(builtin_only: bool = False) -> Mapping[str, type]:
    """Section name → class of each backend, engine and family (every one registered, or Tether's
    own) that has a section of its own; computed again only when a plug-in registers
    (``registry.generation``)."""
    key = (registry.generation(), builtin_only)
    if key not in _section_classes:
        out = _find_section_classes(builtin_only)  # a refusal caches nothing
        for old in [k for k in _section_classes if k[0] != key[0]]:
            del _section_classes[old]
        _section_classes[key] = out
    return MappingProxyType(_section_classes[key])


def _find_section_classes(builtin_only: bool) -> dict[str, type]:
    out: dict[str, type] = {}
    owners: dict[str, str] = {}
    for kind in PLUGIN_KINDS:
        reg = getattr(registry, kind)
        for name in reg.builtins if builtin_only else reg.names():
            section = reg.get(name).section
            if section is None:
                continue
            if section[0] in SECTIONS or section[0] in out:
                raise PluginError(f"{reg.key}={name} declares a section {section[0]!r}, which "
                                  f"{owners.get(section[0], 'Tether')} has too; rename one of them")
            out[section[0]], owners[section[0]] = section[1], f"{reg.key}={name}"
    return out


def section_class(name: str) -> type:
    """The class of the section called ``name``: a core one or a plug-in's."""
    return SECTIONS[name] if name in SECTIONS else plugin_section_classes()[name]


def _unknown_section(name: str, sections: Mapping[str, type], home: Mapping[str, list[str]]) -> str:
    hint = closest(name, sections)
    if hint:
        return f"unknown section {name!r}; did you mean {hint!r}?"
    if name in home:
        homes = " or ".join(f"{h}.{name}" for h in home[name])
        return f"unknown section {name!r}; {name} is a key: {homes}"
    return f"unknown section {name!r}; valid sections are: {', '.join(sections)}"


def _attr(section: str) -> str:
    return "async_" if section == "async" else section


def _key_homes(sections: Mapping[str, type]) -> dict[str, list[str]]:
    """Key name → the sections that have a key of that name."""
    seen: dict[str, list[str]] = {}
    for section, cls in sections.items():
        for key in section_fields(cls):
            seen.setdefault(key, []).append(section)
    return seen


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Recipe (optional) + overrides → a validated ``Config``."""
    data = read_recipe(path) if path is not None else {}
    return Config.from_dict(apply_overrides(data, overrides))


def load_resumed(path: str | Path, overrides: Sequence[str] = ()) -> tuple[Config, list[str]]:
    """A run's recorded config with a resume's ``overrides``, and the keys dropped from the record
    because the overrides leave them nothing to act on (moving to a smaller set-up: from ranks to
    one process drops ``checkpoint.sharded``; from Ray to local processes, the ray section; from
    vLLM to the built-in engine, the vllm section), as each key declares (``knob(dropped=...)``,
    an engine's or backend's keys: ``tether.config.keys``). Keys the overrides set are never dropped."""
    recorded = read_recipe(path)
    if not recorded:
        raise ConfigError(f"{path} is empty: it should hold the config the run was trained with (tether "
                          "train writes it at every start); restore it from a copy, or start a new run from "
                          "a checkpoint's model (model.path=RUN/checkpoints/step-N/learner/model)")
    data = apply_overrides(recorded, overrides)
    given = {".".join(parse_override(text)[0]) for text in overrides}
    dropped = []
    for entry in keys.table().values():  # each key says when a resume drops it (knob(dropped=...))
        section, name = entry.section, entry.key.split(".", 1)[1]
        if entry.drop is None or entry.key in given or name not in (data.get(section) or {}):
            continue
        why = entry.drop(data)
        if why is None:
            continue
        value = data[section].pop(name)
        if value != getattr(section_class(section)(), name, value):  # a default says nothing
            dropped.append(f"{entry.key}={value} ({why})")
    return Config.from_dict(data), dropped


__all__ = ["AsyncSection", "CheckpointSection", "Config", "CorrectionSection", "DataSection", "EvalSection",
           "ModelSection",
           "PlanSection", "RewardSection", "RolloutSection", "RunSection", "TrainSection",
           "WarmstartSection", "apply_overrides", "load_config", "parse_override", "read_recipe"]
