"""The built-in tasks: arithmetic (also asked as a chat question), countdown, string
transformations, and a long-tailed repeat.

Prompts are short plain text so a character-level tiny model can learn them; each answer ends at
a newline or the end-of-sequence token. Rewards are in [0, 1]: 1 for a correct answer, a small
format credit (``FORMAT_CREDIT``) for a well-formed wrong one, 0 otherwise.
"""

from __future__ import annotations

import ast
import operator
import random
import re
import string
from collections.abc import Callable
from fractions import Fraction

from tether.data.tasks.base import Task, strip_answer
from tether.vocabulary import Example

FORMAT_CREDIT = 0.1
"""Reward for an answer in the right format that is wrong."""


# -- arithmetic --------------------------------------------------------------------------------

def _draw_arithmetic(rng: random.Random, d: int) -> Example:
    # difficulty 1..4: operands with d digits; d ≥ 3 mixes in subtraction
    lo, hi = 10 ** (d - 1) if d > 1 else 0, 10**d - 1
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    op = "+" if d < 3 or rng.random() < 0.5 else "-"
    value = a + b if op == "+" else a - b
    return Example(prompt=f"{a}{op}{b}=", answer=str(value), fields={"a": a, "b": b, "op": op})


def _verify_integer(completion: str, ex: Example) -> float:
    text = strip_answer(completion)
    if text == ex.answer:
        return 1.0
    body = text[1:] if text.startswith("-") else text
    return FORMAT_CREDIT if body.isdigit() else 0.0


ARITHMETIC = Task(
    name="arithmetic",
    description="Add (or, from difficulty 3, subtract) two integers of `difficulty` digits: '37+45=' → '82'.",
    difficulties=(1, 2, 3, 4),
    default_difficulty=2,
    draw=_draw_arithmetic,
    verify=_verify_integer,
)


# -- addition asked as a chat question --------------------------------------------------------

_QUESTIONS = ("What is {a} + {b}? Answer with the number only.",
              "What is the sum of {a} and {b}? Answer with the number only.")
WORDY_CREDIT = 0.5
"""Reward for the right sum said among other words ('7 + 5 = 12'), where a bare number was asked for."""


def _sum_asked(questions: tuple[str, ...]) -> Callable[[random.Random, int], Example]:
    """A draw of two operands (difficulty 1: single digits, 0-9; 2: two digits, 10-99) whose sum is
    asked in one of ``questions``."""

    def draw(rng: random.Random, d: int) -> Example:
        lo, hi = (0, 9) if d == 1 else (10, 99)
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        prompt = rng.choice(questions).format(a=a, b=b)
        return Example(prompt=prompt, answer=str(a + b), fields={"a": a, "b": b})

    return draw


def _verify_sum(completion: str, ex: Example) -> float:
    text = strip_answer(completion)
    if text == ex.answer:
        return 1.0
    numbers = re.findall(r"-?\d+", text)
    if numbers and numbers[-1] == ex.answer:
        return WORDY_CREDIT
    return FORMAT_CREDIT if text.isdigit() else 0.0


QUESTION = Task(
    name="question",
    description="Addition asked as a question, for chat models (data.chat_template: true): 'What is 4 + 7? "
    "Answer with the number only.' → '11'; the right sum among other words earns 0.5 ('4 + 7 = 11'). "
    "Difficulty 1: single digits; 2: two-digit operands.",
    difficulties=(1, 2),
    default_difficulty=2,
    draw=_sum_asked(_QUESTIONS),
    verify=_verify_sum,
)


# -- addition asked in a chat, scored by the reply's last number -----------------------------

_CHAT_QUESTIONS = ("What is {a} + {b}?", "What is the sum of {a} and {b}?")


def _verify_last_number(completion: str, ex: Example) -> float:
    # the reply's last number is its answer, as math verifiers read a final answer (GSM8K's
    # "####", a boxed value); a reply cut off before it states one earns nothing
    numbers = re.findall(r"-?\d+", strip_answer(completion))
    if not numbers:
        return 0.0
    return 1.0 if numbers[-1] == ex.answer else FORMAT_CREDIT


CHAT_SUM = Task(
    name="chat_sum",
    description="Addition asked in a chat, for chat models (data.chat_template: true): 'What is 46 + 27?' "
    "→ any reply whose last number is the sum ('46 + 27 = 73', 'The sum is 73.'); a wrong last number "
    "earns 0.1. Difficulty 1: single digits; 2: two-digit operands.",
    difficulties=(1, 2),
    default_difficulty=2,
    draw=_sum_asked(_CHAT_QUESTIONS),
    verify=_verify_last_number,
)


# -- countdown ---------------------------------------------------------------------------------

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate_expression(text: str) -> tuple[Fraction, list[int]] | None:
    """Exact value of an arithmetic expression over integers with + - * / and parentheses.

    Returns the value and the integer literals used, or None if the text is not such an
    expression (or divides by zero). Never calls ``eval``.
    """
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):
        return None
    used: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ZeroDivisionError
            return Fraction(_OPS[type(node.op)](left, right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        raise ValueError("not an arithmetic expression")

    try:
        return walk(tree.body), used
    except (ValueError, ZeroDivisionError):
        return None


def _draw_countdown(rng: random.Random, d: int) -> Example:
    # difficulty = how many numbers (2..4); the target is reachable by construction
    while True:
        nums = [rng.randint(1, 9 if d == 2 else 6 * d) for _ in range(d)]
        expr = str(nums[0])
        for n in nums[1:]:
            expr = f"{expr}{rng.choice('+-*')}{n}"
        value = evaluate_expression(expr)
        assert value is not None
        if value[0].denominator == 1 and 0 <= value[0] <= 99:
            target = int(value[0])
            shown = sorted(nums)
            prompt = f"{' '.join(map(str, shown))}>{target}:"
            return Example(prompt=prompt, answer=str(target), demonstration=expr,
                           fields={"numbers": shown, "target": target})


def _verify_countdown(completion: str, ex: Example) -> float:
    text = strip_answer(completion)
    result = evaluate_expression(text)
    if result is None:
        return 0.0
    value, used = result
    available = list(ex.fields["numbers"])
    for n in used:
        if n not in available:
            return FORMAT_CREDIT
        available.remove(n)
    return 1.0 if value == ex.fields["target"] else FORMAT_CREDIT


COUNTDOWN = Task(
    name="countdown",
    description="Reach the target with the given numbers, each used at most once, and + - * / : "
    "'3 4 7>25:' → '3*7+4'.",
    difficulties=(2, 3, 4),
    default_difficulty=3,
    draw=_draw_countdown,
    verify=_verify_countdown,
)


# -- string transformations --------------------------------------------------------------------

def _word_task(name: str, transform: Callable[[str], str]) -> Callable[[random.Random, int], Example]:
    """Draw a lowercase word of ``d`` letters: prompt '<name> <word>=', answer ``transform(word)``."""
    def draw(rng: random.Random, d: int) -> Example:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(d))
        return Example(prompt=f"{name} {word}=", answer=transform(word), fields={"word": word})
    return draw


_draw_reverse = _word_task("rev", lambda w: w[::-1])
_draw_sort = _word_task("sort", lambda w: "".join(sorted(w)))


def _verify_letters(completion: str, ex: Example) -> float:
    text = strip_answer(completion)
    if text == ex.answer:
        return 1.0
    same_letters = sorted(text) == sorted(ex.fields["word"])
    return FORMAT_CREDIT if same_letters else 0.0


REVERSE = Task(
    name="reverse",
    description="Reverse a lowercase word of `difficulty` letters: 'rev abc=' → 'cba'.",
    difficulties=tuple(range(2, 11)),
    default_difficulty=4,
    draw=_draw_reverse,
    verify=_verify_letters,
)

SORT = Task(
    name="sort",
    description="Sort the letters of a lowercase word of `difficulty` letters: 'sort cab=' → 'abc'.",
    difficulties=tuple(range(2, 11)),
    default_difficulty=4,
    draw=_draw_sort,
    verify=_verify_letters,
)


# -- a long tail of answer lengths -------------------------------------------------------------

REPEAT_CAP = 8
"""Answers are at most ``REPEAT_CAP × difficulty`` letters."""


def _draw_repeat(rng: random.Random, d: int) -> Example:
    """A length n, geometric with mean about ``d`` and capped at ``REPEAT_CAP · d``, and a pattern
    of one or two letters: prompt 'rep ab 5=', answer the pattern repeated to n letters ('ababa')."""
    n = 1
    while n < REPEAT_CAP * d and rng.random() > 1 / d:
        n += 1
    pattern = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.choice((1, 2))))
    answer = (pattern * n)[:n]
    return Example(prompt=f"rep {pattern} {n}=", answer=answer, fields={"pattern": pattern, "length": n})


def _verify_repeat(completion: str, ex: Example) -> float:
    text = strip_answer(completion)
    if text == ex.answer:
        return 1.0
    pattern = ex.fields["pattern"]
    in_pattern = bool(text) and text == (pattern * len(text))[:len(text)]
    return FORMAT_CREDIT if in_pattern else 0.0


REPEAT = Task(
    name="repeat",
    description="Repeat a pattern of one or two letters to n letters: 'rep ab 5=' → 'ababa'. n is "
    "geometric with mean `difficulty`, up to 8 × `difficulty` (a split of distinct prompts runs a "
    "little longer): answer lengths with a long tail, for publishing without draining "
    "(async.inflight_update).",
    difficulties=tuple(range(2, 17)),
    default_difficulty=8,
    draw=_draw_repeat,
    verify=_verify_repeat,
)
