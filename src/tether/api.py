"""``tether.train`` from Python: a recipe (a ``Config``, a mapping, a YAML path) plus the user's own
Python objects — a reward function, an environment class, plug-ins — handed over directly.

A run's processes (rollout workers, learner ranks, Ray actors) are told the recipe, not handed
objects, so each object becomes a name every process can load (docs/api.md):

- a function or class defined at the top level of a module: ``module:name`` when the module is
  importable by name, else ``path/to/file.py:name`` (a script, ``__main__``, is its file; Tether
  imports it in each worker up to its ``tether.train`` call, which ends that import there);
- anything else that pickles (a ``functools.partial`` of such a function, an instance of such a
  class) by value: written to a small module file of its own, under the system's temporary folder;
- a lambda, a nested function, or an object that does not pickle is refused, naming it.

What the calling script registers (``@tether.register_reward`` and the others) reaches every
process too: its file (or module) is added to ``run.plugins``. Tether's own child processes do not
run the calling script as their ``__main__``, so no ``if __name__ == "__main__":`` guard is needed.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import json
import os
import pickle
import sys
import tempfile
import time
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tether import registry
from tether.errors import ConfigError

STAMP = "%Y%m%d-%H%M%S"
_LOADED_AS_FILE = ("__main__", "__mp_main__")
_TETHERS = ("tether_user_", "tether_plugin_")
_USER_KINDS = ("families", "tasks", "rewards", "losses", "advantages", "kl_estimators", "engines", "backends")


def train(cfg: Any = None, overrides: Sequence[str] = (), *, reward: Any = None, env: Any = None,
          plugins: Sequence[Any] = (), run_dir: str | os.PathLike[str] | None = None, resume: bool = False,
          force: bool = False, progress_plain: bool | None = None) -> dict:
    """Train (or, with ``resume=True``, continue) a run; returns its summary (``summary.json``).

    ``cfg``: a ``Config``, a mapping of sections, a path to a YAML recipe, or None (the defaults);
    ``overrides``: ``section.key=value`` strings, as on the command line. ``reward``: a function
    ``fn(prompt, completion, answer, fields) -> float`` or a ``reward.function`` name (a list of
    them: ``reward.functions``); ``env``: an environment class (``env.env_class``, agent family);
    ``plugins``: files, module names or modules (``run.plugins``). ``run_dir``: where the run goes
    (default ``runs/<script or recipe>-<time>``); with ``resume=True`` the run to continue."""
    if registry.in_user_import():  # Tether is importing the calling script (a worker, a plug-in)
        raise registry.ScriptReentered
    if _caller_module() == "__mp_main__":
        raise ConfigError(
            "tether.train was called while a child process re-ran this script as its __main__ (a "
            "multiprocessing process this script started, not one of Tether's); put the call under "
            "`if __name__ == \"__main__\":`")
    from tether.config import Config, apply_overrides, load_resumed, read_recipe
    from tether.runtime.run import train as run_train

    extra = _object_overrides(reward=reward, env=env, plugins=plugins)
    if resume:
        if cfg is not None:
            raise ConfigError("tether.train(resume=True) continues the run's own recipe (its config.yaml); "
                              "drop cfg and give changes as overrides")
        if run_dir is None:
            raise ConfigError("tether.train(resume=True) needs run_dir: the run to continue")
        run_dir = Path(run_dir)
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
        recorded = read_recipe(run_dir / "config.yaml")
        given = [*overrides, *_overrides_text(extra, recorded)]
        with _children_skip_main():
            config, _ = load_resumed(run_dir / "config.yaml", given)
            return run_train(config, run_dir, resume=True, force=force, overrides=given,
                             progress_plain=progress_plain)
    data, stem = _recipe(cfg, read_recipe)
    given = [*overrides, *_overrides_text(extra, apply_overrides(data, overrides))]
    with _children_skip_main():
        config = Config.from_dict(apply_overrides(data, given))
        where = Path(run_dir) if run_dir is not None else Path("runs") / f"{stem}-{time.strftime(STAMP)}"
        return run_train(config, where, force=force, overrides=given, progress_plain=progress_plain)


def _caller_module() -> str | None:
    """The name of the module that called ``tether.train`` (the first frame outside Tether)."""
    frame = registry.caller_outside_tether()
    return None if frame is None else frame.f_globals.get("__name__")


def _recipe(cfg: Any, read_recipe) -> tuple[dict[str, Any], str]:
    """(the recipe as a mapping, the default run directory's stem)."""
    from tether.config import Config

    main = getattr(sys.modules.get("__main__"), "__file__", None)
    stem = Path(main).stem if main else "train"
    if cfg is None:
        return {}, stem
    if isinstance(cfg, Config):
        return cfg.to_dict(), stem
    if isinstance(cfg, Mapping):
        return {k: dict(v) if isinstance(v, Mapping) else v for k, v in cfg.items()}, stem
    if isinstance(cfg, str | os.PathLike):
        return read_recipe(cfg), Path(cfg).stem
    raise ConfigError(f"tether.train: cfg must be a Config, a mapping of sections, a path to a YAML recipe "
                      f"or None, got {type(cfg).__name__}")


def _object_overrides(*, reward: Any, env: Any, plugins: Sequence[Any]) -> dict[str, Any]:
    """Recipe keys (``section.key`` → value) for the objects handed to ``tether.train``."""
    out: dict[str, Any] = {}
    if reward is not None:
        if isinstance(reward, list | tuple):
            out["reward.functions"] = [reference(r, what="reward") for r in reward]
        else:
            out["reward.function"] = reference(reward, what="reward")
    if env is not None:
        out["env.env_class"] = reference(env, what="env")
    if isinstance(plugins, str | os.PathLike | types.ModuleType):
        plugins = [plugins]
    out["run.plugins"] = [*(_plugin(p) for p in plugins), *_registering_modules()]
    return out


def _overrides_text(extra: dict[str, Any], recipe: Mapping[str, Any]) -> list[str]:
    """``extra`` as override strings (JSON values read as YAML); plug-ins added to the recipe's own."""
    out = []
    for key, value in extra.items():
        if key == "run.plugins":
            have = list((recipe.get("run") or {}).get("plugins") or [])
            value = [p for p in dict.fromkeys(value) if p not in have]
            if not value:
                continue
            value = [*have, *value]
        out.append(f"{key}={json.dumps(value)}")
    return out


def reference(obj: Any, *, what: str) -> str:
    """A name for ``obj`` that every process of a run can load (``tether.pyload``); a string
    is taken as one already."""
    if isinstance(obj, str):
        return obj
    if isinstance(obj, os.PathLike):
        raise ConfigError(f"{what}={obj!r}: give a function or class, or a string path/to/file.py:name")
    found = _top_level(obj)
    if found is not None:
        return found
    return _by_value(obj, what=what)


def _top_level(obj: Any) -> str | None:
    module_name, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not (isinstance(module_name, str) and isinstance(qualname, str)) or not qualname.isidentifier():
        return None  # a lambda, a nested function, a method: not reachable by its name
    module = sys.modules.get(module_name)
    if module is None or getattr(module, qualname, None) is not obj:
        return None
    file = getattr(module, "__file__", None)
    if module_name in _LOADED_AS_FILE or module_name.startswith(_TETHERS):
        return f"{Path(file).resolve()}:{qualname}" if file else None
    return f"{module_name}:{qualname}"


def _by_value(obj: Any, *, what: str) -> str:
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    fix = (f"define it at the top level of a file (a script or a module) and pass it by name "
           f"(here: {what}={name} as a def or class of its own)")
    try:
        data = pickle.dumps(obj)
        pickle.loads(data)
    except Exception as exc:  # any failure to pickle: not by value
        raise ConfigError(f"tether.train: {what} {obj!r} cannot reach Tether's worker processes: it is not "
                          f"defined at the top level of a module, and it does not pickle ({exc}); {fix}") \
            from None
    if b"__main__" in data or b"__mp_main__" in data:
        raise ConfigError(f"tether.train: {what} {obj!r} cannot reach Tether's worker processes: it pickles "
                          "by reference to this script's __main__, which they do not run; " + fix)
    folder = Path(tempfile.gettempdir()) / f"tether-objects-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / f"object_{hashlib.sha1(data).hexdigest()[:16]}.py"
    if not path.is_file():
        text = ("# Written by tether.train: a Python object handed over by value, for each process of a run\n"
                f"import pickle\n\nobj = pickle.loads({data!r})\n")
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(text)
        partial.replace(path)
    return f"{path}:obj"


def _plugin(spec: Any) -> str:
    if isinstance(spec, types.ModuleType):
        file = getattr(spec, "__file__", None)
        if spec.__name__ in _LOADED_AS_FILE or spec.__name__.startswith(_TETHERS):
            if not file:
                raise ConfigError(f"tether.train: plugins={spec!r} has no file for the run to import")
            return str(Path(file).resolve())
        return spec.__name__
    if isinstance(spec, os.PathLike):
        return str(Path(spec).resolve())
    if isinstance(spec, str):
        return str(Path(spec).resolve()) if spec.endswith(".py") else spec
    raise ConfigError(f"tether.train: a plug-in is a path/to/file.py, a module name or a module: {spec!r}")


def _registering_modules() -> list[str]:
    """Plug-ins for what this process registered outside ``run.plugins`` (the calling script's
    ``@tether.register_*``): its file or module, so the run's other processes register it too."""
    out = []
    for kind in _USER_KINDS:
        reg = getattr(registry, kind, None)
        if not isinstance(reg, registry.Registry):
            continue
        for name in reg.names():
            if name in reg.builtins:
                continue
            obj = reg.get(name)
            defined = obj if isinstance(obj, type | types.FunctionType) else type(obj)
            module_name = getattr(defined, "__module__", "") or ""
            if module_name == "tether" or module_name.startswith(("tether.", *_TETHERS)):
                continue
            module = sys.modules.get(module_name)
            file = getattr(module, "__file__", None)
            if module_name in _LOADED_AS_FILE:
                if file:
                    out.append(str(Path(file).resolve()))
            elif module is not None:
                out.append(module_name)
    return list(dict.fromkeys(out))


@contextlib.contextmanager
def _children_skip_main() -> Iterator[None]:
    """While the run starts its processes: a spawned process (a rollout worker, a learner rank) does
    not run the calling script again as its ``__main__`` (multiprocessing does unless the main
    module's spec names ``__main__``); what the run needs from the script reaches it by name."""
    main = sys.modules.get("__main__")
    if main is None or not getattr(main, "__file__", None):
        yield
        return
    before = main.__dict__.get("__spec__")
    main.__spec__ = importlib.machinery.ModuleSpec("__main__", None)
    try:
        yield
    finally:
        main.__spec__ = before
