"""What a recipe asks of the family, engine and backend it chose, checked in one place.

Each plug-in declares what is its own and what it can do; the rules here are the same for all of
them, and every refusal is generated from the declarations:

- a section or key owned by an engine, backend or family that is not chosen is refused unless it
  is left at its default (the vllm section without ``rollout.engine=vllm``, ``rollout.decoder``
  without the built-in engine, the flow section without ``model.family=flow``);
- the chosen family's ``Capabilities`` bound the engine, the backend and the in-flight update
  mode, and every optional feature a recipe asks for (``FEATURES``) must be among its features.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tether import registry
from tether.control.inflight import inflight_mode
from tether.errors import ConfigError
from tether.plugins import section_name


@dataclass(frozen=True)
class Feature:
    """An optional capability a family may have, and the setting that asks for it."""

    name: str
    what: str
    asked: Callable[[Any], str | None]
    """The ``key=value`` of the recipe that asks for it, or None."""


def changed_keys(cfg: Any, keys: Iterable[str]) -> list[str]:
    """``key=value`` of each of ``keys`` (``section.key``) set away from its default, in order."""
    out = []
    for key in keys:
        section, name = key.split(".")
        value = getattr(cfg.section(section), name)
        if value != getattr(type(cfg.section(section))(), name):
            out.append(f"{key}={_yaml(value)}")
    return out


def _changed(cfg: Any, keys: Iterable[str]) -> str | None:
    """``key=value`` of the first of ``keys`` (``section.key``) set away from its default."""
    return next(iter(changed_keys(cfg, keys)), None)


def _yaml(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _by_keys(feature: str) -> Callable[[Any], str | None]:
    """Asked by setting any key whose definition names ``feature`` (``knob(feature=...)``) away
    from its default."""
    from tether.config.keys import feature_keys

    return lambda cfg: _changed(cfg, feature_keys(feature))


FEATURES: tuple[Feature, ...] = (
    Feature("token_sampling", "sampling tokens", _by_keys("token_sampling")),
    Feature("decoder", "a choice of token decoder", _by_keys("decoder")),
    Feature("dynamic_sampling", "DAPO's dynamic sampling", _by_keys("dynamic_sampling")),
    Feature("truncation", "completions cut off at a length", _by_keys("truncation")),
    Feature("shared_prefix", "a prompt prefix shared by each group's samples", _by_keys("shared_prefix")),
    Feature("datasets", "text datasets (data.dataset)", _by_keys("datasets")),
    Feature("attribution", "the staleness/numerics split of each log-ratio", _by_keys("attribution")),
    Feature("learner_ranks", "learner ranks (FSDP2 over several processes)", _by_keys("learner_ranks")),
    Feature("lora", "LoRA adapters", _by_keys("lora")),
    Feature("token_budget", "micro-batches packed by tokens", _by_keys("token_budget")),
    Feature("learner_actor", "the learner in a Ray actor", _by_keys("learner_actor")),
    Feature("mixed_precision", "a bfloat16 learner (train.dtype)", _by_keys("mixed_precision")),
)
FEATURE_NAMES = frozenset(f.name for f in FEATURES)


def check_ownership(cfg: Any) -> None:
    """Refuse a section or key set for an engine, backend or family that is not chosen (a key the
    chosen one reads too is its own), as the key table says who reads each (``tether.config.keys``)."""
    from tether.config.keys import KINDS, table

    keys = table()
    chosen = {"engines": cfg.rollout.engine, "backends": cfg.rollout.backend, "families": cfg.model.family}
    for kind, name in chosen.items():
        reg = getattr(registry, kind)
        for other in reg.names():
            if other == name:
                continue
            section = section_name(reg.get(other))
            if section is not None and cfg.has_section(section) and not _is_default(cfg.section(section)):
                raise ConfigError(f"the {section} section is set, but it is read only with {reg.key}={other} "
                                  f"({reg.key} is {name!r}); set {reg.key}={other} to use it, or remove "
                                  f"the {section} keys")
            for entry in keys.values():
                if (entry.owner != KINDS[kind] or entry.section == section or other not in entry.readers
                        or name in entry.readers):
                    continue
                asked = _changed(cfg, (entry.key,))
                if asked is not None:
                    raise ConfigError(f"{asked} is read only with {reg.key}={other} ({reg.key} is "
                                      f"{name!r}); remove {entry.key}, or set {reg.key}={other}"
                                      + _own_dtype_key(reg, other, name, entry.key))


def _own_dtype_key(reg: Any, other: str, name: str, key: str) -> str:
    """Where ``key`` is the precision key of engine ``other``: the chosen engine's own, if any."""
    if reg is not registry.engines:
        return ""
    theirs, mine = reg.get(other).dtype_key, reg.get(name).dtype_key
    if key != theirs or mine is None:
        return ""
    return f"; {name}'s precision is {mine}"


def _is_default(value: Any) -> bool:
    return value == type(value)()


def check_capabilities(cfg: Any, family: Any) -> None:
    """Refuse what the chosen family, engine and backend cannot run together, saying what they
    support: the kind of engine the family asks for, the in-flight mode, LoRA, the engine's dtype,
    the workers' device
    and weight channel (each as the plug-ins declare it), and the family's optional features."""
    caps = family.capabilities
    unknown = set(caps.features) - FEATURE_NAMES
    assert not unknown, f"family {family.name} declares unknown features {sorted(unknown)}"
    engine, backend = registry.engines.get(cfg.rollout.engine), registry.backends.get(cfg.rollout.backend)
    check_engine(cfg, family, engine, backend)
    if caps.backends is not None and backend.name not in caps.backends:
        raise ConfigError(f"rollout.backend={backend.name}: model.family={family.name} runs with "
                          f"rollout.backend {' or '.join(caps.backends)} only" + _why(caps, "backends"))
    mode = cfg.async_.inflight_update
    if mode not in backend.inflight_updates:
        raise ConfigError(f"async.inflight_update={mode}: rollout.backend={backend.name} runs with "
                          f"async.inflight_update {' or '.join(backend.inflight_updates)} only"
                          + _note(backend, "inflight_updates") + "; set one of them, or rollout.backend "
                          + " or ".join(n for n in registry.backends.names()
                                        if mode in registry.backends.get(n).inflight_updates))
    if mode not in caps.inflight_updates:
        raise ConfigError(f"async.inflight_update={mode}: model.family={family.name} runs with "
                          f"async.inflight_update {' or '.join(caps.inflight_updates)} only"
                          + _why(caps, "inflight_updates"))
    for feature in FEATURES:
        asked = feature.asked(cfg)
        if asked is not None and feature.name not in caps.features:
            raise ConfigError(f"{asked} asks for {feature.what}, which model.family={family.name} does not "
                              "have" + _why(caps, feature.name) + "; remove it (docs/architecture.md lists "
                              "what each family supports)")


def check_engine(cfg: Any, family: Any, engine: Any, backend: Any) -> None:
    """What the chosen engine declares it supports (``tether.plugins.EnginePlugin``), against what
    the family, the recipe and the backend ask of it."""
    key = f"rollout.engine={engine.name}"
    kind = family.capabilities.engine_kind
    if kind not in engine.kinds:
        raise ConfigError(f"{key}: model.family={family.name} needs a {kind} engine"
                          + _why(family.capabilities, "engine_kind") + f", and {engine.name} is a "
                          f"{' and '.join(sorted(engine.kinds))} engine" + _note(engine, "kinds")
                          + f"; use rollout.engine {_those(lambda e: kind in e.kinds)}")
    mode = cfg.async_.inflight_update
    if mode not in engine.inflight_updates:
        raise ConfigError(f"async.inflight_update={mode}: {key} runs with async.inflight_update "
                          f"{' or '.join(engine.inflight_updates)} only" + _note(engine, "inflight_updates")
                          + f"; set one of them, or rollout.engine "
                          f"{_those(lambda e: mode in e.inflight_updates and kind in e.kinds)}")
    if cfg.train.lora_rank and not engine.lora:
        raise ConfigError(f"train.lora_rank={cfg.train.lora_rank}: {key} does not sample from LoRA "
                          "adapters" + _note(engine, "lora") + "; set train.lora_rank=0, or rollout.engine "
                          f"{_those(lambda e: e.lora and kind in e.kinds)}")
    dtype = engine.dtype(cfg)
    if dtype not in engine.dtypes:
        raise ConfigError(f"{engine.dtype_key}={dtype}: {key} samples in {' or '.join(engine.dtypes)} only"
                          + _note(engine, "dtypes") + f"; set {engine.dtype_key}={engine.dtypes[0]}, or "
                          f"rollout.engine {_those(lambda e: dtype in e.dtypes and kind in e.kinds)}")
    device = backend.worker_device(cfg)
    if device not in engine.devices:
        fit = _those(lambda e: device in e.devices and kind in e.kinds)
        raise ConfigError(f"rollout.backend={backend.name} puts its workers on {device}, and {key} samples "
                          f"on {' or '.join(engine.devices)} only" + _note(engine, "devices")
                          + f"; use rollout.engine {fit}")
    check_weight_sync(cfg, family, engine, backend)


def check_weight_sync(cfg: Any, family: Any, engine: Any, backend: Any) -> None:
    """``rollout.weight_sync`` against what the backend delivers through and the engine takes."""
    channel, asked = backend.channel(cfg), f"rollout.weight_sync={cfg.rollout.weight_sync}"
    offered = (backend.weight_channel, *backend.other_channels)
    if channel not in offered:
        names = {"shared_memory": "shm"}
        raise ConfigError(f"{asked}: rollout.backend={backend.name} delivers weights through "
                          f"{' or '.join(names.get(c, c) for c in offered)} only"
                          + _note(backend, "weight_channels")
                          + "; set rollout.weight_sync=auto or one of them")
    if channel not in engine.weight_channels:
        via = "" if cfg.rollout.weight_sync != "auto" else f" (the default of rollout.backend={backend.name})"
        raise ConfigError(f"rollout.backend={backend.name} publishes weights through "
                          f"{channel.replace('_', ' ')}{via}, which rollout.engine={engine.name} cannot take"
                          + _note(engine, "weight_channels") + f"; it takes "
                          f"{' or '.join(c.replace('_', ' ') for c in engine.weight_channels)}"
                          + ("; set rollout.weight_sync=auto, or rollout.engine "
                             f"{_those(lambda e: channel in e.weight_channels)}"
                             if channel == "collective" else ""))
    if channel != "collective":
        return
    if not inflight_mode(cfg.async_.inflight_update).drains or family.drains_at_turns(cfg):
        raise ConfigError(f"{asked} hands weights over between batches only (every worker joins each "
                          f"broadcast), and async.inflight_update={cfg.async_.inflight_update}; set "
                          "async.inflight_update=drain (without turn boundaries) or rollout.weight_sync=auto")
    if cfg.rollout.on_worker_loss == "replace":
        raise ConfigError(f"{asked} forms its group once, with every worker, so a lost worker cannot be "
                          "replaced into it, and rollout.on_worker_loss=replace (the default); set "
                          "rollout.on_worker_loss=stop, or rollout.weight_sync=auto")


def _those(fits: Callable[[Any], bool]) -> str:
    """The registered engines that ``fits`` accepts, for a refusal ('none registered' when none)."""
    names = [n for n in registry.engines.names() if fits(registry.engines.get(n))]
    return " or ".join(names) if names else "(none registered does)"


def _note(plugin: Any, axis: str) -> str:
    note = plugin.notes.get(axis)
    return f" ({note})" if note else ""


def _why(caps: Any, name: str) -> str:
    note = caps.notes.get(name)
    return f" ({note})" if note else ""

