"""A rollout batch as sequences of different lengths, for the virtual world (``tether plan``).

With ``plan.mean_length`` set, each sequence's completion length is drawn from a geometric
distribution capped at ``rollout.max_new_tokens`` (the long tail of sampled lengths: a stop token
that comes with the same small chance at every step), whose mean — of the capped lengths, what a
run reports as ``response/length_mean`` — is ``plan.mean_length``. A batch decodes all its
sequences together, one step per token of its longest: a step takes ``step_s``, chosen so that a
batch takes ``plan.gen_time`` on average. What a publication in flight does then depends on the
mode, at the next step boundary J after it (the engines poll before each step; publications
that reach the same poll make one switch, to the newest; one that comes during a recompute's
prefill is seen at the poll after it):

- ``keep``: nothing changes but the version of the tokens from step J on;
- ``recompute``: as keep, after a prefill of the J-token prefix, which costs
  ``prefill_cost · J`` steps (``plan.prefill_cost``: the time to run one prefix token again, as a
  fraction of a decode step);
- ``abort``: every unfinished sequence starts again at J under the new weights with a new length;
  the tokens it had are wasted.

Every draw is a function of (seed, batch, sequence, attempt), so replaying a generation's
publications gives the same answer however often it is done.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

from tether.control.inflight import InflightMode, inflight_mode
from tether.errors import ConfigError


@dataclass(frozen=True)
class Lengths:
    """Completion lengths: geometric, capped at ``cap``, their mean ``mean`` tokens."""

    mean: float
    cap: int
    rows: int
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.mean >= 1 and self.cap >= 1 and self.rows >= 1):
            raise ConfigError(f"lengths need mean >= 1, cap >= 1 and rows >= 1, got {self}")

    @functools.cached_property
    def _continue(self) -> float:
        """The chance q a sequence goes on after each token: E[min(L, cap)] = Σ_{k<cap} q^k =
        ``mean``, solved by bisection (the sum grows with q)."""
        if self.mean >= self.cap:
            return 1.0
        lo, hi = 0.0, 1.0
        for _ in range(100):
            q = (lo + hi) / 2
            capped_mean = self.cap if q == 1.0 else (1.0 - q**self.cap) / (1.0 - q)
            lo, hi = (q, hi) if capped_mean < self.mean else (lo, q)
        return (lo + hi) / 2

    def draw(self, batch: int, row: int, attempt: int) -> int:
        q = self._continue
        if q <= 0 or q >= 1:
            return 1 if q <= 0 else self.cap
        u = random.Random(f"{self.seed}/{batch}/{row}/{attempt}").random()
        return min(self.cap, 1 + int(math.log1p(-u) / math.log(q)))

    def expected_longest(self) -> float:
        """E[max over ``rows`` lengths] in tokens: Σ_k P(max > k), P(L > k) = q^k below the cap."""
        q = self._continue
        return sum(1.0 - (1.0 - q**k) ** self.rows for k in range(self.cap))


@dataclass
class Replay:
    """A generation's outcome after the publications it saw."""

    steps: int
    """Decode steps until its last sequence finished."""
    pause_s: float
    """Prefill time recompute added."""
    tokens_by_version: dict[int, int]
    spanning_rows: int
    """Sequences whose tokens came from more than one version."""
    wasted_tokens: int
    switches: int = 0
    """Switches it made (publications that reached the same poll count once)."""


def replay(lengths: Lengths, batch: int, version: int, mode: str | InflightMode,
           switches: list[tuple[float, int]], start: float, step_s: float, prefill_cost: float) -> Replay:
    """Decode batch ``batch`` launched at ``version``, starting at ``start``, through the
    publications ``switches`` ((time, version), in order) under ``mode`` (its ``on_switch``)."""
    mode = inflight_mode(mode)
    begin = [0] * lengths.rows
    length = [lengths.draw(batch, i, 0) for i in range(lengths.rows)]
    attempt = [0] * lengths.rows
    row_version = [version] * lengths.rows
    cuts: dict[int, int] = {}  # step → version from it on, for keep and recompute
    pause, wasted, last, last_poll = 0.0, 0, 0, start
    switched: set[int] = set()  # step boundaries at which it switched
    for t, v in switches:
        if t <= start:  # published before it started: it starts under the newer weights
            row_version = [v] * lengths.rows
            continue
        steps = max(b + n for b, n in zip(begin, length, strict=True))
        # the boundary whose poll sees it: the first after it, counting the prefills so far
        j = math.ceil((t - start - pause) / step_s - 1e-9) if step_s > 0 else steps
        if switched and j <= last:  # near the last switch: before its poll, or during its prefill
            j = last if t <= last_poll else last + 1
        if j >= steps:
            break  # it had finished
        again = j in switched  # a second publication before the same poll: one switch, the newest
        if not again:
            last, last_poll = j, start + j * step_s + pause
        switched.add(j)
        if mode.restarts:
            for i in range(lengths.rows):
                if again and begin[i] == j:
                    row_version[i] = v  # restarted at this boundary: it starts under the newest
                elif begin[i] + length[i] > j:
                    wasted += j - begin[i]
                    attempt[i] += 1
                    begin[i], length[i], row_version[i] = j, lengths.draw(batch, i, attempt[i]), v
        else:
            cuts[j] = v
            if mode.recomputes_prefix and not again:
                pause += prefill_cost * j * step_s
    tokens: dict[int, int] = {}
    spanning = 0
    for i in range(lengths.rows):
        lo, hi = begin[i], begin[i] + length[i]
        edges = [(lo, row_version[i])] + [(j, v) for j, v in sorted(cuts.items()) if lo < j < hi]
        for k, (at, v) in enumerate(edges):
            end = edges[k + 1][0] if k + 1 < len(edges) else hi
            tokens[v] = tokens.get(v, 0) + end - at
        spanning += len(edges) > 1
    steps = max(b + n for b, n in zip(begin, length, strict=True))
    return Replay(steps, pause, tokens, spanning, wasted, len(switched))
