"""The staleness budget: static settings and the rules derived from them alone.

Vocabulary (docs/architecture.md §1): ``S = max_staleness`` is stated in whole rollout batches, ``U =
updates_per_batch`` optimizer updates are made from each batch, so the budget in updates is
``staleness_budget = S·U`` and ``admission_depth = S + 1`` batches may be outstanding against one
published snapshot. A *hard boundary* is the next eval, checkpoint or final batch count.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Literal

from tether.control.inflight import InflightMode, inflight_mode
from tether.errors import ConfigError

OnStale = Literal["error", "drop"]
ON_STALE_CHOICES: tuple[str, ...] = ("error", "drop")
InflightUpdate = Literal["drain", "keep", "recompute", "abort"]


def _require_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class BudgetSettings:
    """Everything the control rules need that does not change during a run."""

    max_staleness: int = 1
    """S: how many rollout batches old the data may be when it trains."""
    updates_per_batch: int = 1
    """U: optimizer updates (mini-batches) made from one rollout batch."""
    max_inflight: int = 2
    """Generations that may run concurrently."""
    total_batches: int = 1
    """Rollout batches to train in the whole run (the final hard boundary)."""
    eval_interval: int = 0
    """Evaluate every this many trained batches (0 = off)."""
    save_interval: int = 0
    """Checkpoint every this many trained batches (0 = off)."""
    on_stale: OnStale = "error"
    """What to do with a batch above budget at consumption: fail closed, or drop and count it."""
    max_consecutive_drops: int = 16
    """With ``on_stale=drop``: fail after this many stale batches in a row (a stuck engine)."""
    sync_when_idle: bool = False
    """Also publish after any step at which the engines are idle and there is something new
    (an ``idle`` sync), not only when the budget or a boundary forces it. Never waits for
    generation; keeps the pipeline full at S >= 1 when training is the slower side."""
    inflight_update: InflightUpdate = "drain"
    """How a publication meets generations in flight. ``drain`` waits for them (docs/architecture.md §2 rule 5
    as written). ``keep``, ``recompute`` and ``abort`` publish without waiting (the engines
    switch mid-generation; the modes differ in the engine, not here): the sync rule then
    publishes after every step the trainer is ahead (nothing waits), and admission bounds each
    launch by the oldest version still generating (``AsyncControl.freshness``). Eval and
    checkpoint boundaries find nothing in flight in every mode."""
    drain_at_turns: bool = False
    """With ``drain``: a publication waits only for the turn generations in flight, not whole
    batches (agent episodes, ``env.switch_at=turn``). Generations then outlive publications, so
    the control plane runs the rules of publishing without draining."""

    def __post_init__(self) -> None:
        _require_int("async.max_staleness", self.max_staleness, 0)
        _require_int("train.updates_per_batch", self.updates_per_batch, 1)
        _require_int("async.max_inflight", self.max_inflight, 1)
        _require_int("train.num_batches", self.total_batches, 1)
        _require_int("eval.interval", self.eval_interval, 0)
        _require_int("checkpoint.interval", self.save_interval, 0)
        _require_int("async.max_consecutive_drops", self.max_consecutive_drops, 1)
        declared = inflight_mode(self.inflight_update)  # refuses an unknown name
        if self.drain_at_turns and not declared.drains:
            raise ConfigError("draining at turn boundaries needs async.inflight_update=drain")
        if self.sync_when_idle and not self.drains:
            how = "drains only the turns in flight" if self.drain_at_turns else "publishes without waiting"
            raise ConfigError(f"async.sync_when_idle has no effect with async.inflight_update="
                              f"{self.inflight_update}, which {how}, after every step; remove one of them")
        if self.on_stale not in ON_STALE_CHOICES:
            raise ConfigError(
                f"async.on_stale must be one of {', '.join(ON_STALE_CHOICES)}, got {self.on_stale!r}"
            )

    # -- derived quantities -------------------------------------------------------------------

    @property
    def mode(self) -> InflightMode:
        """The in-flight mode the control rules run (``tether.control.inflight``):
        ``async.inflight_update``, or what it runs as at turn safe points with ``drain_at_turns``."""
        declared = inflight_mode(self.inflight_update)
        return declared.at_turns() if self.drain_at_turns else declared

    @property
    def drains(self) -> bool:
        """Every publication waits for the generations in flight to finish (``InflightMode.drains``,
        whole batches)."""
        return self.mode.drains

    @property
    def staleness_budget(self) -> int:
        """The budget in optimizer updates: ``S · U``."""
        return self.max_staleness * self.updates_per_batch

    @property
    def admission_depth(self) -> int:
        """Rollout batches that may be outstanding against one published snapshot: ``S + 1``."""
        return self.max_staleness + 1

    def _next_publication(self, last: int) -> int:
        """After a publication following step ``last``, the step after which the sync rule (every
        update committed, no idle syncs) publishes next. Draining: lazily, at the next eval or
        save boundary, or ``admission_depth`` batches on when the budget is spent, whichever
        comes first. Without draining: after the very next step."""
        if not self.drains:
            return last + 1
        boundaries = [(last // i + 1) * i for i in (self.eval_interval, self.save_interval) if i > 0]
        return min([last + self.admission_depth, *boundaries])

    @functools.cached_property
    def _lazy_steps(self) -> tuple[int, ...]:
        steps, last = [], 0
        while (last := self._next_publication(last)) < self.total_batches:
            steps.append(last)
        if self.eval_interval or self.save_interval:  # the final boundary evaluates or saves
            steps.append(self.total_batches)
        return tuple(steps)

    def lazy_publications(self) -> list[int]:
        """Steps after which weights are published under the lazy rule (``_next_publication``)
        over the whole run. A boundary at the final step publishes too; the budget does not."""
        return list(self._lazy_steps)

    @functools.cached_property
    def sync_gaps(self) -> tuple[int, ...]:
        """Batches between consecutive publications over one repeating cycle of the schedule
        (lazy rule, full commits; the run's own publications when it is shorter than a cycle).
        One gap when the schedule is regular: with no intervals, or intervals that are multiples
        of ``admission_depth`` — docs/architecture.md §1 (S = 3 with eval every 6: publications after 4, 6,
        10, 12, …: gaps (4, 2)). Computed once per settings: the driver reads it every step."""
        intervals = [i for i in (self.eval_interval, self.save_interval) if i > 0]
        if not self.drains:
            return (1,)
        if not intervals:
            return (self.admission_depth,)
        cycle = math.lcm(*intervals)
        # a run's final publication only ends it; it is part of the pattern when it ends a cycle
        steps = [0, *(s for s in self._lazy_steps if s <= cycle and (s < self.total_batches or s == cycle))]
        if len(steps) == 1:
            return (self._next_publication(0),)
        gaps = tuple(b - a for a, b in itertools.pairwise(steps))
        return (gaps[0],) if len(set(gaps)) == 1 else gaps

    @property
    def sync_period_batches(self) -> int | None:
        """Batches between publications when the schedule is regular
        (``min(admission_depth, eval_interval, save_interval)`` over the non-zero intervals, each a
        multiple of the smallest); None when it is irregular (see ``sync_gaps``)."""
        gaps = self.sync_gaps
        return gaps[0] if len(gaps) == 1 else None

    def describe_sync_schedule(self) -> str:
        """The publication schedule in words: a period, or the irregular pattern."""
        gaps = self.sync_gaps
        if len(gaps) == 1:
            return f"every {gaps[0]} batch(es)"
        steps = self.lazy_publications()
        shown = ", ".join(map(str, steps[:6])) + (", …" if len(steps) > 6 else "")
        return (f"on an irregular schedule: after batches {shown} "
                f"(gaps {', '.join(map(str, gaps[:8]))}{' …' if len(gaps) > 8 else ''} repeating)")

    @property
    def effective_max_staleness(self) -> int:
        """The deepest staleness, in batches, data can actually reach in this run.

        The budget caps it at S, a short run at ``total_batches − 1``, and the longest gap
        between publications at ``gap − 1`` — without draining, where publications do not wait
        and so do not bound it, the longest gap between hard boundaries (admission never
        launches past one, and each publishes).
        """
        return min(self.max_staleness, max(self.capping_gaps) - 1, self.total_batches - 1)

    @property
    def capping_gaps(self) -> tuple[int, ...]:
        """The gaps that cap staleness: between publications when they drain, else between hard
        boundaries (the run's length when there are none)."""
        if self.drains:
            return self.sync_gaps
        intervals = [i for i in (self.eval_interval, self.save_interval) if i > 0]
        if not intervals:
            return (self.total_batches,)
        cycle = math.lcm(*intervals)
        steps = sorted({0, *(k for i in intervals for k in range(i, cycle + 1, i))})
        return tuple(b - a for a, b in itertools.pairwise(steps))

    # -- hard boundaries ----------------------------------------------------------------------

    def next_hard_boundary(self, trained_batches: int) -> int:
        """The nearest eval, checkpoint or final batch count strictly above ``trained_batches``."""
        assert 0 <= trained_batches < self.total_batches, (
            f"trained_batches={trained_batches} outside [0, {self.total_batches})")
        boundary = self.total_batches
        for interval in (self.eval_interval, self.save_interval):
            if interval > 0:
                boundary = min(boundary, (trained_batches // interval + 1) * interval)
        return boundary

    def eval_due(self, step: int) -> bool:
        """Evaluate after ``step`` trained batches: at every interval and at the end."""
        return self.eval_interval > 0 and (step % self.eval_interval == 0 or step == self.total_batches)

    def save_due(self, step: int) -> bool:
        """Checkpoint after ``step`` trained batches: at every interval and at the end."""
        return self.save_interval > 0 and (step % self.save_interval == 0 or step == self.total_batches)
