"""Tool calls: what chat models emit when they call a tool, the JSON schemas that tell them which
tools there are, and an environment whose tools are plain Python functions.

Parsers read a model turn as text (special tokens kept, ``episodes.Player.action``) and return a
``ParsedTurn``: the calls it made, in order, the malformed ones as messages for the model, and the
text outside the calls. Two formats are built in:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn (the
  format of Hermes 2 Pro and of Qwen2.5/Qwen3's chat templates, which vLLM's ``hermes`` parser
  reads);
- ``json``: a turn that is a JSON object ``{"name": ..., "arguments": ...}`` (Llama 3.1's
  ``parameters`` accepted too), a list of them, or either in a ```json fence.

A recipe may name its own: ``path/to/file.py:function`` taking the turn's text and returning a
``ParsedTurn``.

``tool_schema`` builds a function's schema (OpenAI's ``{"type": "function", "function": {...}}``,
what Hugging Face chat templates take as ``tools=``) from its signature, type hints and docstring
(its first paragraph, and a Google-style ``Args:`` section for each argument), and
``check_arguments`` checks a call against it. ``ToolEnv`` plays a task with such functions: a turn
with calls gets one ``tool`` message per call; a turn without any is the final answer, scored by the
recipe's answer reward.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tether.errors import ConfigError
from tether.families.agent.env import Step


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    """A model turn read for tool calls."""

    content: str
    """The turn's text outside its calls (the answer, when there are no calls), stripped."""
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """One message per malformed call: what was wrong with it, as the model is told."""


def _call_of(value: Any) -> ToolCall | str:
    """A ``ToolCall`` from one decoded call object, or what is wrong with it."""
    if not isinstance(value, Mapping):
        return f'a tool call must be a JSON object with "name" and "arguments", not {type(value).__name__}'
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return "a tool call needs \"name\": the tool's name as a string"
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments as a JSON string, as OpenAI's API does
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return f"the arguments of {name} are a string that is not JSON ({exc.msg} at character {exc.pos})"
    if not isinstance(args, Mapping):
        return f"the arguments of {name} must be a JSON object, not {type(args).__name__}"
    return ToolCall(name, dict(args))


def _shown(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "…")


HERMES_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|(?=<tool_call>)|\Z)", re.DOTALL)
"""A block, closed, or left open before the next block or the turn's end."""


def parse_hermes(text: str) -> ParsedTurn:
    """``<tool_call>{json}</tool_call>`` blocks, any number; an unclosed block (a turn cut off by
    its token budget, or one that opens the next call without closing its own) is a malformed call."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for match in HERMES_CALL.finditer(text):
        body, closing = match.group(1).strip(), match.group(2)
        if not closing:
            errors.append(f"the tool call {_shown(body)} has no closing </tool_call>")
            continue
        try:
            call = _call_of(json.loads(body))
        except json.JSONDecodeError as exc:
            call = f"the tool call {_shown(body)} is not valid JSON ({exc.msg} at character {exc.pos})"
        (calls if isinstance(call, ToolCall) else errors).append(call)
    return ParsedTurn(HERMES_CALL.sub("", text).strip(), calls, errors)


FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def parse_json(text: str) -> ParsedTurn:
    """A turn that is one JSON call object or a list of them (in a ```json fence or not); any
    other turn is an answer. A turn that opens as JSON (``{`` or ``[``) but does not parse is a
    malformed call."""
    body = text.strip()
    fenced = FENCE.match(body)
    if fenced:
        body = fenced.group(1)
    if not body.startswith(("{", "[")):
        return ParsedTurn(text.strip())
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        return ParsedTurn("", [], [f"the tool call {_shown(body)} is not valid JSON ({exc.msg} at character "
                                   f"{exc.pos})"])
    calls: list[ToolCall] = []
    errors: list[str] = []
    for item in value if isinstance(value, list) else [value]:
        call = _call_of(item)
        (calls if isinstance(call, ToolCall) else errors).append(call)
    return ParsedTurn("", calls, errors)


PARSERS: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes, "json": parse_json}


def load_parser(spec: str) -> Callable[[str], ParsedTurn]:
    """``hermes``, ``json`` or ``path/to/file.py:function`` (``env.tool_parser``)."""
    if spec in PARSERS:
        return PARSERS[spec]
    if ":" not in spec:
        raise ConfigError(f"env.tool_parser={spec!r} is not a parser; use {' or '.join(PARSERS)}, or "
                          "path/to/file.py:function returning a tether.families.agent.tools.ParsedTurn")
    from tether.pyload import load_python_object

    fn = load_python_object(spec, what="env.tool_parser")
    if not callable(fn):
        raise ConfigError(f"env.tool_parser {spec!r} is not a function")
    return fn


# -- schemas from Python functions ---------------------------------------------------------------

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


def _type_schema(hint: Any, where: str) -> dict[str, Any]:
    """The JSON schema of one type hint (str, int, float, bool, None, list[...], dict[str, ...],
    tuple, Literal, Optional / unions, Any)."""
    if hint is Any or hint is inspect.Parameter.empty:
        return {}
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        parts = [_type_schema(a, where) for a in args]
        kinds = [p.get("type") for p in parts]
        if all(isinstance(k, str) for k in kinds) and all(len(p) == 1 for p in parts):
            return {"type": kinds}
        return {"anyOf": parts}
    if hint is list or origin in (list, Sequence, tuple) or hint is tuple:
        items = [a for a in args if a is not Ellipsis]
        return {"type": "array", **({"items": _type_schema(items[0], where)} if len(items) == 1 else {})}
    if hint is dict or origin in (dict, Mapping):
        return {"type": "object", **({"additionalProperties": _type_schema(args[1], where)} if args else {})}
    raise ConfigError(f"{where} has type {hint!r}, which a JSON schema cannot state; use str, int, float, "
                      "bool, list, dict, Literal or an Optional of one")


_ARGS_HEADER = re.compile(r"^\s*(Args|Arguments|Parameters)\s*:\s*$")
_ARG_LINE = re.compile(r"^\s+(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_SECTION = re.compile(r"^\s*(Returns?|Raises|Yields|Examples?|Notes?)\s*:\s*$")


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """(the description: the first paragraph, one line; each argument's description from an
    ``Args:`` section)."""
    lines = inspect.cleandoc(doc).splitlines() if doc else []
    description: list[str] = []
    for line in lines:
        if not line.strip() or _ARGS_HEADER.match(line) or _SECTION.match(line):
            break
        description.append(line.strip())
    args: dict[str, str] = {}
    inside, current = False, None
    for line in lines:
        if _ARGS_HEADER.match(line):
            inside = True
            continue
        if inside and (_SECTION.match(line) or (line.strip() and not line.startswith((" ", "\t")))):
            break
        match = _ARG_LINE.match(line) if inside else None
        if match:
            current = match.group(1).lstrip("*")
            args[current] = match.group(2).strip()
        elif inside and current and line.strip():
            args[current] += " " + line.strip()
    return " ".join(description), args


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """``fn``'s schema as chat templates and OpenAI's API take it: its name, the first paragraph of
    its docstring, and a JSON schema of its parameters from their type hints (required: those
    without a default), each described by the docstring's ``Args:`` section."""
    name = getattr(fn, "__name__", None)
    if not callable(fn) or not name or not name.isidentifier():
        raise ConfigError(f"env.tools: {fn!r} is not a named function")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:
        raise ConfigError(f"env.tools: the type hints of {name} cannot be read ({exc})") from exc
    description, arg_docs = _docstring_parts(inspect.getdoc(fn) or "")
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ConfigError(f"env.tools: {name} takes *{param.name}; a tool's arguments must be named "
                              "parameters, so the model can be told them")
        schema = _type_schema(hints.get(param.name, param.annotation),
                              f"env.tools: argument {param.name!r} of {name}")
        if param.name in arg_docs:
            schema["description"] = arg_docs[param.name]
        properties[param.name] = schema
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    return {"type": "function",
            "function": {"name": name, "description": description,
                         "parameters": {"type": "object", "properties": properties, "required": required}}}


def _matches(value: Any, schema: Mapping[str, Any]) -> bool:
    if "enum" in schema:
        return value in schema["enum"]
    if "anyOf" in schema:
        return any(_matches(value, s) for s in schema["anyOf"])
    kinds = schema.get("type")
    if kinds is None:
        return True
    for kind in [kinds] if isinstance(kinds, str) else kinds:
        if kind == "integer" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if kind == "number" and isinstance(value, int | float) and not isinstance(value, bool):
            return True
        if kind == "string" and isinstance(value, str):
            return True
        if kind == "boolean" and isinstance(value, bool):
            return True
        if kind == "null" and value is None:
            return True
        if kind == "array" and isinstance(value, list):
            return all(_matches(v, schema.get("items", {})) for v in value)
        if kind == "object" and isinstance(value, dict):
            return all(_matches(v, schema.get("additionalProperties", {})) for v in value.values())
    return False


def _kind(schema: Mapping[str, Any]) -> str:
    if "enum" in schema:
        return "one of " + ", ".join(json.dumps(v) for v in schema["enum"])
    kinds = schema.get("type", "any")
    return kinds if isinstance(kinds, str) else " or ".join(kinds)


def check_arguments(schema: Mapping[str, Any], arguments: Mapping[str, Any]) -> str:
    """What is wrong with ``arguments`` for the tool ``schema`` describes ('' when nothing): an
    unknown argument, a missing required one, a value of the wrong JSON type."""
    fn = schema["function"]
    params = fn["parameters"]
    props, required = params["properties"], params["required"]
    takes = ", ".join(f"{k} ({_kind(v)})" for k, v in props.items()) or "no arguments"
    unknown = [k for k in arguments if k not in props]
    if unknown:
        return f"{fn['name']} has no argument {', '.join(map(repr, unknown))}; it takes {takes}"
    missing = [k for k in required if k not in arguments]
    if missing:
        return f"{fn['name']} needs {', '.join(map(repr, missing))}; it takes {takes}"
    for key, value in arguments.items():
        if not _matches(value, props[key]):
            return f"{fn['name']}: {key} must be {_kind(props[key])}, not {json.dumps(value)}"
    return ""


def load_tools(specs: Sequence[str]) -> list[Callable[..., Any]]:
    """The functions ``env.tools`` names: each ``path/to/file.py:name`` or ``module:name`` is a
    function, or a list, tuple or dict of functions. Names must be distinct."""
    from tether.pyload import load_python_object

    tools: list[Callable[..., Any]] = []
    for spec in specs:
        obj = load_python_object(spec, what="env.tools", callable_only=False)
        if isinstance(obj, Mapping):
            many = list(obj.values())
        else:
            many = list(obj) if isinstance(obj, list | tuple) else [obj]
        for fn in many:
            if not callable(fn) or isinstance(fn, type):
                raise ConfigError(f"env.tools {spec!r} holds {fn!r}, which is not a function")
            tools.append(fn)
    names = [fn.__name__ for fn in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"env.tools names {', '.join(twice)} more than once; each tool needs its own name")
    return tools


def result_text(value: Any) -> str:
    """A tool's return value as the model reads it: text as is, anything else as JSON (``str`` of
    what JSON cannot hold)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return str(value)


# -- the tool environment ------------------------------------------------------------------------


AnswerReward = Callable[[str, Mapping[str, Any]], float]
"""Scores a final answer against the task row (``prompt``, ``answer`` and the row's columns)."""


class ToolEnv:
    """An episode against Python functions as tools (``env.tools``).

    ``reset`` shows the task row's ``prompt`` as a user message. Each model turn is parsed for
    calls (``parser``): a turn with calls runs them in order, each answered by a ``tool`` message
    (its result, or the error: an unknown tool, arguments that do not fit its schema, an exception
    it raised, each counted); a turn without any call is the final answer and ends the episode with
    ``answer_reward(answer, task)``. A malformed call (not JSON, no name) is answered with what was
    wrong and adds ``malformed_reward`` to the step's reward. At most ``max_calls`` calls of a turn
    run; the rest are answered as errors. Tool functions may be ``async``; all run on the episode's
    thread (and event loop), one after another. Subclass it to score answers another way
    (``score``).

    Step info counts ``tool_calls``, ``tool_errors`` and ``malformed_calls`` (the sampler sums them
    into ``agent/*``). A subclass may name its tools in ``default_tools`` (used when ``env.tools``
    is empty), as a built-in tool task does."""

    default_tools: Sequence[Callable[..., Any]] = ()

    def __init__(self, tools: Sequence[Callable[..., Any]] = (),
                 parser: Callable[[str], ParsedTurn] = parse_hermes,
                 answer_reward: AnswerReward | None = None, malformed_reward: float = 0.0,
                 max_calls: int = 8) -> None:
        self.tools = {fn.__name__: fn for fn in (tools or self.default_tools)}
        self.schemas = {name: tool_schema(fn) for name, fn in self.tools.items()}
        self.parser, self.answer_reward = parser, answer_reward
        self.malformed_reward, self.max_calls = malformed_reward, max_calls
        self.task: Mapping[str, Any] = {}

    def reset(self, task: Mapping[str, Any], seed: int) -> list[dict[str, str]]:
        self.task = task
        return [{"role": "user", "content": str(task["prompt"])}]

    def score(self, answer: str, task: Mapping[str, Any]) -> float:
        if self.answer_reward is None:
            raise NotImplementedError("ToolEnv needs answer_reward, or a subclass's score")
        return float(self.answer_reward(answer, task))

    async def step(self, action: str) -> Step:
        turn = self.parser(action)
        if not turn.calls and not turn.errors:
            return Step([], reward=self.score(turn.content, self.task), done=True,
                        info={"tool_calls": 0, "tool_errors": 0, "malformed_calls": 0})
        messages: list[dict[str, str]] = []
        failed = 0
        for i, call in enumerate(turn.calls):
            if i >= self.max_calls:
                text, ok = f"error: not run; at most {self.max_calls} tool calls a turn", False
            else:
                text, ok = await self._run(call)
            failed += not ok
            messages.append({"role": "tool", "name": call.name, "content": text})
        messages += [{"role": "tool", "name": "", "content": f"error: {e}"} for e in turn.errors]
        return Step(messages, reward=self.malformed_reward * len(turn.errors),
                    info={"tool_calls": len(turn.calls), "tool_errors": failed,
                          "malformed_calls": len(turn.errors)})

    async def _run(self, call: ToolCall) -> tuple[str, bool]:
        """(the tool message's content, whether the call ran and returned)."""
        schema = self.schemas.get(call.name)
        if schema is None:
            known = ", ".join(self.tools) or "none"
            return f"error: there is no tool {call.name!r}; the tools are {known}", False
        wrong = check_arguments(schema, call.arguments)
        if wrong:
            return f"error: {wrong}", False
        try:
            value = self.tools[call.name](**call.arguments)
            if inspect.isawaitable(value):
                value = await value
        except (KeyboardInterrupt, asyncio.CancelledError):
            raise
        except SystemExit as exc:  # a tool that calls sys.exit ends its call, not the episode or the run
            return f"error: {call.name} called exit({exc.code!r})", False
        except Exception as exc:
            return f"error: {call.name} raised {type(exc).__name__}: {exc}", False
        return result_text(value), True
