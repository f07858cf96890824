"""The environment protocol of the agent family, and what turns a user's environment into it.

One environment instance plays one episode::

    reset(task, seed) -> observation                        the opening text (or messages) the model sees
    step(action_text) -> Step(observation, reward, done, truncated, info)
    close()                                                 optional

Either method may be ``async``. ``step`` may also return a gymnasium-style 5-tuple
``(observation, reward, terminated, truncated, info)``. A step that rewrites the history rather
than adding to it returns the whole new context with ``new_context=True``: the episode goes on as
a new sample (docs/agents.md). An action the environment cannot parse is
answered by raising ``ActionError(message)``: the message becomes the observation the model sees
and the episode goes on (counted as an action error). Any other exception (``SystemExit`` and
``KeyboardInterrupt`` included) ends the episode, as does a step whose fields are of the wrong
kind (``as_step``: a reward that is not a number within ±``REWARD_LIMIT``, a ``done`` that is not a
bool, ...). The constructor is called with ``env.kwargs`` as keyword arguments (none by default;
skyrl-gym's with ``env_config, extras``); ``factory`` refuses a class that needs more when the recipe
is loaded, and ``env.kwargs`` a class's own static ``check_kwargs(kwargs)`` refuses (raising
``ValueError`` or ``TypeError``: ``remote.RemoteEnv``'s url). All of one episode's calls run on one
thread, and an async environment's on one event loop (``envthreads.Lane``), so what ``reset`` opens
(a client, a lock, a connection) serves ``step``.

Adapters (duck-typed, so neither package is needed):

- ``skyrl-gym``'s ``BaseTextEnv`` (``init(prompt) -> (messages, metadata)``, ``step(action) ->
  {"observations": [...], "reward", "done", "metadata"}``): built as ``Class(env_config, extras)``
  with ``env.env_config`` as ``env_config`` (an OmegaConf ``DictConfig`` as SkyRL passes, or, without
  omegaconf, a dict whose keys read as attributes too) and the task row as ``extras`` (plus SkyRL's
  ``reward_spec.ground_truth`` from the row's answer and an empty ``extra_info`` when the row has
  none, and ``max_turns``: ``env.max_turns``); observation messages' contents are joined;
- a gymnasium text environment (``reset(seed=..., options=...) -> (observation, info)``): built with
  ``env.kwargs``, the task row given as ``options``.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tether.families.agent.envthreads import awaited as _run


class ActionError(Exception):
    """Raised by ``step`` for an action it cannot parse; ``str(error)`` is shown to the model."""


class EnvContractError(Exception):
    """The environment broke its contract (wrong types); ends the episode like any exception."""


@dataclass(frozen=True)
class Step:
    """What one environment step returns."""

    observation: str | list[dict[str, str]]
    """Text, or role-tagged chat messages (``observation_of``): with ``data.chat_template`` each
    message becomes a turn of its role (a ``tool`` message a tool result), without it the contents
    are appended as text."""
    reward: float = 0.0
    done: bool = False
    truncated: bool = False
    """The environment cut the episode short (its own step limit): no further turn, not a failure."""
    info: Mapping[str, Any] = field(default_factory=dict)
    new_context: bool = False
    """``observation`` is the whole context the model sees next, not text added to it: the
    environment rewrote the history (summarised it, dropped old turns). The episode's sample so far
    is closed and a new sample of the same episode starts from this text, encoded once. A
    gymnasium tuple or a skyrl-gym output says so with ``info["new_context"]`` /
    ``metadata["new_context"]``."""


@runtime_checkable
class Environment(Protocol):
    def reset(self, task: Mapping[str, Any], seed: int) -> str: ...

    def step(self, action: str) -> Step: ...


REWARD_LIMIT = 1e6
"""The most a step reward or an episode return may be in size, as for a text reward function's
(advantages are computed in float32)."""


def as_step(value: Any) -> Step:
    """A ``Step`` from what ``step`` returned, its fields checked and made plain Python (a NumPy
    scalar reward or flag is taken as the number or bool it holds), or ``EnvContractError`` saying
    what was wrong."""
    if isinstance(value, Step):
        obs, reward, done, truncated, info, new_context = (
            value.observation, value.reward, value.done, value.truncated, value.info, value.new_context)
    elif isinstance(value, tuple) and len(value) == 5:
        obs, reward, done, truncated, info = value
        info = info if isinstance(info, Mapping) else {}
        new_context = info.get("new_context", False)
    elif isinstance(value, Mapping) and "observations" in value:  # skyrl-gym's step output
        obs = _messages_text(value["observations"])
        reward = value.get("reward", 0.0)
        reward = 0.0 if reward is None else reward
        done, truncated = value.get("done", False), False
        info = value.get("metadata") or {}
        new_context = info.get("new_context", False) if isinstance(info, Mapping) else False
    else:
        raise EnvContractError(
            f"step returned {type(value).__name__} {_shown(value)}; expected a Step, "
            "a 5-tuple (observation, reward, terminated, truncated, info) or a "
            "skyrl-gym step output"
        )
    obs = observation_of(obs, "step")
    if not isinstance(info, Mapping):
        raise EnvContractError(f"step returned info of type {type(info).__name__}; "
                               "expected a mapping (a dict)")
    return Step(obs, reward_of(reward), flag("done", done), flag("truncated", truncated), info,
                flag("new_context", new_context))


ROLES = ("user", "tool", "system")
"""The roles an observation's messages may have (the model's own turns are ``assistant``)."""

Observation = str | list[dict[str, str]]
"""What the model is shown next: text, or role-tagged chat messages."""


def observation_of(value: Any, call: str) -> Observation:
    """An observation as text (``str``) or a list of messages (``{"role", "content"}`` with role
    ``user``, ``tool`` or ``system``, other string fields such as ``name`` kept; one message may be
    given alone), or ``EnvContractError`` naming the ``call`` that returned it."""
    if isinstance(value, str):
        return value
    many = [value] if isinstance(value, Mapping) else value
    if not isinstance(many, list | tuple):
        raise EnvContractError(f"{call} returned an observation of type {type(value).__name__}; expected "
                               "text (str) or chat messages ({'role', 'content'} dicts, or a list of them)")
    messages = []
    for m in many:
        if not isinstance(m, Mapping) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise EnvContractError(f"{call} returned the message {_shown(m)}; a message is a dict with "
                                   f"'role' ({', '.join(ROLES)}) and 'content' (str)")
        bad = [k for k, v in m.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise EnvContractError(f"{call} returned the message {_shown(m)}; its fields must be strings "
                                   f"({', '.join(map(repr, bad))} is not)")
        messages.append(dict(m))
    return messages


def plain_text(obs: Observation) -> str:
    """What a model without a chat template reads of an observation: the text, or the messages'
    contents concatenated (no roles, no template)."""
    return obs if isinstance(obs, str) else "".join(m["content"] for m in obs)


def transcript_text(obs: Observation) -> str:
    """An observation as ``episodes.jsonl`` shows it: the text, or one ``[role] content`` line per
    message (``[tool name]`` for a named tool's)."""
    if isinstance(obs, str):
        return obs
    return "\n".join(f"[{m['role']}{' ' + m['name'] if m.get('name') else ''}] {m['content']}" for m in obs)


def reward_of(value: Any) -> float:
    """A step reward as a finite float within ±``REWARD_LIMIT`` (a NumPy scalar or a one-number
    array taken as the number it holds), or ``EnvContractError``."""
    if not isinstance(value, numbers.Real) and getattr(value, "shape", None) == () and hasattr(value, "item"):
        value = value.item()
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise EnvContractError(f"step returned a reward of type {type(value).__name__}; expected a number")
    try:
        reward = float(value)
    except OverflowError:  # an int past float's range
        reward = None
    if reward is not None and not math.isfinite(reward):
        raise EnvContractError(f"step returned a non-finite reward {reward}; rewards must be finite numbers")
    if reward is None or abs(reward) > REWARD_LIMIT:
        raise EnvContractError(f"step returned a reward of {_shown(value)}; rewards must lie within "
                               f"±{REWARD_LIMIT:g} (scale them: advantages are computed in float32)")
    return reward


def flag(name: str, value: Any) -> bool:
    """``done``, ``truncated`` or ``new_context`` as a bool: True or False (NumPy's included), never
    a value read for its truth (``"false"`` is true)."""
    if not _is_bool(value):
        raise EnvContractError(f"step returned {name}={_shown(value)}; expected True or False")
    return bool(value)


def _is_bool(value: Any) -> bool:
    """A Python or NumPy bool."""
    kind = type(value)
    return isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool"))


def _shown(value: Any) -> str:
    """``value``'s repr, cut to 80 characters (an int of 400 digits, a whole observation)."""
    try:
        text = repr(value)
    except Exception:
        return f"<{type(value).__name__}>"
    return text if len(text) <= 80 else f"{text[:77]}..."


def _messages_text(messages: Any) -> str:
    """The text of chat messages (``[{"role", "content"}]``) or of plain text, concatenated."""
    if isinstance(messages, str):
        return messages
    if not isinstance(messages, list):
        raise EnvContractError(
            f"observations of type {type(messages).__name__}; expected text or a list of chat messages"
        )
    return "".join(m["content"] if isinstance(m, Mapping) else str(m) for m in messages)


class Attributes(dict):
    """A mapping whose keys also read as attributes (``env_config.search_url``), with nested
    mappings alike: skyrl-gym's ``env_config`` where omegaconf is not installed."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        super().__init__({k: Attributes(v) if isinstance(v, Mapping) else v for k, v in values.items()})

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"env.env_config has no key {name!r}") from None


def env_config_of(values: Mapping[str, Any]) -> Any:
    """skyrl-gym's ``env_config`` from ``env.env_config``: an OmegaConf ``DictConfig``, as SkyRL
    passes it, or ``Attributes`` without omegaconf (a fresh one each episode: an environment may
    change its own)."""
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return Attributes(values)
    return OmegaConf.create(dict(values))


class _SkyRL:
    """``skyrl-gym``'s ``BaseTextEnv`` as an ``Environment`` (the task row is its ``extras``)."""

    def __init__(self, made: EnvFactory) -> None:
        self.made, self.env = made, None

    def reset(self, task: Mapping[str, Any], seed: int) -> str:
        # SkyRL's rows carry the answer as reward_spec.ground_truth, and extra_info; SkyRL's
        # generator adds max_turns to every row's extras
        extras = {"reward_spec": {"method": "rule", "ground_truth": task.get("answer", "")}, "extra_info": {},
                  **task, **self.made.extras}
        self.env = self.made.env_class(env_config_of(self.made.env_config), extras)
        prompt = task.get("prompt", "")
        messages, _ = _run(
            self.env.init([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt)
        )
        return _messages_text(messages)

    def step(self, action: str) -> Any:
        return _run(self.env.step(action))

    def close(self) -> None:
        if self.env is not None and hasattr(self.env, "close"):
            _run(self.env.close())


class _Gymnasium:
    """A gymnasium text environment as an ``Environment`` (the task row is ``reset``'s options)."""

    def __init__(self, made: EnvFactory) -> None:
        self.env = made.env_class(**made.options)

    def reset(self, task: Mapping[str, Any], seed: int) -> str:
        out = _run(self.env.reset(seed=seed, options=dict(task)))
        return out[0] if isinstance(out, tuple) else out

    def step(self, action: str) -> Any:
        return _run(self.env.step(action))

    def close(self) -> None:
        if hasattr(self.env, "close"):
            _run(self.env.close())


class _Native:
    """An ``Environment`` as is (sync or async methods)."""

    def __init__(self, made: EnvFactory) -> None:
        self.env = made.env_class(**made.options)

    def reset(self, task: Mapping[str, Any], seed: int) -> str:
        return _run(self.env.reset(task, seed))

    def step(self, action: str) -> Any:
        return _run(self.env.step(action))

    def close(self) -> None:
        if hasattr(self.env, "close"):
            _run(self.env.close())


def kind_of(env_class: type) -> str:
    """``skyrl`` (has ``init``, no ``reset``), ``gymnasium`` (``reset`` takes ``seed``/``options`` by
    keyword, no ``task``) or ``native``."""
    if hasattr(env_class, "init") and hasattr(env_class, "step") and not hasattr(env_class, "reset"):
        return "skyrl"
    reset = getattr(env_class, "reset", None)
    if reset is None or not hasattr(env_class, "step"):
        return "invalid"
    try:
        params = inspect.signature(reset).parameters
    except (TypeError, ValueError):
        return "native"
    if "options" in params and "task" not in params:
        return "gymnasium"
    return "native"


@dataclass(frozen=True)
class EnvFactory:
    """Makes one fresh adapted environment a call (on an environment thread, so a slow constructor
    counts against the episode's time); ``name`` is the class's, for messages."""

    adapter: Callable[[EnvFactory], Any]
    env_class: type
    options: Mapping[str, Any]
    """The constructor's keyword arguments (``env.kwargs``; not for skyrl-gym's)."""
    env_config: Mapping[str, Any] = field(default_factory=dict)
    """skyrl-gym's ``env_config`` (``env.env_config``)."""
    extras: Mapping[str, Any] = field(default_factory=dict)
    """What skyrl-gym's ``extras`` hold besides the task row (``max_turns``)."""

    @property
    def name(self) -> str:
        return getattr(self.env_class, "__qualname__", repr(self.env_class))

    def __call__(self) -> Any:
        return self.adapter(self)


def factory(env_class: type, options: Mapping[str, Any], *, env_config: Mapping[str, Any] | None = None,
            extras: Mapping[str, Any] | None = None) -> EnvFactory:
    """What makes environments of ``env_class``: built with ``options`` as keyword arguments, or,
    for a skyrl-gym environment, with ``env_config`` and the task row plus ``extras``. Refuses
    (``ConfigError``) a class that is not an environment, keys meant for the other kind of
    environment, or a constructor that cannot be called the way its adapter calls it, so a recipe
    fails when it is loaded rather than at its first episode."""
    from tether.errors import ConfigError

    kind = kind_of(env_class)
    name = getattr(env_class, "__qualname__", repr(env_class))
    if kind == "skyrl" and options:
        raise ConfigError(f"env.kwargs={dict(options)} is for environments built with keyword arguments; "
                          f"{name} is a skyrl-gym environment, built as {name}(env_config, extras): put its "
                          "settings in env.env_config")
    if kind in ("native", "gymnasium") and env_config:
        raise ConfigError(f"env.env_config is skyrl-gym's env_config; {name} is not a skyrl-gym environment "
                          "(it has reset, not init): pass its constructor's arguments as env.kwargs")
    adapter = {"skyrl": _SkyRL, "gymnasium": _Gymnasium, "native": _Native}.get(kind)
    if adapter is None:
        raise ConfigError(
            f"{env_class!r} is not an environment: it needs reset(task, seed) and step(action) "
            "(or skyrl-gym's init(prompt) and step(action)); see docs/agents.md"
        )
    check = getattr(env_class, "check_kwargs", None)
    if kind != "skyrl" and callable(check):  # the class's own look at its arguments (RemoteEnv's url)
        try:
            check(dict(options))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"env.kwargs for {name}: {exc}") from None
    made = EnvFactory(adapter, env_class, dict(options), dict(env_config or {}), dict(extras or {}))
    try:
        signature = inspect.signature(env_class)
    except (TypeError, ValueError):  # a class without a readable signature: its first episode will say
        return made
    args = ({}, {}) if kind == "skyrl" else ()
    try:
        signature.bind(*args, **({} if kind == "skyrl" else options))
    except TypeError as exc:
        call = f"{made.name}(env_config, extras)" if kind == "skyrl" else f"{made.name}()"
        params = list(signature.parameters.values())
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        filled = positional[:len(args)]
        needs = [p.name for p in params if p.default is p.empty and p.name not in filled
                 and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        what, fix = (
            (f"needs {', '.join(map(repr, needs))}", "give those arguments defaults, or take what varies "
             "from the task row that reset receives") if needs
            else (f"cannot be called so ({exc})", f"make it callable as {call}"))
        raise ConfigError(f"environment {made.name} cannot be built: the agent family makes one per "
                          f"episode as {call}, and its constructor {what}; {fix} (docs/agents.md)") from None
    return made
