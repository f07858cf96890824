"""A recipe as text: a YAML file and ``section.key=value`` overrides, read into a plain mapping
of sections with errors that name the file or the override. ``Config.from_dict`` validates it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from tether.errors import ConfigError


class _OneKeyOnceLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that gives a key twice (PyYAML would keep the last)."""


def _mapping_of_keys_once(loader: _OneKeyOnceLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            hash(key)
        except TypeError:
            continue  # construct_mapping refuses an unhashable key itself, naming it
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"{key!r} is given twice in one mapping (lines {seen[key]} and {line}); keep one",
                key_node.start_mark)
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_OneKeyOnceLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_of_keys_once)


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
    if p.is_dir():
        raise ConfigError(f"recipe {str(p)!r} is a folder; give a YAML recipe file (a run's is "
                          f"{str(p / 'config.yaml')!r})")
    if not p.is_file():
        raise ConfigError(f"recipe {str(p)!r} does not exist (give a path to a YAML file)")
    try:
        data = yaml.load(p.read_text(), Loader=_OneKeyOnceLoader)  # SafeLoader, keys once
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe {str(p)!r} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {str(p)!r} must be a mapping of sections, got {type(data).__name__}")
    return data


__all__ = ["apply_overrides", "parse_override", "read_recipe"]
