"""Typed, documented config fields and the strict checks every section shares.

A section is a frozen dataclass whose fields are declared with ``knob(...)``: a default, one
sentence of help, the allowed range or choices, and what the key is to the rest of Tether: who
reads it (``owner``), what a resume does when it changes (``resume``), and the optional feature
a family must have for it to be set (``feature``). ``tether.config.keys`` gathers them into one
table per key. ``build_section`` turns a plain mapping into
a section, refusing unknown keys (naming the closest valid one) and values of the wrong type or
range (saying what is allowed).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from tether.errors import ConfigError
from tether.registry import Registry

_MISSING = dataclasses.MISSING


class Resume(enum.Enum):
    """What a resume (``tether train --resume``) does when it changes a key: accept it, or refuse
    it (``--force`` accepts it anyway) for the reason given."""

    ACCEPTED = "accepted"
    PROMPTS = "changes the prompt stream (which prompts each batch holds)"
    HELD_OUT = "changes the held-out set the run's evaluations are measured on"
    SCHEDULE = "changes the staleness schedule and version clock already trained"
    TRAINING = "changes how training continues from the checkpoint"

    @property
    def refused(self) -> bool:
        return self is not Resume.ACCEPTED

    @property
    def why(self) -> str:
        """Why a change is refused (the reason a refusal gives)."""
        return self.value

    @property
    def label(self) -> str:
        """A few words for the reference's "on resume" column."""
        return {"ACCEPTED": "accepted", "PROMPTS": "refused: the prompt stream",
                "HELD_OUT": "refused: the held-out set", "SCHEDULE": "refused: the staleness schedule",
                "TRAINING": "refused: how training continues"}[self.name]


@dataclasses.dataclass(frozen=True)
class Dropped:
    """When a resume drops a key's recorded value, because its move to a smaller set-up leaves the
    key nothing to act on: ``when`` in words (for the reference), and ``why`` of the resumed recipe
    (a plain mapping of sections), the reason the log gives, or None when it is kept."""

    when: str
    why: Callable[[Mapping[str, Any]], str | None]


def recipe_value(recipe: Mapping[str, Any], key: str, default: Any) -> Any:
    """``section.name`` of a plain recipe mapping, or ``default`` when it is not set."""
    section, name = key.split(".")
    values = recipe.get(section)
    return values.get(name, default) if isinstance(values, Mapping) else default


OWNER_KINDS = ("core", "family", "engine", "backend")
"""Who reads a key of a shared section: Tether itself, or the families (engines, backends) that
name it in their ``keys``; any other is refused when set (``tether.config.features``)."""


def knob(default: Any, help: str, *, min: float | None = None, max: float | None = None,
         choices: Iterable[str] | None = None, resume: Resume | None = None, owner: str = "core",
         feature: str | None = None, dropped: Dropped | None = None, allowed: str | None = None) -> Any:
    """Declare a config field with its default, help text and allowed values. ``choices`` may be
    a ``tether.registry.Registry``: its names are read when a value is checked (plug-ins add
    names), and a former name it still knows is replaced by the current one.

    ``resume``: what a resume does when it changes the key (None: the section's ``RESUME``, else
    ``Resume.TRAINING``). ``owner``: the kind of plug-in that reads it when not Tether itself
    (the plug-ins of that kind that do name it in their ``keys``). ``feature``: the optional
    family feature that setting it away from its default asks for. ``dropped``: when a resume
    drops the recorded value because the move to a smaller set-up leaves it nothing to act on.
    ``allowed``: the whole allowed range in words, where ``min`` and ``max`` do not say it all (a
    bound checked later, where it depends on other keys): the reference shows it, and a value
    outside ``min`` or ``max`` is refused naming it."""
    if choices is not None and not isinstance(choices, Registry):
        choices = tuple(choices)
    assert owner in OWNER_KINDS, owner
    meta = {"help": help, "min": min, "max": max, "choices": choices, "resume": resume, "owner": owner,
            "feature": feature, "dropped": dropped, "allowed": allowed}
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def closest(name: str, options: Iterable[str]) -> str | None:
    """The closest valid spelling of ``name`` among ``options``, if any is close."""
    matches = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return matches[0] if matches else None


def describe_type(tp: Any) -> str:
    """A short human name for a field's type."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        return f"list of {describe_type(typing.get_args(tp)[0])}s"
    if origin is dict:
        names, amounts = (describe_type(a) for a in typing.get_args(tp))
        return f"mapping of {names}s to {amounts}s"
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return f"{describe_type(args[0])} or null"
    return {int: "integer", float: "number", str: "string", bool: "true/false", Any: "value"}.get(tp, str(tp))


def coerce(key: str, tp: Any, value: Any) -> Any:
    """Check ``value`` against ``tp``; return it in canonical form or raise ``ConfigError``."""
    origin = typing.get_origin(tp)
    wrong = ConfigError(f"{key} must be {_a(describe_type(tp))}, got {value!r} ({type(value).__name__})")
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return coerce(key, inner, value)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            hint = closest(str(value), [str(a) for a in allowed])
            extra = f" (did you mean {hint!r}?)" if hint else ""
            raise ConfigError(
                f"{key} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}{extra}"
            )
        return value
    if origin in (list, tuple):
        (inner,) = typing.get_args(tp)[:1]
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
            value = [coerce(f"{key}[{i}]", inner, _scalar(v)) for i, v in enumerate(value)]
        elif isinstance(value, list | tuple):
            value = [coerce(f"{key}[{i}]", inner, v) for i, v in enumerate(value)]
        elif value is not None and not isinstance(value, dict):
            value = [coerce(f"{key}[0]", inner, value)]  # a single value is a one-element list
        else:
            raise wrong
        return tuple(value) if origin is tuple else list(value)
    if origin is dict:  # a YAML mapping, also from an override: key={name: 1, other: 0.5}
        if not isinstance(value, Mapping):
            raise wrong
        names, amounts = typing.get_args(tp)
        return {coerce(f"{key} (a name)", names, k): coerce(f"{key}[{k!r}]", amounts, v)
                for k, v in value.items()}
    if tp is Any:  # any YAML value (a mapping handed on as it is, e.g. an environment's arguments)
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise wrong
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no decimal point) as a string
            try:
                value = float(value)
            except ValueError:
                raise wrong from None
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise wrong
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise wrong
        return value
    raise TypeError(f"unsupported config type {tp!r} for {key}")


def _a(noun: str) -> str:
    """'integer' → 'an integer'; leaves choices and compound names alone."""
    if noun in ("integer",):
        return "an integer"
    if noun.startswith("mapping "):
        return f"a {noun}"
    if noun in ("number", "string"):
        return f"a {noun}"
    return noun


def _scalar(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


def check_range(key: str, value: Any, meta: Mapping[str, Any]) -> None:
    lo, hi, choices = meta.get("min"), meta.get("max"), meta.get("choices")
    values = (list(value.values()) if isinstance(value, Mapping)
              else value if isinstance(value, list | tuple) else [value])
    for v in values:
        if v is None:
            continue
        allowed = f" (allowed: {meta['allowed']})" if meta.get("allowed") else ""
        if lo is not None and v < lo:
            raise ConfigError(f"{key} must be >= {lo:g}{allowed}, got {v!r}")
        if hi is not None and v > hi:
            raise ConfigError(f"{key} must be <= {hi:g}{allowed}, got {v!r}")
        if choices is not None and v not in choices:
            names = choice_names(choices)
            hint = closest(str(v), names)
            extra = f" (did you mean {hint!r}?)" if hint else ""
            more = "; plug-ins add more (run.plugins)" if isinstance(choices, Registry) else ""
            raise ConfigError(f"{key} must be one of {', '.join(repr(n) for n in names)}, got {v!r}{extra}"
                              + more)


def choice_names(choices: Any) -> list[str]:
    """The allowed values of a ``choices`` (a tuple, or a registry's names)."""
    return list(choices.names()) if isinstance(choices, Registry) else list(choices)


def section_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def build_section(cls: type, data: Mapping[str, Any], prefix: str,
                  elsewhere: Mapping[str, list[str]] | None = None) -> Any:
    """Build section ``cls`` from ``data``, strictly.

    ``elsewhere`` maps key names to the sections they live in, so a key put in the wrong section
    is answered with its right place.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix} must be a mapping of keys to values, got {data!r}")
    fields = section_fields(cls)
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}.{name}"
        if name not in fields:
            raise ConfigError(unknown_key_message(key, str(name), fields, prefix, elsewhere))
        value = coerce(key, hints[name], value)
        check_range(key, value, fields[name].metadata)
        choices = fields[name].metadata.get("choices")
        if isinstance(choices, Registry) and value is not None:
            value = choices.canonical(value)
        values[name] = value
    return cls(**values)


def unknown_key_message(key: str, name: str, fields: Iterable[str], prefix: str,
                        elsewhere: Mapping[str, list[str]] | None) -> str:
    if elsewhere and name in elsewhere:
        homes = " or ".join(f"{home}.{name}" for home in elsewhere[name])
        return f"unknown key {key!r}; {name} belongs in another section: {homes}"
    hint = closest(name, fields)
    if hint:
        return f"unknown key {key!r}; did you mean {prefix}.{hint}?"
    valid = ", ".join(sorted(fields))
    return f"unknown key {key!r}; valid keys in {prefix!r} are: {valid}"
