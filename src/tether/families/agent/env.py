"""The environment protocol of the agent family, and what turns a user's environment into it.

One environment instance plays one episode::

    reset(task, seed) -> observation                        the opening text the model sees
    step(action_text) -> Step(observation, reward, done, truncated, info)
    close()                                                 optional

Either method may be ``async``. ``step`` may also return a gymnasium-style 5-tuple
``(observation, reward, terminated, truncated, info)``. A step that rewrites the history rather
than adding to it returns the whole new context with ``new_context=True``: the episode goes on as
a new sample (docs/agents.md). An action the environment cannot parse is
answered by raising ``ActionError(message)``: the message becomes the observation the model sees
and the episode goes on (counted as an action error). Any other exception ends the episode.

Adapters (duck-typed, so neither package is needed):

- ``skyrl-gym``'s ``BaseTextEnv`` (``init(prompt) -> (messages, metadata)``, ``step(action) ->
  {"observations": [...], "reward", "done", "metadata"}``): built as ``Class(env_config, extras)``
  with the task row as ``extras`` (plus SkyRL's ``reward_spec.ground_truth`` from the row's answer
  and an empty ``extra_info`` when the row has none); observation messages' contents are joined;
- a gymnasium text environment (``reset(seed=..., options=...) -> (observation, info)``): built with
  no arguments, the task row given as ``options``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


class ActionError(Exception):
    """Raised by ``step`` for an action it cannot parse; ``str(error)`` is shown to the model."""


class EnvContractError(Exception):
    """The environment broke its contract (wrong types); ends the episode like any exception."""


@dataclass(frozen=True)
class Step:
    """What one environment step returns."""

    observation: str
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


def _run(value: Any) -> Any:
    """``value``, awaited when it is awaitable (each environment thread runs its own event loop)."""
    if inspect.isawaitable(value):
        return asyncio.run(_awaited(value))
    return value


async def _awaited(value: Any) -> Any:
    return await value


def as_step(value: Any) -> Step:
    """A ``Step`` from what ``step`` returned, or ``EnvContractError`` saying what was wrong."""
    if isinstance(value, Step):
        step = value
    elif isinstance(value, tuple) and len(value) == 5:
        obs, reward, terminated, truncated, info = value
        info = info if isinstance(info, Mapping) else {}
        step = Step(obs, reward, bool(terminated), bool(truncated), info, info.get("new_context", False))
    elif isinstance(value, Mapping) and "observations" in value:  # skyrl-gym's step output
        step = Step(
            _messages_text(value["observations"]),
            value.get("reward", 0.0) or 0.0,
            bool(value.get("done", False)),
            False,
            value.get("metadata") or {},
            (value.get("metadata") or {}).get("new_context", False),
        )
    else:
        raise EnvContractError(
            f"step returned {type(value).__name__} {value!r:.80}; expected a Step, "
            "a 5-tuple (observation, reward, terminated, truncated, info) or a "
            "skyrl-gym step output"
        )
    if not isinstance(step.observation, str):
        raise EnvContractError(
            f"step returned an observation of type {type(step.observation).__name__}; expected text (str)"
        )
    if isinstance(step.reward, bool) or not isinstance(step.reward, int | float):
        raise EnvContractError(
            f"step returned a reward of type {type(step.reward).__name__}; expected a number"
        )
    if step.reward != step.reward or step.reward in (float("inf"), float("-inf")):
        raise EnvContractError(f"step returned a non-finite reward {step.reward}")
    if not isinstance(step.new_context, bool):
        raise EnvContractError(f"step returned new_context={step.new_context!r}; expected True or False")
    return step


def _messages_text(messages: Any) -> str:
    """The text of chat messages (``[{"role", "content"}]``) or of plain text, concatenated."""
    if isinstance(messages, str):
        return messages
    if not isinstance(messages, list):
        raise EnvContractError(
            f"observations of type {type(messages).__name__}; expected text or a list of chat messages"
        )
    return "".join(m["content"] if isinstance(m, Mapping) else str(m) for m in messages)


class _SkyRL:
    """``skyrl-gym``'s ``BaseTextEnv`` as an ``Environment`` (the task row is its ``extras``)."""

    def __init__(self, env_class: type, options: Mapping[str, Any]) -> None:
        self.env_class, self.options, self.env = env_class, options, None

    def reset(self, task: Mapping[str, Any], seed: int) -> str:
        # SkyRL's rows carry the answer as reward_spec.ground_truth, and extra_info
        extras = {"reward_spec": {"method": "rule", "ground_truth": task.get("answer", "")}, "extra_info": {},
                  **task}
        self.env = self.env_class(dict(self.options), extras)
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

    def __init__(self, env_class: type, options: Mapping[str, Any]) -> None:
        self.env = env_class(**options)

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

    def __init__(self, env_class: type, options: Mapping[str, Any]) -> None:
        self.env = env_class(**options)

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


def factory(env_class: type, options: Mapping[str, Any]) -> Callable[[], Any]:
    """A function that makes one fresh adapted environment (called on an environment thread, so
    a slow constructor counts against the episode's time)."""
    kind = kind_of(env_class)
    adapter = {"skyrl": _SkyRL, "gymnasium": _Gymnasium, "native": _Native}.get(kind)
    if adapter is None:
        from tether.errors import ConfigError

        raise ConfigError(
            f"{env_class!r} is not an environment: it needs reset(task, seed) and step(action) "
            "(or skyrl-gym's init(prompt) and step(action)); see docs/agents.md"
        )
    return lambda: adapter(env_class, options)
