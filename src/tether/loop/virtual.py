"""Virtual time: the real driver loop run against a simulated pool and learner.

Nothing sleeps. Each generation's completion time is known when it is launched (it starts when
one of ``workers`` engines is free and takes ``gen_time`` seconds, optionally jittered), each
training step advances the shared clock by ``U × train_time``, each publish by ``sync_time``.
Because the loop is the real one, the trace it produces is the exact publication schedule and
staleness distribution a real run with those timings would have.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tether.control import AsyncControl, BudgetSettings, admission_notes
from tether.control.inflight import DRAIN, InflightMode
from tether.errors import ConfigError, ControlError
from tether.loop.driver import Driver
from tether.loop.observe import LoopObserver, Observers, TraceRecorder
from tether.loop.sequences import Lengths, Replay, replay
from tether.vocabulary import GenerationRequest, LoopState, RolloutBatch, TrainResult


class VirtualClock:
    """Seconds of simulated time; the simulated pool and learner move it forward."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)


@dataclass(frozen=True)
class Timings:
    """How long things take in the virtual world, in seconds."""

    gen_time: float = 1.0
    """Mean time to generate and score one rollout batch on one engine."""
    gen_jitter: float = 0.0
    """Coefficient of variation of generation time (lognormal, long-tailed); 0 = constant."""
    train_time: float = 1.0
    """Time per optimizer update (a step costs U × train_time, committed or not)."""
    sync_time: float = 0.0
    """Time to publish weights to the engines."""
    eval_time: float = 0.0
    save_time: float = 0.0
    workers: int = 1
    """Engines generating concurrently."""
    commits: tuple[int, ...] = ()
    """Committed updates per consumed batch, cycled; empty = always U."""
    seed: int = 0
    mean_length: float = 0.0
    """Mean completion length in tokens; > 0 models each sequence (tether.loop.sequences): lengths
    geometric with this mean, capped at ``max_length``, a batch as long as its longest."""
    max_length: int = 0
    prefill_cost: float = 0.0
    """recompute: seconds to run one prefix token again, as a fraction of a decode step."""

    def __post_init__(self) -> None:
        if self.mean_length > 0 and (self.gen_jitter > 0 or self.max_length < 1):
            raise ConfigError("per-sequence lengths (mean_length > 0) need max_length >= 1 and make "
                             "the batch-to-batch variation themselves: gen_jitter must be 0")
        for name in ("gen_time", "gen_jitter", "train_time", "sync_time", "eval_time", "save_time",
                     "mean_length", "prefill_cost"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")


@dataclass(order=True)
class _Generation:
    complete: float
    seq: int
    request: GenerationRequest = field(compare=False)
    start: float = field(compare=False, default=0.0)
    switches: list[tuple[float, int]] = field(compare=False, default_factory=list)
    """(when, version) of every publication while it was outstanding (without draining)."""
    engine: int = field(compare=False, default=0)
    outcome: Replay | None = field(compare=False, default=None)
    """With per-sequence lengths: what its sequences did through ``switches``."""

    def segments(self) -> list[tuple[int, float]]:
        """(version, share of its tokens) in order of version. Without per-sequence lengths tokens
        come at an even pace, so the share of time under a version is the share of its tokens."""
        if self.outcome is not None:
            total = sum(self.outcome.tokens_by_version.values())
            return [(v, n / total) for v, n in sorted(self.outcome.tokens_by_version.items()) if n > 0]
        version, cuts = self.request.version, []
        for t, v in self.switches:
            if t <= self.start:
                version = v  # it had not started yet: it starts under the newer weights
            elif t < self.complete:
                cuts.append((t, v))
        span = self.complete - self.start
        if span <= 0 or not cuts:
            return [(version, 1.0)]
        out, t0 = [], self.start
        for t, v in cuts:
            out.append((version, (t - t0) / span))
            version, t0 = v, t
        out.append((version, (self.complete - t0) / span))
        return out


class SimPool:
    """A pool of ``workers`` simulated engines that stamp their version into the data."""

    def __init__(self, clock: VirtualClock, timings: Timings, *, num_groups: int = 1,
                 group_size: int = 1, inflight: InflightMode = DRAIN) -> None:
        self.clock = clock
        self.mode = inflight
        self.drains = inflight.drains
        self.lengths = None
        self.step_s = 0.0
        self.wasted_tokens = 0
        if timings.mean_length > 0:
            self.lengths = Lengths(timings.mean_length, timings.max_length, num_groups * group_size,
                                   timings.seed)
            self.step_s = timings.gen_time / self.lengths.expected_longest()
        self.t = timings
        self.num_groups = num_groups
        self.group_size = group_size
        self.rng = random.Random(timings.seed)
        self.version = 0
        self.engine_free = [0.0] * timings.workers
        self.busy_s = 0.0
        self.launched: list[GenerationRequest] = []
        self.spans: list[tuple[int, float, float, int]] = []
        """(engine, start, end, batch index) of every generation."""
        self.publishes: list[tuple[float, int]] = []
        self._heap: list[_Generation] = []
        self._seq = 0

    def _draw_gen_time(self) -> float:
        mean, cv = self.t.gen_time, self.t.gen_jitter
        if cv <= 0 or mean <= 0:
            return mean
        sigma2 = math.log1p(cv * cv)
        return self.rng.lognormvariate(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))

    @property
    def inflight(self) -> int:
        return len(self._heap)

    def launch(self, request: GenerationRequest) -> None:
        if request.version != self.version:
            raise ControlError(f"launch stamped version {request.version}, engines hold {self.version}")
        engine = min(range(len(self.engine_free)), key=self.engine_free.__getitem__)
        start = max(self.clock.now, self.engine_free[engine])
        g = _Generation(start, self._seq, request, start, engine=engine)
        if self.lengths is None:
            duration = self._draw_gen_time()
        else:
            g.outcome = self._replay(g)
            duration = g.outcome.steps * self.step_s
        g.complete = start + duration
        self.engine_free[engine] = start + duration
        self.busy_s += duration
        heapq.heappush(self._heap, g)
        self.spans.append((engine, start, start + duration, request.index))
        self._seq += 1
        self.launched.append(request)

    def _replay(self, g: _Generation) -> Replay:
        assert self.lengths is not None
        return replay(self.lengths, g.request.index, g.request.version, self.mode, g.switches, g.start,
                      self.step_s, self.t.prefill_cost)

    def _rescheduled(self, g: _Generation) -> None:
        """Replay ``g`` through its publications; a generation that now ends later (abort's new
        sequences, recompute's prefill) delays what its engine had queued after it."""
        before = g.outcome
        g.outcome = self._replay(g)
        assert before is not None
        self.wasted_tokens += g.outcome.wasted_tokens - before.wasted_tokens
        end = g.start + g.outcome.steps * self.step_s + g.outcome.pause_s
        shift = end - g.complete
        if shift == 0:
            return
        for other in self._heap:
            if other.engine == g.engine and other.start > g.start:
                other.start += shift
                other.complete += shift
        g.complete = end
        self.engine_free[g.engine] += shift
        self.busy_s += shift

        def moved(span: tuple[int, float, float, int]) -> tuple[int, float, float, int]:
            engine, begin, finish, index = span
            if engine != g.engine or begin < g.start:
                return span
            if begin == g.start:
                return engine, begin, end, index
            return engine, begin + shift, finish + shift, index

        self.spans = [moved(span) for span in self.spans]

    def _batch(self, g: _Generation) -> RolloutBatch:
        segments = g.segments()
        shares: dict[int, float] = {}
        for version, share in segments:
            shares[version] = shares.get(version, 0.0) + share
        payload = {"versions": [v for v, _ in segments], "start": g.start, "complete": g.complete,
                   "outcome": g.outcome}
        return RolloutBatch(index=g.request.index, behavior_version=segments[0][0],
                            num_groups=self.num_groups, group_size=self.group_size,
                            payload=payload, newest_version=segments[-1][0],
                            completed_at=g.complete, work_s=g.complete - g.start, version_shares=shares)

    def lost(self) -> list:
        return []  # its workers never die

    def reap(self) -> list[RolloutBatch]:
        out = []
        while self._heap and self._heap[0].complete <= self.clock.now:
            out.append(self._batch(heapq.heappop(self._heap)))
        return out

    def wait(self, timeout: float | None) -> list[RolloutBatch]:
        if not self._heap:
            raise ControlError("wait() with nothing in flight")
        self.clock.advance_to(self._heap[0].complete)
        return self.reap()

    def quiesce(self, timeout: float | None) -> list[RolloutBatch]:
        if self._heap:
            self.clock.advance_to(max(g.complete for g in self._heap))
        return self.reap()

    def publish(self, weights: Any, version: int) -> Mapping[str, float]:
        if self._heap and self.drains:
            raise ControlError("publish while generations are in flight")
        self.clock.now += self.t.sync_time
        self.version = version
        self.publishes.append((self.clock.now, version))
        for g in list(self._heap):  # without draining: each switches to the new weights from now on
            g.switches.append((self.clock.now, version))
            if self.lengths is not None:
                self._rescheduled(g)
        heapq.heapify(self._heap)
        return {}


class SimLearner:
    """Advances the clock by ``U × train_time`` per batch and commits per ``commits``."""

    def __init__(self, clock: VirtualClock, timings: Timings, updates_per_batch: int) -> None:
        self.clock = clock
        self.t = timings
        self.u = updates_per_batch
        self.version = 0
        self.busy_s = 0.0
        self.trained: list[tuple[int, int, int]] = []
        self.spanning = 0  # batches generated under more than one version
        self.spanning_rows = self.rows = 0  # sequences that did, of all (per-sequence lengths only)

    def train(self, batch: RolloutBatch, *, train_version: int) -> TrainResult:
        duration = self.u * self.t.train_time
        self.clock.now += duration
        self.busy_s += duration
        self.trained.append((batch.index, train_version, min(batch.payload["versions"])))
        self.spanning += len(set(batch.payload["versions"])) > 1
        outcome = batch.payload.get("outcome")
        if outcome is not None:
            self.spanning_rows += outcome.spanning_rows
            self.rows += batch.num_groups * batch.group_size
        n = len(self.trained) - 1
        committed = self.t.commits[n % len(self.t.commits)] if self.t.commits else self.u
        self.version = train_version + committed
        return TrainResult(committed, self.u, {})

    def export_weights(self) -> dict[str, int]:
        return {"version": self.version}


class SimHooks:
    """Eval and save cost ``eval_time`` and ``save_time`` of virtual time."""

    def __init__(self, clock: VirtualClock, timings: Timings) -> None:
        self.clock = clock
        self.t = timings

    def evaluate(self, step: int, version: int) -> Mapping[str, float]:
        self.clock.now += self.t.eval_time
        return {}

    def save(self, step: int, state: LoopState) -> None:
        self.clock.now += self.t.save_time


@dataclass
class Simulation:
    """A finished virtual run: its trace and the simulated parts, for inspection."""

    settings: BudgetSettings
    timings: Timings
    trace: TraceRecorder
    pool: SimPool
    learner: SimLearner
    state: LoopState
    makespan: float


def simulate(settings: BudgetSettings, timings: Timings, *, observer: LoopObserver | None = None,
             num_groups: int = 1, group_size: int = 1, anchor: str | None = None) -> Simulation:
    """Run the real driver loop in virtual time (``anchor``: train.anchor, for its notes)."""
    clock = VirtualClock()
    pool = SimPool(clock, timings, num_groups=num_groups, group_size=group_size, inflight=settings.mode)
    learner = SimLearner(clock, timings, settings.updates_per_batch)
    trace = TraceRecorder()
    driver = Driver(AsyncControl(settings), pool, learner, hooks=SimHooks(clock, timings),
                    observer=Observers(trace, observer) if observer else trace, clock=clock,
                    notes=admission_notes(settings, anchor=anchor))
    state = driver.run()
    return Simulation(settings, timings, trace, pool, learner, state, clock.now)


def summarize(sim: Simulation) -> dict[str, Any]:
    """The publication schedule, the staleness distribution, and where time went."""
    s = sim.settings
    syncs = [e for e in sim.trace.of_kind("sync") if e.detail.get("published")]
    staleness = [r.staleness_batches for r in sim.trace.records]
    hist: dict[str, int] = {}
    for value in staleness:
        key = f"{value:g}"
        hist[key] = hist.get(key, 0) + 1
    makespan = sim.makespan
    trained = len(sim.trace.records)
    return {
        "staleness_budget": s.staleness_budget,
        "admission_depth": s.admission_depth,
        "sync_period_batches": s.sync_period_batches,
        "sync_gaps_batches": list(s.sync_gaps),
        "effective_max_staleness_batches": s.effective_max_staleness,
        "syncs_after": [int(e.detail["step"]) for e in syncs],
        "sync_reasons": [list(e.detail["reasons"]) for e in syncs],
        "staleness_histogram_batches": dict(sorted(hist.items(), key=lambda kv: float(kv[0]))),
        "mean_staleness_batches": sum(staleness) / trained if trained else 0.0,
        # where it accrued, in updates: the engines' lag at launch, during generation, in the queue
        **{f"mean_staleness_{part}_updates": (sum(r.metrics[f"staleness/{part}_updates"]
                                                  for r in sim.trace.records) / trained if trained else 0.0)
           for part in ("at_launch", "generating", "queued")},
        "max_staleness_batches": max(staleness, default=0.0),
        # per token: each batch's tokens by the version that produced them (keep: several)
        "mean_token_staleness_updates": (
            sum(r.metrics.get("staleness/token_mean_updates", r.staleness_updates) for r in sim.trace.records)
            / trained if trained else 0.0),
        "multi_version_batch_frac": sim.learner.spanning / trained if trained else 0.0,
        **({"wasted_tokens_per_batch": sim.pool.wasted_tokens / trained if trained else 0.0,
            "multi_version_seq_frac": sim.learner.spanning_rows / max(sim.learner.rows, 1)}
           if sim.pool.lengths is not None else {}),
        "makespan_s": makespan,
        "mean_step_time_s": makespan / trained if trained else 0.0,
        "trainer_idle_fraction": 1 - sim.learner.busy_s / makespan if makespan > 0 else 0.0,
        "generator_idle_fraction": (
            1 - sim.pool.busy_s / (makespan * sim.timings.workers) if makespan > 0 else 0.0
        ),
    }


def plan_document(sim: Simulation) -> dict[str, Any]:
    """The machine-readable plan: settings, every consumed batch, notes and summary."""
    summary = summarize(sim)
    return {
        "settings": {
            "max_staleness": sim.settings.max_staleness,
            "updates_per_batch": sim.settings.updates_per_batch,
            "max_inflight": sim.settings.max_inflight,
            "num_batches": sim.settings.total_batches,
            "eval_interval": sim.settings.eval_interval,
            "save_interval": sim.settings.save_interval,
            "inflight_update": sim.settings.inflight_update,
            "timings": {k: (list(v) if isinstance(v, tuple) else v)
                        for k, v in sim.timings.__dict__.items()},
        },
        "staleness_budget": summary.pop("staleness_budget"),
        "admission_depth": summary.pop("admission_depth"),
        "sync_period_batches": summary.pop("sync_period_batches"),
        "sync_gaps_batches": summary.pop("sync_gaps_batches"),
        "syncs_after": summary.pop("syncs_after"),
        "batches": [
            {
                "index": r.batch_index,
                "step": r.step,
                "behavior_version": r.behavior_version,
                "train_version": r.behavior_version + r.staleness_updates,
                "staleness_updates": r.staleness_updates,
                "staleness_batches": r.staleness_batches,
                "committed_updates": int(r.metrics["async/optimizer_updates"]),
                "staleness_at_launch_updates": int(r.metrics["staleness/at_launch_updates"]),
                "staleness_generating_updates": int(r.metrics["staleness/generating_updates"]),
                "staleness_queued_updates": int(r.metrics["staleness/queued_updates"]),
            }
            for r in sim.trace.records
        ],
        "notes": [{"code": c, "message": m} for c, m in sim.trace.notes],
        "summary": summary,
        "events": event_trace(sim),
    }


def event_trace(sim: Simulation) -> list[dict[str, Any]]:
    """Every event with its timestamp: the loop's own, plus each generation's completion."""
    events = [
        {"t": e.t, "kind": e.kind, "end": e.end, "batch": e.batch, "version": e.version,
         **{k: (list(v) if isinstance(v, tuple) else v) for k, v in e.detail.items()}}
        for e in sim.trace.events
    ]
    events += [
        {"t": end, "kind": "complete", "end": None, "batch": index, "version": None,
         "engine": engine, "started": start}
        for engine, start, end, index in sim.pool.spans
    ]
    order = {"complete": 0}  # a completion precedes the reap that sees it at the same instant
    return sorted(events, key=lambda e: (e["t"], order.get(e["kind"], 1)))


def timings_of(cfg: Any) -> Timings:
    """The virtual world's timings of a recipe (its ``plan`` section, ``rollout.num_workers``)."""
    p = cfg.plan
    if p.mean_length > 0 and p.gen_jitter > 0:
        raise ConfigError("plan.mean_length models each sequence's length, which makes batches vary by "
                          "itself; set plan.gen_jitter=0 (or plan.mean_length=0 for jittered batches)")
    # the family's price of the recipe's update against the one timed (flow: K trained steps of T)
    train_time = p.train_time * cfg.family().plan_train_scale(cfg)
    # episodes (agent family): each turn waits on the environment once, beside the engine's time;
    # the per-sequence model's lengths are the family's (flow: every trajectory flow.steps steps)
    mean_length, max_length = cfg.family().plan_lengths(cfg)
    return Timings(gen_time=p.gen_time + p.turns * p.env_time, gen_jitter=p.gen_jitter,
                   train_time=train_time, sync_time=p.sync_time, eval_time=p.eval_time,
                   save_time=p.save_time,
                   workers=cfg.rollout.num_workers, commits=tuple(p.commits), seed=p.seed,
                   mean_length=mean_length, max_length=max_length,
                   prefill_cost=p.prefill_cost)
