"""Reward functions: built-ins, a task's own verifier, or a user's ``path/to/file.py:function``.

One signature for all of them::

    def reward(prompt: str, completion: str, answer: str, fields: Mapping[str, Any]) -> float

``prompt`` is the text the model saw, ``completion`` the text it generated (special tokens
removed), ``answer`` the row's reference answer, ``fields`` the row's other columns. The return
must be a finite number (bool counts as 0/1); anything else is an error.

Rewards run inside the rollout worker, so scoring overlaps training.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tether import registry
from tether.data.tasks import get_task, strip_answer
from tether.errors import ConfigError, RewardError
from tether.pyload import load_python_object
from tether.vocabulary import Example

RewardFn = Callable[[str, str, str, Mapping[str, Any]], float]
SIGNATURE = "(prompt, completion, answer, fields) -> float"


def exact_match(prompt: str, completion: str, answer: str, fields: Mapping[str, Any]) -> float:
    """1 when the completion's first line, stripped, equals the answer stripped."""
    return float(strip_answer(completion) == answer.strip())


_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def _number(text: str) -> float | None:
    match = _NUMBER.search(text.replace(",", ""))
    return float(match.group()) if match else None


def numeric_match(prompt: str, completion: str, answer: str, fields: Mapping[str, Any]) -> float:
    """1 when the first number in the completion's first line equals the answer's (rel. 1e-6)."""
    got, want = _number(strip_answer(completion)), _number(answer)
    if got is None or want is None:
        return 0.0
    return float(math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9))


def math_verify(prompt: str, completion: str, answer: str, fields: Mapping[str, Any]) -> float:
    """1 when math-verify judges the completion's final answer equal to the reference."""
    try:
        from math_verify import parse, verify
    except ImportError as exc:
        raise ConfigError("reward 'math' needs math-verify: pip install 'tether[math]'") from exc
    gold = parse(answer)
    pred = parse(completion)
    return float(bool(gold) and bool(pred) and verify(gold, pred))


def task_reward(task_name: str) -> RewardFn:
    """The verifier of a built-in task, in the reward signature."""
    task = get_task(task_name)

    def reward(prompt: str, completion: str, answer: str, fields: Mapping[str, Any]) -> float:
        return task.verify(completion, Example(prompt=prompt, answer=answer, fields=fields))

    reward.__name__ = f"{task_name}_verifier"
    return reward


def batched(fn: Callable) -> Callable:
    """Mark a reward function as batched: it takes lists — ``(prompts, completions, answers,
    fields)``, one entry per sample of the batch — and returns one reward per sample. A reward
    model (PickScore-, ImageReward- or OCR-class, loaded once from a local path) scores a whole
    batch in one forward this way (docs/data.md)."""
    fn.tether_batched = True
    return fn


def is_batched(fn: Callable) -> bool:
    return bool(getattr(fn, "tether_batched", False))


def check_signature(fn: Callable, spec: str) -> None:
    """Refuse a function that cannot be called with the four reward arguments."""
    try:
        inspect.signature(fn).bind("prompt", "completion", "answer", {})
    except TypeError as exc:
        try:
            shown = str(inspect.signature(fn))
        except (TypeError, ValueError):
            shown = "(unknown)"
        raise ConfigError(
            f"reward function {spec!r} must accept {SIGNATURE}; its signature is {shown}"
        ) from exc
    except ValueError:
        return  # builtins without a signature: checked on first call instead


def load_reward(spec: str, *, task: str | None = None) -> RewardFn:
    """``task`` (the task's verifier), a registered name (``tether.registry.rewards``), or
    ``path/to/file.py:function``."""
    if spec == "task":
        if not task:
            raise ConfigError("reward.function=task needs a built-in data.task; choose one of "
                              f"{', '.join(['task', *registry.rewards.names()])} or path/to/file.py:function")
        return task_reward(task)
    if spec in registry.rewards:
        if spec == "math":
            try:
                import math_verify  # noqa: F401
            except ImportError as exc:
                raise ConfigError("reward 'math' needs math-verify: pip install 'tether[math]'") from exc
        return registry.rewards.get(spec)
    if ":" in spec:
        fn = load_python_object(spec, what="reward function")
        check_signature(fn, spec)
        return fn
    raise ConfigError(f"unknown reward {spec!r}; use 'task', one of {', '.join(registry.rewards.names())}, "
                      "or path/to/file.py:function")


@dataclass(frozen=True)
class Scorer:
    """Calls a reward function and insists on a finite number of sensible size: any real number
    (a bool, an int, a float, a NumPy scalar, a one-number array or tensor), within ±``LIMIT``."""

    fn: RewardFn
    name: str

    LIMIT = 1e6
    """Rewards are turned into float32 advantages, whose statistics square them: beyond this a
    reward is a mistake (a sentinel, an overflow), not a score."""

    @property
    def batched(self) -> bool:
        return is_batched(self.fn)

    def take_parts(self) -> dict[str, float]:
        """The parts' means since the last call (``WeightedScorer``'s); one function has none."""
        return {}

    def __call__(self, example: Example, completion: str) -> float:
        if self.batched:  # a batch of one (held-out evaluation scores sample by sample)
            return self.many([example], [completion])[0]
        return self._checked(self.fn(example.prompt, completion, example.answer, example.fields), example)

    def many(self, examples: list[Example], completions: list[Any]) -> list[float]:
        """The rewards of a whole batch: one call of a batched function, else one call a sample."""
        if not self.batched:
            return [self(e, c) for e, c in zip(examples, completions, strict=True)]
        values = self.fn([e.prompt for e in examples], list(completions), [e.answer for e in examples],
                         [e.fields for e in examples])
        values = list(values) if not isinstance(values, list) else values
        if len(values) != len(examples):
            raise RewardError(f"batched reward function {self.name} returned {len(values)} rewards for "
                              f"{len(examples)} samples; it must return one per sample")
        return [self._checked(v, e) for v, e in zip(values, examples, strict=True)]

    def _checked(self, value: Any, example: Example) -> float:
        value = _real(value)
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(
                f"reward function {self.name} returned {value!r} for prompt {example.prompt[:60]!r}; "
                "it must return a finite number"
            )
        if abs(value) > self.LIMIT:
            raise RewardError(
                f"reward function {self.name} returned {float(value):g} for prompt {example.prompt[:60]!r}; "
                f"rewards must lie within ±{self.LIMIT:g} (scale them: advantages are computed in float32)"
            )
        return float(value)


def score_all(score: Scorer | WeightedScorer, pairs: Iterable[tuple[Example, Any]], *,
              on_error: str = "raise") -> tuple[list[float], int]:
    """The reward of each (example, completion) pair, and how many failed: with
    ``reward.on_error=zero`` a reward function that raises (or returns junk) scores that sample 0
    and is counted; with ``raise`` the first failure propagates."""
    if score.batched:  # one call for the batch: a failure fails all of it
        pairs = list(pairs)
        try:
            return score.many([e for e, _ in pairs], [c for _, c in pairs]), 0
        except Exception:
            if on_error == "raise":
                raise
            return [0.0] * len(pairs), len(pairs)
    rewards, errors = [], 0
    for example, completion in pairs:
        try:
            rewards.append(score(example, completion))
        except Exception:
            if on_error == "raise":
                raise
            errors += 1
            rewards.append(0.0)
    return rewards, errors


def _real(value: Any) -> Any:
    """A NumPy scalar, or a 0-d array or tensor, as the Python number it holds; anything else as it is."""
    if not isinstance(value, numbers.Real) and getattr(value, "shape", None) == () and hasattr(value, "item"):
        return value.item()
    return value


def scorer(spec: str, *, task: str | None = None) -> Scorer:
    return Scorer(load_reward(spec, task=task), spec)


class WeightedScorer:
    """Σ wᵢ·rᵢ over several scorers (``reward.functions`` and ``reward.weights``); the parts of
    every call are kept for ``take_parts``, each checked as its own scorer checks it."""

    def __init__(self, parts: list[Scorer], weights: list[float]) -> None:
        self.parts, self.weights = parts, weights
        self.name = " + ".join(f"{w:g}·{p.name}" for p, w in zip(parts, weights, strict=True))
        self._seen: list[list[float]] = []

    @property
    def batched(self) -> bool:
        return any(part.batched for part in self.parts)

    def __call__(self, example: Example, completion: Any) -> float:
        values = [part(example, completion) for part in self.parts]
        self._seen.append(values)
        return float(sum(w * v for w, v in zip(self.weights, values, strict=True)))

    def many(self, examples: list[Example], completions: list[Any]) -> list[float]:
        columns = [part.many(examples, completions) for part in self.parts]
        rows = [list(r) for r in zip(*columns, strict=True)]
        self._seen += rows
        return [float(sum(w * v for w, v in zip(self.weights, r, strict=True))) for r in rows]

    def take_parts(self) -> dict[str, float]:
        """Each part's mean over the calls since the last ``take_parts`` (``reward/part_<i>_mean``)."""
        seen, self._seen = self._seen, []
        if not seen:
            return {}
        return {f"reward/part_{i}_mean": sum(row[i] for row in seen) / len(seen)
                for i in range(len(self.parts))}


def scorer_of(cfg: Any, one: Any) -> Any:
    """The recipe's reward: ``one(spec)`` (a family's scorer for one name) for ``reward.function``,
    or the weighted sum over ``reward.functions``."""
    r = cfg.reward
    if not r.functions:
        return one(r.function)
    return WeightedScorer([one(spec) for spec in r.functions], list(r.weights) or [1.0] * len(r.functions))
