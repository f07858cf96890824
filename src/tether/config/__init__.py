"""Typed, strict configuration: YAML recipes plus dotted overrides."""

from tether.config.config import (
           Config,
           apply_overrides,
           load_config,
           load_resumed,
           parse_override,
           read_recipe,
)
from tether.config.reference import reference_markdown

__all__ = ["Config", "apply_overrides", "load_config", "load_resumed", "parse_override", "read_recipe",
           "reference_markdown"]
