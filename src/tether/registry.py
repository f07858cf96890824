"""Named things a recipe chooses, and the plug-ins that add more.

Each registry maps names to objects of one kind. Built-ins are declared as ``module:attribute``
strings and imported on first use, so validating a recipe's names loads no torch; a registration
adds an object at once. A name registered twice is refused; an unknown name is a ``ConfigError``
that lists the valid ones and the closest spelling.

    families          model.family          a policy family (``tether.vocabulary.Family``)
    engines           rollout.engine        what samples in a rollout worker (``tether.plugins.EnginePlugin``)
    backends          rollout.backend       where rollout workers run (``tether.plugins.BackendPlugin``)
    learner_layouts   (derived)             one process, ranks, or Ray actors (``tether.runtime.assemble``)
    losses            train.loss            fn(LossInputs, LossSettings) -> (per-column loss, metrics)
    advantages        train.advantage       fn(rewards (B, G), std_norm, scope, eps) -> (B, G)
    kl_estimators     train.kl_estimator    fn(logp, ref_logp) -> per-column KL
    tasks             data.task             a built-in task (``tether.data.tasks.Task``)
    rewards           reward.function       fn(prompt, completion, answer, fields) -> float

A recipe's ``run.plugins`` (files or modules) are imported before the rest of it is read, in
every process of the run, so what they register is there wherever the run needs it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any, Generic, TypeVar

from tether.errors import ConfigError, PluginError

T = TypeVar("T")


def _closest(name: str, options: Iterable[str]) -> str | None:
    import difflib

    matches = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return matches[0] if matches else None


_generation = 0  # moved by every registration and removal, in any registry


def generation() -> int:
    """A number that changes whenever a plug-in is registered or removed: what is computed from
    the registered plug-ins (the key table, the plug-in sections) is cached under it."""
    return _generation


def _changed() -> None:
    global _generation
    _generation += 1


class Registry(Generic[T]):
    """Names → objects of one kind. ``key`` is the recipe key that chooses among them, for
    messages. Each entry may carry ``meta``: facts about it that can be read without importing
    it (config checks use them)."""

    def __init__(self, kind: str, key: str, builtins: Mapping[str, str] | None = None, *,
                 meta: Mapping[str, Mapping[str, Any]] | None = None,
                 aliases: Mapping[str, str] | None = None) -> None:
        self.kind = kind
        self.key = key
        self._lazy: dict[str, str] = dict(builtins or {})
        self.builtins: tuple[str, ...] = tuple(self._lazy)
        """The names Tether ships with (what its reference documents)."""
        self._loaded: dict[str, T] = {}
        self._meta: dict[str, dict[str, Any]] = {k: dict(v) for k, v in (meta or {}).items()}
        self.aliases: dict[str, str] = dict(aliases or {})
        """Former names that still resolve (a run directory written with one resumes)."""
        self._origins: dict[str, str] = {}  # name → the file whose code registered it

    def register(self, name: str, obj: T, **meta: Any) -> T:
        """Add ``obj`` as ``name``; a name already taken (built-in or registered) is refused."""
        if not isinstance(name, str) or not name.isidentifier():
            raise PluginError(f"a {self.kind} name must be an identifier (letters, digits, _), got {name!r}")
        origin = registering_file()
        if origin is not None and self._origins.get(name) == origin:
            pass  # one file run twice (a script, and the same file as a plug-in): its newer run counts
        elif name in self or name in self.aliases:
            raise PluginError(f"a {self.kind} named {name!r} is already registered; choose another name")
        self._loaded[name] = obj
        self._meta[name] = dict(meta)
        if origin is not None:
            self._origins[name] = origin
        _changed()
        return obj

    def unregister(self, name: str) -> None:
        """Remove a registered entry (tests that register their own)."""
        self._loaded.pop(name, None)
        self._lazy.pop(name, None)
        self._meta.pop(name, None)
        self._origins.pop(name, None)
        _changed()

    def canonical(self, name: str) -> str:
        return self.aliases.get(name, name)

    def get(self, name: str) -> T:
        """The entry called ``name``; an unknown name raises ``ConfigError`` naming the valid ones."""
        name = self.canonical(name)
        if name in self._loaded:
            return self._loaded[name]
        if name not in self._lazy:
            raise ConfigError(self.unknown(name))
        module, _, attr = self._lazy[name].partition(":")
        obj = getattr(importlib.import_module(module), attr)
        self._loaded[name] = obj
        return obj

    def meta(self, name: str) -> Mapping[str, Any]:
        """What the entry declared about itself (empty when nothing)."""
        return self._meta.get(self.canonical(name), {})

    def unknown(self, name: str) -> str:
        hint = _closest(name, self.names())
        extra = f" (did you mean {hint!r}?)" if hint else ""
        return (f"unknown {self.kind} {name!r} for {self.key}{extra}; valid: {', '.join(self.names())} "
                "(plug-ins add more: run.plugins, docs/architecture.md)")

    def names(self) -> list[str]:
        return list(dict.fromkeys([*self._lazy, *self._loaded]))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (self.canonical(name) in self._lazy
                                          or self.canonical(name) in self._loaded)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


families: Registry[Any] = Registry(
    "family", "model.family",
    {"text": "tether.families.text:FAMILY", "flow": "tether.families.flow:FAMILY",
     "agent": "tether.families.agent:FAMILY"},
    aliases={"lm": "text"})
engines: Registry[Any] = Registry(
    "engine", "rollout.engine",
    {"torch": "tether.rollout.engines.torch:TORCH", "vllm": "tether.rollout.engines.vllm:VLLM"})
backends: Registry[Any] = Registry(
    "rollout backend", "rollout.backend",
    {"local": "tether.rollout.backends.local:LOCAL", "ray": "tether.rollout.backends.ray:RAY"})
learner_layouts: Registry[Callable[..., Any]] = Registry(
    "learner layout", "train.world_size / ray.learner",
    {"process": "tether.runtime.assemble:in_process", "ranks": "tether.runtime.assemble:local_ranks",
     "actor": "tether.runtime.assemble:ray_actors"})
losses: Registry[Callable[..., Any]] = Registry(
    "loss", "train.loss",
    {name: f"tether.train.losses:{name}" for name in ("ppo_clip", "gspo", "cispo")})
advantages: Registry[Callable[..., Any]] = Registry(
    "advantage estimator", "train.advantage",
    {name: f"tether.train.advantages:{name}" for name in ("grpo", "rloo", "reinforce_pp")},
    meta={"grpo": {"std_norm": True, "min_group_size": 2},
          "rloo": {"std_norm": False, "min_group_size": 2},
          "reinforce_pp": {"std_norm": False, "min_group_size": 1}})
kl_estimators: Registry[Callable[..., Any]] = Registry(
    "KL estimator", "train.kl_estimator",
    {name: f"tether.train.losses:kl_{name}" for name in ("k1", "k2", "k3")})
tasks: Registry[Any] = Registry(
    "task", "data.task",
    {**{name: f"tether.data.tasks.builtin:{name.upper()}"
        for name in ("arithmetic", "countdown", "reverse", "sort", "repeat", "question", "chat_sum")},
     "shapes": "tether.families.flow.task:SHAPES",
     "kv_lookup": "tether.families.agent.tasks:KV_LOOKUP",
     "guess_number": "tether.families.agent.tasks:GUESS_NUMBER",
     "tool_calc": "tether.families.agent.tasks:TOOL_CALC"})
rewards: Registry[Callable[..., Any]] = Registry(
    "reward function", "reward.function",
    {"exact_match": "tether.data.rewards:exact_match", "numeric_match": "tether.data.rewards:numeric_match",
     "math": "tether.data.rewards:math_verify"})


# -- registration, as the public API offers it ---------------------------------------------------


def register_family(family: Any) -> Any:
    """Add a policy family (``tether.vocabulary.Family``) under its ``name``; ``model.family``
    then accepts it. Returns it (usable as a class decorator on an instance's class)."""
    from tether.vocabulary import Family

    if not isinstance(family, Family):
        members = {m for cls in Family.__mro__ if cls is not object
                   for m in [*vars(cls), *vars(cls).get("__annotations__", {})] if not m.startswith("_")}
        missing = sorted(members - set(dir(family)))
        raise PluginError(f"{family!r} is not a tether Family (missing: {', '.join(missing) or '?'}); "
                          "see tether.vocabulary.Family and tether.families.base.FamilyBase")
    from tether.plugins import check_declared

    check_declared(family)  # its section, as an engine's or a backend's
    return families.register(family.name, family)


def register_engine(engine: Any) -> Any:
    """Add an engine (``tether.plugins.EnginePlugin``: its section, keys, what it supports, its
    checks, ``build``) under its ``name``; ``rollout.engine`` then accepts it. Returns it. What it
    declares was checked when it was made (``EnginePlugin.__post_init__``)."""
    from tether.plugins import EnginePlugin

    if not isinstance(engine, EnginePlugin):
        raise PluginError(f"{engine!r} is not a tether engine: declare it as a tether.EnginePlugin "
                          "(docs/architecture.md, 'Adding an engine')")
    return engines.register(engine.name, engine)


def register_backend(backend: Any) -> Any:
    """Add a rollout backend (``tether.plugins.BackendPlugin``: its section, keys, weight channel,
    checks, ``pool``) under its ``name``; ``rollout.backend`` then accepts it. Returns it. What it
    declares was checked when it was made (``BackendPlugin.__post_init__``)."""
    from tether.plugins import BackendPlugin

    if not isinstance(backend, BackendPlugin):
        raise PluginError(f"{backend!r} is not a tether backend: declare it as a tether.BackendPlugin "
                          "(docs/architecture.md)")
    return backends.register(backend.name, backend)


def _decorator(registry: Registry[Any], name: str, **meta: Any) -> Callable[[Any], Any]:
    def deco(obj: Any) -> Any:
        registry.register(name, obj, **meta)
        return obj
    return deco


def register_loss(name: str) -> Callable[[Any], Any]:
    """Decorator: ``fn(inputs: LossInputs, settings: LossSettings) -> (per-column loss (N, T),
    metrics)`` becomes ``train.loss=name``."""
    return _decorator(losses, name)


def register_advantage(name: str, *, std_norm: bool = False, min_group_size: int = 2) -> Callable[[Any], Any]:
    """Decorator: ``fn(rewards (B, G), *, std_norm, scope, eps) -> advantages (B, G)`` becomes
    ``train.advantage=name``. ``std_norm``: whether ``train.adv_std_norm`` and ``train.adv_scope``
    mean anything to it; ``min_group_size``: the smallest ``rollout.group_size`` it learns from."""
    return _decorator(advantages, name, std_norm=std_norm, min_group_size=min_group_size)


def register_kl(name: str) -> Callable[[Any], Any]:
    """Decorator: ``fn(logp, ref_logp) -> per-column KL(π_θ ‖ π_ref)`` becomes
    ``train.kl_estimator=name``."""
    return _decorator(kl_estimators, name)


def register_task(task: Any) -> Any:
    """Add a task (``tether.data.tasks.Task``, or any object with its members) under its ``name``."""
    return tasks.register(task.name, task)


def register_reward(name: str) -> Callable[[Any], Any]:
    """Decorator: ``fn(prompt, completion, answer, fields) -> float`` becomes ``reward.function=name``."""
    return _decorator(rewards, name)


def caller_outside_tether(*, with_file: bool = False) -> FrameType | None:
    """The innermost frame of code outside Tether in the current call (None: Tether's own, or
    nothing else); ``with_file``: of code read from a file (not ``<string>``, ``<frozen ...>``)."""
    here = Path(__file__).resolve().parent
    frame = sys._getframe(1)
    while frame is not None:
        file = frame.f_code.co_filename
        if not (with_file and file.startswith("<")) and here not in Path(file).resolve().parents:
            return frame
        frame = frame.f_back
    return None


def registering_file() -> str | None:
    """The file of the code outside Tether that is registering something (None: Tether itself)."""
    frame = caller_outside_tether(with_file=True)
    return None if frame is None else str(Path(frame.f_code.co_filename).resolve())


# -- user code: a script Tether imports ---------------------------------------------------------------

class ScriptReentered(BaseException):  # not an error: the end of a script's import
    """Raised by ``tether.train`` when it is called while Tether imports the user's file (a worker
    loading the script that named its own reward or environment, or the script as a plug-in): the
    import ends there, with what the file defined above the call, and the run is not started again."""


_user_imports = 0


@contextlib.contextmanager
def importing_user_code() -> Iterator[None]:
    """Marks Tether importing a user's file (``tether.train`` then ends the import, not a new run)."""
    global _user_imports
    _user_imports += 1
    try:
        yield
    finally:
        _user_imports -= 1


def in_user_import() -> bool:
    return _user_imports > 0


def running_script(path: Path) -> Any:
    """The ``__main__`` module when it is the file ``path`` (a script Tether is asked to import:
    it is not run a second time in the process that runs it), else None."""
    main = sys.modules.get("__main__")
    file = getattr(main, "__file__", None)
    return main if file and Path(file).resolve() == path.resolve() else None


# -- plug-ins -------------------------------------------------------------------------------------

_loaded_plugins: dict[str, str] = {}  # the spec as given → the module it became


def plugin_module_name(path: Path) -> str:
    """A plug-in file's module name: the same in every process of a run (so objects it defines
    pickle between them by reference), different for different files."""
    return _module_name("tether_plugin", path)


def user_module_name(path: Path) -> str:
    """The module name of a file a recipe names an object of (``path/to/file.py:name``), as
    ``plugin_module_name``."""
    return _module_name("tether_user", path)


def _module_name(prefix: str, path: Path) -> str:
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    return f"{prefix}_{path.stem}_{digest}"


def load_plugins(specs: Iterable[str]) -> None:
    """Import each plug-in once per process: ``path/to/file.py`` (a file) or ``package.module``
    (importable here). Its ``register_*`` calls run on import."""
    for spec in specs:
        if spec in _loaded_plugins:
            continue
        _loaded_plugins[spec] = _load_file(spec) if spec.endswith(".py") else _load_module(spec)


def _load_file(spec: str) -> str:
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"run.plugins: {spec!r} does not exist (give a .py file or a module name)")
    name = plugin_module_name(path)
    import_user_file(path, name, what=f"run.plugins: {spec}")
    return name


def _load_module(spec: str) -> str:
    import_user_module(spec, what=f"run.plugins: module {spec!r}",
                       missing=f"run.plugins: cannot import module {spec!r}",
                       fix="give an importable module or a path/to/file.py")
    return spec


def import_user_file(path: Path, name: str, *, what: str, error: type[ConfigError] = PluginError) -> Any:
    """The user's file ``path`` imported as module ``name``, once per process: the running script
    itself when it is that file (it is not run twice), else executed with ``importing_user_code``
    (a ``tether.train`` call in it ends the import, keeping what it defined above the call). What it
    raises, ``sys.exit()`` included, becomes ``error`` naming ``what`` (``import_failure``)."""
    if name in sys.modules:
        return sys.modules[name]
    main = running_script(path)
    if main is not None:  # the script that is running names itself: it has registered already
        sys.modules[name] = main
        return main
    loader_spec = importlib.util.spec_from_file_location(name, path.resolve())
    assert loader_spec is not None and loader_spec.loader is not None
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # before running it: its classes pickle (and dataclasses resolve) by it
    try:
        with importing_user_code():
            loader_spec.loader.exec_module(module)
    except ScriptReentered:
        pass  # a script that calls tether.train: what it defined above the call is there
    except (KeyboardInterrupt, ConfigError):  # a stop; the file's own clear refusal
        del sys.modules[name]
        raise
    except BaseException as exc:
        del sys.modules[name]
        raise import_failure(what, exc, error) from exc
    return module


def import_user_module(module_name: str, *, what: str, missing: str, fix: str,
                       error: type[ConfigError] = PluginError) -> Any:
    """The user's module ``module_name``, imported as ``import_user_file`` imports a file; None when
    it called ``tether.train`` before it was whole. A module that is not there is ``missing`` (a
    ``ConfigError`` saying ``fix``); one that fails importing something else is ``error``."""
    try:
        with importing_user_code():
            return importlib.import_module(module_name)
    except ScriptReentered:
        return sys.modules.get(module_name)  # a script that calls tether.train: its registrations are made
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name == exc.name or module_name.startswith(f"{exc.name}.")):
            raise import_failure(what, exc, error) from exc  # it imports what is missing
        raise ConfigError(f"{missing} ({exc}); {fix}") from exc
    except (KeyboardInterrupt, ConfigError):
        raise
    except BaseException as exc:
        raise import_failure(what, exc, error) from exc


def import_failure(what: str, exc: BaseException, error: type[ConfigError] = PluginError) -> ConfigError:
    """The error for user code (``what``: a plug-in, a reward, dataset or environment file) that
    raised ``exc`` while it was imported — ``sys.exit()`` included, which would otherwise end the
    run with that status and no word: what it raised, and the line it came from."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename
              and not f.filename.startswith("<frozen")]
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    hint = ""
    if isinstance(exc, SystemExit):
        hint = (f" (it calls sys.exit({exc.code!r}) when imported: a script's entry point? put that under "
                "`if __name__ == \"__main__\":`)")
    return error(f"{what} failed to import: {type(exc).__name__}: {exc}{where}{hint}")
