"""Load ``path/to/file.py:name`` (or ``module:name``) from a user's code, with errors that say what
was expected."""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from tether.errors import ConfigError
from tether.registry import (
    ScriptReentered,
    import_failure,
    importing_user_code,
    plugin_module_name,
    running_script,
)


def load_python_object(spec: str, *, what: str) -> Any:
    """The object ``name`` of ``spec``: ``path/to/file.py:name`` (defined in that file) or
    ``package.module:name`` (importable here)."""
    path_text, sep, name = spec.rpartition(":")
    if sep and name.isidentifier() and not path_text.endswith(".py") and _is_module_name(path_text):
        return _from_module(path_text, name, spec, what=what)
    if not sep or not path_text.endswith(".py") or not name.isidentifier():
        raise ConfigError(f"{what} {spec!r} must look like path/to/file.py:function_name")
    path = Path(path_text).resolve()
    if not path.is_file():
        raise ConfigError(f"{what} file {path_text!r} does not exist")
    module_name = f"tether_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    module = sys.modules.get(module_name) or sys.modules.get(plugin_module_name(path)) or running_script(path)
    if module is None:
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        assert loader_spec is not None and loader_spec.loader is not None
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module  # while it runs: its classes pickle by reference to it
        try:
            with importing_user_code():
                loader_spec.loader.exec_module(module)
        except ScriptReentered:
            pass  # a script that calls tether.train: what it defined above the call is there
        except (KeyboardInterrupt, ConfigError):  # a stop; the file's own clear refusal
            del sys.modules[module_name]
            raise
        except BaseException as exc:  # sys.exit() too: it would end the run with no word
            del sys.modules[module_name]
            raise import_failure(f"{what} file {path_text!r}", exc, ConfigError) from exc
    return _member(module, name, spec, f"{what} file {path_text!r}", what=what)


def _is_module_name(text: str) -> bool:
    return all(part.isidentifier() for part in text.split("."))


def _from_module(module_name: str, name: str, spec: str, *, what: str) -> Any:
    try:
        with importing_user_code():
            module = importlib.import_module(module_name)
    except ScriptReentered:
        module = sys.modules.get(module_name)
        if module is None:
            raise ConfigError(f"{what} {spec!r}: module {module_name!r} calls tether.train when imported; "
                              "give its file instead (path/to/file.py:name)") from None
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name == exc.name or module_name.startswith(f"{exc.name}.")):
            raise import_failure(f"{what} module {module_name!r}", exc, ConfigError) from exc
        raise ConfigError(f"{what} {spec!r}: cannot import module {module_name!r} ({exc}); give an "
                          "importable module or path/to/file.py:name") from exc
    except (KeyboardInterrupt, ConfigError):
        raise
    except BaseException as exc:
        raise import_failure(f"{what} module {module_name!r}", exc, ConfigError) from exc
    return _member(module, name, spec, f"{what} module {module_name!r}", what=what)


def _member(module: Any, name: str, spec: str, where: str, *, what: str) -> Any:
    obj = getattr(module, name, None)  # the name a recipe gave
    if obj is None:
        defined = sorted(n for n in vars(module) if not n.startswith("_") and callable(vars(module)[n]))
        hint = difflib.get_close_matches(name, defined, n=1, cutoff=0.6)
        raise ConfigError(f"{where} defines no {name!r}; its functions are: {', '.join(defined) or 'none'}"
                          + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    if not callable(obj):
        raise ConfigError(f"{what} {spec!r} is not callable")
    return obj
