"""The agent family's built-in tasks: an environment per episode, and scripted transcripts for the
warm start. Text is short and plain so a character-level tiny model can play.

``kv_lookup``: a hidden table of ``difficulty + 2`` keys (letters) to digits. The first
observation names a key (``key b``); the tool call ``get b`` answers ``b=7``; ``ans 7`` ends the
episode with reward 1 when right. Answering without the tool is right 1 time in 10.

``guess_number``: a hidden number below 10**difficulty. ``g 42`` is answered ``higher``, ``lower``
or, when right, ends the episode with reward 1.

Both answer an action they cannot parse with ``?`` (an ``ActionError``: the model sees it and may
try again, and it is counted).

``tool_calc``: a chat task with Python functions as tools (``tools.ToolEnv``, Hermes-format calls,
``data.chat_template: true``). The user asks ``7*12+3=?`` (the ``calculator`` tool evaluates it) or
``c=?`` (a key of a hidden table of digits, which the ``lookup`` tool reads), half each; at
difficulty 2, ``c*12+3=?`` needs both, the key looked up first. A turn without a call is the answer,
right when it is the number. Answering without the tools is right about 1 time in 20 (a digit's
chance on the lookups, next to none on the products).
"""

from __future__ import annotations

import ast
import json
import random
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tether.data.tasks.base import Task
from tether.families.agent.env import ActionError, Step
from tether.families.agent.tools import ToolEnv
from tether.vocabulary import Example

Segment = tuple[str, bool]
"""A piece of a transcript and whether the model wrote it."""


@dataclass(frozen=True)
class AgentTask(Task):
    """A task whose samples are episodes: ``environment`` plays one (``Environment``), ``script``
    writes a demonstration transcript of an example for the warm start (``rng`` decides its
    choices, ``quality`` in [0, 1] how good a player it shows)."""

    environment: type | None = None
    script: Callable[[Example, random.Random, float], list[Segment]] | None = None
    family: str = "agent"


def _no_verifier(completion: str, ex: Example) -> float:
    raise NotImplementedError("an agent task's reward comes from its environment")


# -- key-value lookup ----------------------------------------------------------------------------


class KeyValueLookup:
    """One episode of ``kv_lookup``."""

    def reset(self, task: Mapping[str, Any], seed: int) -> str:
        self.table = dict(pair.split("=") for pair in task["table"].split())
        self.key = task["key"]
        return f"key {self.key}\n"

    def step(self, action: str) -> Step:
        verb, _, arg = action.strip().partition(" ")
        if verb == "get" and len(arg) == 1:
            return Step(f"{arg}={self.table.get(arg, 'none')}\n", info={"tool_call": True})
        if verb == "ans" and arg.isdigit():
            return Step("", reward=float(arg == self.table[self.key]), done=True)
        raise ActionError("?\n")


def _draw_kv(rng: random.Random, d: int) -> Example:
    keys = rng.sample(string.ascii_lowercase[:12], d + 2)
    table = " ".join(f"{k}={rng.randrange(10)}" for k in keys)
    key = rng.choice(keys)
    return Example(
        prompt=f"kv {table} ?{key}",
        answer=dict(p.split("=") for p in table.split())[key],
        fields={"table": table, "key": key},
    )


def _script_kv(ex: Example, rng: random.Random, quality: float) -> list[Segment]:
    """With probability ``quality`` the tool is called first; otherwise a guess."""
    key = ex.fields["key"]
    opening = (f"key {key}\n", False)
    if rng.random() < quality:
        return [
            opening,
            (f"get {key}\n", True),
            (f"{key}={ex.answer}\n", False),
            (f"ans {ex.answer}\n", True),
        ]
    return [opening, (f"ans {rng.randrange(10)}\n", True)]


KV_LOOKUP = AgentTask(
    name="kv_lookup",
    description="call a lookup tool, then answer (chance without it: 1 in 10)",
    difficulties=(1, 2, 3, 4),
    default_difficulty=2,
    draw=_draw_kv,
    verify=_no_verifier,
    environment=KeyValueLookup,
    script=_script_kv,
)


# -- guess the number ----------------------------------------------------------------------------


class GuessNumber:
    """One episode of ``guess_number``."""

    def reset(self, task: Mapping[str, Any], seed: int) -> str:
        self.secret = int(task["answer"])
        self.top = int(task["top"])
        return f"guess 0-{self.top - 1}\n"

    def step(self, action: str) -> Step:
        verb, _, arg = action.strip().partition(" ")
        if verb != "g" or not arg.isdigit():
            raise ActionError("?\n")
        guess = int(arg)
        if guess == self.secret:
            return Step("", reward=1.0, done=True)
        return Step("higher\n" if guess < self.secret else "lower\n")


def _draw_guess(rng: random.Random, d: int) -> Example:
    top = 10**d
    secret = rng.randrange(top)
    return Example(prompt=f"guess {secret} #{rng.randrange(10**9)}", answer=str(secret), fields={"top": top})


def _script_guess(ex: Example, rng: random.Random, quality: float) -> list[Segment]:
    """Bisection with probability ``quality`` at each guess, else a random guess in range."""
    lo, hi, secret = 0, int(ex.fields["top"]) - 1, int(ex.answer)
    out: list[Segment] = [(f"guess 0-{hi}\n", False)]
    for _ in range(12):
        guess = (lo + hi) // 2 if rng.random() < quality else rng.randint(lo, hi)
        out.append((f"g {guess}\n", True))
        if guess == secret:
            return out
        if guess < secret:
            lo = guess + 1
            out.append(("higher\n", False))
        else:
            hi = guess - 1
            out.append(("lower\n", False))
    return out


GUESS_NUMBER = AgentTask(
    name="guess_number",
    description="find a hidden number from higher/lower replies",
    difficulties=(1, 2),
    default_difficulty=1,
    draw=_draw_guess,
    verify=_no_verifier,
    environment=GuessNumber,
    script=_script_guess,
)


# -- tools: a calculator and a lookup ------------------------------------------------------------

_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}
CALC_LIMIT = 10**6
"""The largest number in size the calculator takes or returns."""


def _calc(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) <= CALC_LIMIT:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_calc(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        value = _OPS[type(node.op)](_calc(node.left), _calc(node.right))
        if abs(value) > CALC_LIMIT:
            raise ValueError(f"a result past {CALC_LIMIT}")
        return value
    raise ValueError("only whole numbers with + - * and parentheses")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: whole numbers with + - * and parentheses, e.g. 7*12+3
    """
    if len(expression) > 64:
        raise ValueError("an expression of at most 64 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")  # parsed only: the tree is walked, never run
    except SyntaxError:
        raise ValueError(f"cannot read {expression!r}") from None
    return str(_calc(tree.body))


def lookup(key: str) -> str:
    """Read a key's value from the task's hidden table.

    Args:
        key: a letter, e.g. c
    """
    raise RuntimeError("lookup reads a tool_calc episode's table; ToolCalc.reset binds it")


def _lookup_in(table: Mapping[str, str], key: str) -> str:
    return table.get(key.strip(), "none")


class ToolCalc(ToolEnv):
    """One episode of ``tool_calc``: ``ToolEnv`` with ``calculator`` and ``lookup``; the user sees the
    row's question, and ``lookup`` reads the row's table."""

    default_tools = (calculator, lookup)

    def reset(self, task: Mapping[str, Any], seed: int) -> list[dict[str, str]]:
        super().reset(task, seed)
        if self.tools.get("lookup") is lookup:  # not a function of env.tools that has the same name
            table = dict(pair.split("=") for pair in task["table"].split())
            self.tools = {**self.tools, "lookup": lambda key: _lookup_in(table, key)}
        return [{"role": "user", "content": task["question"]}]


def _expression(rng: random.Random, first: str) -> str:
    """``first`` times a number in 2..19, plus or minus a digit: 7*12+3."""
    return f"{first}*{rng.randint(2, 19)}{rng.choice('+-')}{rng.randint(1, 9)}"


def _draw_tool_calc(rng: random.Random, d: int) -> Example:
    keys = rng.sample(string.ascii_lowercase[:12], 4)
    table = {k: str(rng.randrange(10)) for k in keys}
    row = " ".join(f"{k}={v}" for k, v in table.items())
    key = rng.choice(keys)
    if d == 2:
        expression = _expression(rng, key)
        answer = calculator(expression.replace(key, table[key], 1))
    elif rng.random() < 0.5:
        expression = _expression(rng, str(rng.randint(2, 19)))
        answer = calculator(expression)
    else:
        expression, answer = key, table[key]
    question = f"{expression}=?"
    return Example(prompt=f"{question} [{row}]", answer=answer, fields={"question": question, "table": row})


END = "<|im_end|>"
"""The end of a model turn under the built-in chat template (``tiny_model.CHATML_TEMPLATE``)."""


def _call(name: str, **arguments: str) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>{END}"


def _script_tool_calc(ex: Example, rng: random.Random, quality: float) -> list[Segment]:
    """Chat segments: the user's question; with probability ``quality`` the calls (lookup, then the
    calculator on the value; or the one the question needs) each answered by its ``tool`` message,
    then the answer; otherwise an answer without the tools, always ``0`` (right for a key whose
    value is 0). A fixed answer, not a random one: a tiny model warm-started on random guesses
    learns that a final answer is noise and then copies the tool's answer badly too (800 steps at
    quality 0.35 left it right 1 time in 50 when it called a tool, docs/benchmarks.md)."""
    question = ex.fields["question"]
    expression = question.removesuffix("=?")
    opening: Segment = ([{"role": "user", "content": question}], False)
    if rng.random() >= quality:
        return [opening, ("0" + END, True)]
    table = dict(pair.split("=") for pair in ex.fields["table"].split())
    out = [opening]
    key = expression[0] if expression[0].isalpha() else ""
    if key:
        out += [(_call("lookup", key=key), True),
                ([{"role": "tool", "name": "lookup", "content": table[key]}], False)]
        expression = expression.replace(key, table[key], 1)
    if not expression.isdigit():
        out += [(_call("calculator", expression=expression), True),
                ([{"role": "tool", "name": "calculator", "content": calculator(expression)}], False)]
    return [*out, (ex.answer + END, True)]


def _verify_tool_calc(completion: str, ex: Example) -> float:
    """1 when the final answer is the number asked for, else 0."""
    return float(completion.strip() == ex.answer)


TOOL_CALC = AgentTask(
    name="tool_calc",
    description="call a calculator or a lookup tool (Hermes format, chat template), then answer",
    difficulties=(1, 2),
    default_difficulty=1,
    draw=_draw_tool_calc,
    verify=_verify_tool_calc,
    environment=ToolCalc,
    script=_script_tool_calc,
)
