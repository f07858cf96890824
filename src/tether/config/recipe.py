"""A recipe as text: a YAML file and ``section.key=value`` overrides, read into a plain mapping
of sections with errors that name the file or the override. ``Config.from_dict`` validates it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from tether.errors import ConfigError


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


__all__ = ["apply_overrides", "parse_override", "read_recipe"]
