"""One table of every recipe key, core and plug-in sections alike: who reads it, what a resume does
when it changes, the feature it asks of a family, and its help.

Each entry is read from what its definition declares (``knob(..., resume=, owner=, feature=,
dropped=)``, a section's ``RESUME``) and from what the plug-ins declare (a family's, engine's or
backend's own ``section`` and the ``keys`` of shared sections it reads). The resume rules
(``tether.runtime.rundir.resume_changes``), the checks of who owns a key and which feature a key
asks for (``tether.config.features``) and the reference's "on resume" column are generated from it;
``disagreements`` lists where a key's declaration and the plug-ins' disagree (a test keeps it empty).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from tether import registry
from tether.config.fields import Dropped, Resume, recipe_value, section_fields
from tether.config.schema import SECTIONS
from tether.plugins import section_name

KINDS = {"families": "family", "engines": "engine", "backends": "backend"}
"""The registries whose plug-ins may own a section or keys, and the owner kind each is."""


@dataclass(frozen=True)
class Key:
    """One recipe key."""

    key: str
    """``section.name``."""
    section: str
    owner: str
    """``core``, or the kind of plug-in that reads it (``family``, ``engine``, ``backend``)."""
    readers: tuple[str, ...]
    """The plug-ins of that kind that read it (empty for core): another one chosen refuses it when
    set."""
    resume: Resume
    help: str
    feature: str | None = None
    """The optional family feature (``tether.config.features.FEATURES``) setting it asks for."""
    dropped: str | None = None
    """When a resume drops the recorded value (a move to a smaller set-up), in words, or None."""
    drop: Callable[[Mapping[str, Any]], str | None] | None = dataclasses.field(default=None, compare=False,
                                                                              repr=False)
    """Of a resumed recipe (a plain mapping): why it drops the recorded value, or None to keep it
    (``tether.config.config.load_resumed``)."""
    declared_owner: str = "core"
    """The owner its ``knob`` declares (``disagreements`` compares it with the plug-ins' claims)."""

    @property
    def on_resume(self) -> str:
        """What a resume does when it changes this key, in words."""
        return f"{self.resume.label}; dropped {self.dropped}" if self.dropped else self.resume.label


def _plugins() -> Iterator[tuple[str, str, Any]]:
    """(registry kind, name, plug-in) of every registered family, engine and backend."""
    for kind in KINDS:
        reg = getattr(registry, kind)
        for name in reg.names():
            yield kind, name, reg.get(name)


def section_resume(cls: type, owner: str) -> Resume:
    """What a resume does with a key of section ``cls`` that does not say: the section's
    ``RESUME``; accepted in an engine's or backend's own section (where and how the work runs, not
    what is trained); else refused as changing how training continues."""
    declared = getattr(cls, "RESUME", None)
    if declared is not None:
        return declared
    return Resume.ACCEPTED if owner in ("engine", "backend") else Resume.TRAINING


def _dropped_with_plugin(kind: str, readers: tuple[str, ...]) -> Dropped:
    """A key read only by some engines (backends) is dropped by a resume that chooses another."""
    reg = getattr(registry, kind)
    section, name = reg.key.split(".")
    default = getattr(SECTIONS[section](), name)

    def why(recipe: Mapping[str, Any]) -> str | None:
        chosen = reg.canonical(str(recipe_value(recipe, reg.key, default)))
        if chosen in readers:
            return None
        return f"read only with {reg.key}={readers[0]}, and the resume sets {reg.key}={chosen}"

    return Dropped(f"when the resume sets another {reg.key}", why)


def _either(*drops: Dropped | None) -> tuple[str | None, Callable[[Mapping[str, Any]], str | None] | None]:
    """The words and the reason of several ways to be dropped: the first that applies."""
    drops = tuple(d for d in drops if d is not None)
    if not drops:
        return None, None
    return ", or ".join(d.when for d in drops), lambda recipe: next(
        (why for d in drops if (why := d.why(recipe)) is not None), None)


_cache: dict[int, dict[str, Key]] = {}


def table() -> Mapping[str, Key]:
    """Every key of every section (Tether's, then each registered plug-in's own), in order. Built
    again when the registered plug-ins change (``registry.generation``); not to be changed."""
    generation = registry.generation()
    if generation not in _cache:
        _cache.clear()
        _cache[generation] = _build()
    return MappingProxyType(_cache[generation])


def feature_keys(feature: str) -> tuple[str, ...]:
    """The keys whose definition names ``feature`` (``knob(feature=...)``)."""
    return tuple(k.key for k in table().values() if k.feature == feature)


def _build() -> dict[str, Key]:
    claims: dict[str, list[tuple[str, str]]] = {}  # key → (registry kind, plug-in) naming it
    own_sections: dict[str, tuple[str, str, type]] = {}  # section → (registry kind, plug-in, class)
    for kind, name, plugin in _plugins():
        for key in plugin.keys:
            claims.setdefault(key, []).append((kind, name))
        if plugin.section is not None:
            own_sections.setdefault(plugin.section[0], (kind, name, plugin.section[1]))
    sections: dict[str, tuple[type, str | None, str | None]] = {
        name: (cls, None, None) for name, cls in SECTIONS.items() if name not in own_sections}
    for section, (kind, name, cls) in own_sections.items():
        sections[section] = (cls, kind, name)
    out: dict[str, Key] = {}
    for section, (cls, kind, plugin) in sections.items():
        owner = KINDS[kind] if kind else "core"
        default_resume = section_resume(cls, owner)
        for name, field in section_fields(cls).items():
            key = f"{section}.{name}"
            meta = field.metadata
            declared = meta.get("owner", "core")
            if kind:  # a plug-in's own section: every key is its own
                key_owner, readers, with_kind = owner, (plugin,), kind
            else:
                theirs = claims.get(key, [])
                kinds = sorted({k for k, _ in theirs})
                with_kind = kinds[0] if len(kinds) == 1 else None
                key_owner = KINDS[with_kind] if with_kind else "core"
                readers = tuple(n for _, n in theirs)
            by_plugin = with_kind in ("engines", "backends")  # read by an engine or backend: another drops it
            dropped, drop = _either(_dropped_with_plugin(with_kind, readers) if by_plugin else None,
                                    meta.get("dropped"))
            out[key] = Key(key=key, section=section, owner=key_owner, readers=readers,
                           resume=meta.get("resume") or default_resume, help=meta.get("help", ""),
                           feature=meta.get("feature"), dropped=dropped, drop=drop,
                           declared_owner=owner if kind else declared)
    return out


def disagreements(keys: Mapping[str, Key] | None = None) -> list[str]:
    """Where a key's declaration and the plug-ins' claims disagree: a key of a shared section
    claimed by plug-ins of more than one kind, by plug-ins while its ``knob`` says ``core``, or by
    none while its ``knob`` names a kind of plug-in; a key claimed that no section has; a feature no
    family can have."""
    from tether.config.features import FEATURE_NAMES

    keys = table() if keys is None else keys
    problems = []
    claimed: dict[str, list[str]] = {}
    for kind, name, plugin in _plugins():
        for key in plugin.keys:
            claimed.setdefault(key, []).append(f"{KINDS[kind]} {name}")
            if key not in keys:
                problems.append(f"{KINDS[kind]} {name} names {key}, which no section has")
    for entry in keys.values():
        who = claimed.get(entry.key, [])
        if len({w.split()[0] for w in who}) > 1:
            problems.append(f"{entry.key} is claimed by plug-ins of more than one kind: {', '.join(who)}")
        elif entry.owner != entry.declared_owner:
            problems.append(f"{entry.key}: its knob says owner={entry.declared_owner!r}, but "
                            + (f"{', '.join(who)} read(s) it" if who else "no plug-in names it in its keys"))
        if entry.feature is not None and entry.feature not in FEATURE_NAMES:
            problems.append(f"{entry.key} asks for feature {entry.feature!r}, which is not a feature")
    return problems


def resume_of(key: str, keys: Mapping[str, Key] | None = None) -> Resume:
    """What a resume does when it changes ``key`` (``section.name``); a key no section has now (a
    plug-in's that is not loaded, a run recorded by another version) takes its section's rule when
    the section is known, else is refused as changing how training continues."""
    keys = table() if keys is None else keys
    if key in keys:
        return keys[key].resume
    section = key.split(".", 1)[0]
    for entry in keys.values():
        if entry.section == section:
            cls = _class_of(section)
            return section_resume(cls, entry.owner) if cls is not None else Resume.TRAINING
    return Resume.TRAINING


_NO_DEFAULT = object()


def default_of(key: str) -> Any:
    """The value ``key`` (``section.name``) has when a recipe leaves it unset, in recipe form (a
    tuple as a list), or ``_NO_DEFAULT`` for a key no known section has."""
    section, _, name = key.partition(".")
    cls = _class_of(section)
    if cls is None:
        return _NO_DEFAULT
    try:
        value = dataclasses.asdict(cls()).get(name, _NO_DEFAULT)
    except TypeError:  # a section whose keys have no defaults
        return _NO_DEFAULT
    return list(value) if isinstance(value, tuple) else value


def _class_of(section: str) -> type | None:
    if section in SECTIONS:
        return SECTIONS[section]
    for _, _, plugin in _plugins():
        if section_name(plugin) == section:
            return plugin.section[1]
    return None


__all__ = ["KINDS", "Key", "default_of", "disagreements", "resume_of", "section_resume", "table"]
