"""Generate the reference of every recipe key (``docs/reference.md``) from the schema."""

from __future__ import annotations

import typing

from tether import registry
from tether.config.config import plugin_section_classes
from tether.config.fields import describe_type, section_fields
from tether.config.keys import resume_of, table
from tether.config.schema import SECTIONS


def _default(field) -> str:
    import dataclasses

    value = field.default if field.default is not dataclasses.MISSING else field.default_factory()
    return "`" + (repr(value) if not isinstance(value, str) else f'"{value}"') + "`"


def _allowed(field, tp) -> str:
    meta = field.metadata
    parts = []
    if meta.get("allowed"):
        parts.append(meta["allowed"])
    elif meta.get("min") is not None:
        parts.append(f"≥ {meta['min']:g}")
    if meta.get("max") is not None and not meta.get("allowed"):
        parts.append(f"≤ {meta['max']:g}")
    choices = meta.get("choices")
    if choices is not None:  # a registry's built-in names: plug-ins add to them
        parts.append(" | ".join(choices.builtins if isinstance(choices, registry.Registry) else choices))
    return ", ".join(parts)


def _sections() -> dict[str, type]:
    """Tether's sections in order, the built-in backends' and engines' after ``rollout``, the
    built-in families' last."""
    runners = [registry.backends.get(n).section for n in registry.backends.builtins]
    runners += [registry.engines.get(n).section for n in registry.engines.builtins]
    out: dict[str, type] = {}
    for name, cls in SECTIONS.items():
        out[name] = cls
        if name == "rollout":
            out.update(s for s in runners if s is not None)
    return {**out, **plugin_section_classes(builtin_only=True)}


def _on_resume(keys: dict, key: str) -> str:
    entry = keys.get(key)
    return entry.on_resume if entry is not None else resume_of(key, keys).label


def reference_markdown() -> str:
    """The whole reference as Markdown."""
    lines = [
        "# Recipe reference",
        "",
        "Every key a recipe may set, with its default and meaning. Generated from",
        "`src/tether/config/schema.py` (with `learning.py`, `outputs.py` and `support.py` beside it; the own",
        "section of an engine, a backend or a family: its plug-in under `src/tether/rollout/` or",
        "`src/tether/families/`) by `tether config reference`; do not edit by hand.",
        "",
        "Set keys in a YAML recipe (`section:` then `key: value`) or on the command line as",
        "`section.key=value`. An unknown or misspelled key is an error naming the closest valid",
        "one; a value of the wrong type or range says what is allowed. \"On resume\" is what",
        "`tether train --resume` does when it changes the key (docs/guide.md §6): a refused change",
        "passes with `--force`; a dropped key's recorded value is left out when the resume moves to a",
        "smaller set-up, unless the resume sets it.",
        "",
    ]
    keys = table()
    for name, cls in _sections().items():
        hints = typing.get_type_hints(cls)
        lines += [f"## `{name}`", "", (cls.__doc__ or "").strip(), "",
                  "| key | type | default | allowed | meaning | on resume |",
                  "|---|---|---|---|---|---|"]
        for key, field in section_fields(cls).items():
            help_text = field.metadata["help"].replace("|", "\\|")
            lines.append(
                f"| `{name}.{key}` | {describe_type(hints[key]).replace('|', '/')} | "
                f"{_default(field)} | {_allowed(field, hints[key])} | {help_text} | "
                f"{_on_resume(keys, f'{name}.{key}')} |"
            )
        lines.append("")
    return "\n".join(lines)
