"""Load ``path/to/file.py:name`` from a user's file, with errors that say what was expected."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from tether.errors import ConfigError
from tether.registry import import_failure


def load_python_object(spec: str, *, what: str) -> Any:
    """The object ``name`` defined in the file ``path`` of ``spec = 'path:name'``."""
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text.endswith(".py") or not name.isidentifier():
        raise ConfigError(f"{what} {spec!r} must look like path/to/file.py:function_name")
    path = Path(path_text).resolve()
    if not path.is_file():
        raise ConfigError(f"{what} file {path_text!r} does not exist")
    module_name = f"tether_user_{path.stem}_{abs(hash(str(path)))}"
    module = sys.modules.get(module_name)
    if module is None:
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        assert loader_spec is not None and loader_spec.loader is not None
        module = importlib.util.module_from_spec(loader_spec)
        try:
            loader_spec.loader.exec_module(module)
        except (KeyboardInterrupt, ConfigError):  # a stop; the file's own clear refusal
            raise
        except BaseException as exc:  # sys.exit() too: it would end the run with no word
            raise import_failure(f"{what} file {path_text!r}", exc, ConfigError) from exc
        sys.modules[module_name] = module
    if not hasattr(module, name):
        defined = sorted(n for n in vars(module) if not n.startswith("_") and callable(vars(module)[n]))
        raise ConfigError(f"{what} file {path_text!r} defines no {name!r}; its functions are: "
                          f"{', '.join(defined) or 'none'}")
    obj = getattr(module, name)
    if not callable(obj):
        raise ConfigError(f"{what} {spec!r} is not callable")
    return obj
