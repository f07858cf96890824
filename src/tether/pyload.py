"""Load ``path/to/file.py:name`` (or ``module:name``) from a user's code, with errors that say what
was expected."""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import Any

from tether.errors import ConfigError
from tether.registry import import_user_file, import_user_module, plugin_module_name, user_module_name


def load_python_object(spec: str, *, what: str, callable_only: bool = True) -> Any:
    """The object ``name`` of ``spec``: ``path/to/file.py:name`` (defined in that file) or
    ``package.module:name`` (importable here); a callable unless ``callable_only`` is false."""
    path_text, sep, name = spec.rpartition(":")
    if sep and name.isidentifier() and not path_text.endswith(".py") and _is_module_name(path_text):
        return _from_module(path_text, name, spec, what=what, callable_only=callable_only)
    if not sep or not path_text.endswith(".py") or not name.isidentifier():
        raise ConfigError(f"{what} {spec!r} must look like path/to/file.py:function_name")
    path = Path(path_text).resolve()
    if not path.is_file():
        raise ConfigError(f"{what} file {path_text!r} does not exist")
    module = sys.modules.get(plugin_module_name(path)) or import_user_file(
        path, user_module_name(path), what=f"{what} file {path_text!r}", error=ConfigError)
    return _member(module, name, spec, f"{what} file {path_text!r}", what=what, callable_only=callable_only)


def _is_module_name(text: str) -> bool:
    return all(part.isidentifier() for part in text.split("."))


def _from_module(module_name: str, name: str, spec: str, *, what: str, callable_only: bool = True) -> Any:
    module = import_user_module(module_name, what=f"{what} module {module_name!r}",
                                missing=f"{what} {spec!r}: cannot import module {module_name!r}",
                                fix="give an importable module or path/to/file.py:name", error=ConfigError)
    if module is None:
        raise ConfigError(f"{what} {spec!r}: module {module_name!r} calls tether.train when imported; "
                          "give its file instead (path/to/file.py:name)")
    return _member(module, name, spec, f"{what} module {module_name!r}", what=what,
                   callable_only=callable_only)


def _member(module: Any, name: str, spec: str, where: str, *, what: str, callable_only: bool = True) -> Any:
    obj = getattr(module, name, None)  # the name a recipe gave
    if obj is None:
        defined = sorted(n for n in vars(module) if not n.startswith("_") and callable(vars(module)[n]))
        hint = difflib.get_close_matches(name, defined, n=1, cutoff=0.6)
        raise ConfigError(f"{where} defines no {name!r}; its functions are: {', '.join(defined) or 'none'}"
                          + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    if callable_only and not callable(obj):
        raise ConfigError(f"{what} {spec!r} is not callable")
    return obj
