"""``tether plan --optimize``: which recipe to run, from one recipe's measured per-phase timings.

The recipe's ``plan.gen_time`` (a batch's generation on one engine, environment time included),
``plan.train_time`` (one update) and ``plan.sync_time`` (one publication) were measured at its
own batch; other batch shapes are priced in proportion to the samples (a batch of twice the
samples takes twice as long to generate, an update over twice the samples twice as long to
train), publication stays the same. Each candidate runs in virtual time (``tether plan``'s loop)
for ``train.num_batches`` batches (at most 200), and the candidates are ranked by samples/s (those
within ``TIE`` of the fastest by mean staleness), or, with a throughput floor, by mean staleness.

Searched: ``async.max_staleness`` (up to the cap), ``async.max_inflight``,
``rollout.num_workers`` (the engines and the learner's threads within the cores given),
``rollout.batch_size`` and ``rollout.group_size`` (the recipe's, half and double, when asked), and
the publication rule (lazy: ``drain``; idle syncs; eager: ``keep``, where the recipe's family and
engine run it). A candidate the recipe's own checks refuse is left out.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tether.errors import ConfigError

RULES: dict[str, tuple[str, ...]] = {
    "lazy": ("async.inflight_update=drain", "async.sync_when_idle=false"),
    "idle": ("async.inflight_update=drain", "async.sync_when_idle=true"),
    "eager": ("async.inflight_update=keep", "async.sync_when_idle=false"),
}
"""The publication rules searched (docs/concepts.md, Mean staleness in closed form): lazy (drain,
the default), idle syncs, and eager publication with the KV cache kept."""


TIE = 0.03
"""Predicted throughputs this close to the fastest count as equal, and the least stale of them is
chosen: real runs of the chosen and the given recipe landed within a few percent of the prediction on
a quiet machine (benchmarks/optimize_check.py, docs/benchmarks.md), so a smaller lead is not worth
staleness."""


@dataclass(frozen=True)
class Candidate:
    overrides: tuple[str, ...]
    samples_per_s: float
    mean_staleness: float
    max_staleness: float
    trainer_idle: float
    generator_idle: float
    equivalent: int = 0
    """Other candidates with the same samples/s and staleness, each using at least as much (more
    engines, slots or staleness allowed, or a rule that publishes more often)."""

    def line(self) -> str:
        return (f"{self.samples_per_s:8.2f} samples/s  staleness mean {self.mean_staleness:4.2f} max "
                f"{self.max_staleness:g}  trainer idle {self.trainer_idle:4.0%}  generators idle "
                f"{self.generator_idle:4.0%}  {' '.join(self.overrides)}"
                + (f"  (and {self.equivalent} equivalent)" if self.equivalent else ""))


def _halves(value: int, vary: bool, least: int) -> list[int]:
    return sorted({v for v in ((value // 2, value, value * 2) if vary else (value,)) if v >= least})


def candidates(cfg: Any, *, cores: int, staleness_cap: int, vary_batch: bool, vary_group: bool,
               rules: Sequence[str] = tuple(RULES)) -> list[tuple[str, ...]]:
    """The overrides of every candidate recipe."""
    learner_threads = cfg.train.threads * cfg.train.world_size
    per_worker = cfg.rollout.threads_per_worker
    most_workers = (cores - learner_threads) // per_worker
    if most_workers < 1:
        raise ConfigError(f"--cores {cores} leaves no core for a rollout worker beside the learner's "
                          f"{learner_threads} thread(s) (train.threads × train.world_size); give more cores")
    out = []
    for s, rule, workers, batch, group in itertools.product(
            range(staleness_cap + 1), rules, range(1, most_workers + 1),
            _halves(cfg.rollout.batch_size, vary_batch, 1), _halves(cfg.rollout.group_size, vary_group, 2)):
        if s == 0 and rule != "lazy":
            continue  # synchronous: nothing to publish early, nothing in flight to keep
        for inflight in sorted({1, min(2, s + 1), s + 1}):
            out.append((f"async.max_staleness={s}", f"async.max_inflight={inflight}",
                        f"rollout.num_workers={workers}", f"rollout.batch_size={batch}",
                        f"rollout.group_size={group}", *RULES[rule]))
    return out


def priced(cfg: Any, base: Any) -> Any:
    """``cfg``'s plan timings scaled from ``base``'s measured ones by the samples they cover."""
    samples = cfg.rollout.batch_size * cfg.rollout.group_size
    base_samples = base.rollout.batch_size * base.rollout.group_size
    per_update = samples / cfg.train.updates_per_batch
    base_per_update = base_samples / base.train.updates_per_batch
    p = base.plan
    return replace(cfg, plan=replace(cfg.plan, gen_time=p.gen_time * samples / base_samples,
                                     env_time=p.env_time * samples / base_samples,
                                     train_time=p.train_time * per_update / base_per_update))


def _cost(c: Candidate) -> tuple:
    """What a candidate asks for, least first: engines, staleness allowed, slots, then the rule."""
    value = dict(o.split("=", 1) for o in c.overrides)
    rule = next(name for name, words in RULES.items() if set(words) <= set(c.overrides))
    return (int(value["rollout.num_workers"]), int(value["async.max_staleness"]),
            int(value["async.max_inflight"]), list(RULES).index(rule))


def _distinct(ranked: list[Candidate]) -> list[Candidate]:
    """One candidate per outcome (samples/s and mean staleness to 0.1%): the one asking least."""
    groups: dict[tuple, list[Candidate]] = {}
    for c in ranked:
        groups.setdefault((round(c.samples_per_s, 3), round(c.mean_staleness, 3)), []).append(c)
    return [replace(min(g, key=_cost), equivalent=len(g) - 1) for g in groups.values()]


def evaluate(cfg: Any, extra: Sequence[str], batches: int) -> Candidate:
    """``cfg`` (timings priced) run in virtual time for ``batches`` batches."""
    from tether.loop.virtual import plan_document, simulate, timings_of

    sm = plan_document(simulate(cfg.budget(), timings_of(cfg), num_groups=cfg.rollout.batch_size,
                                group_size=cfg.rollout.group_size))["summary"]
    samples = batches * cfg.rollout.batch_size * cfg.rollout.group_size
    return Candidate(tuple(extra), samples / sm["makespan_s"], sm["mean_staleness_batches"],
                     sm["max_staleness_batches"], sm["trainer_idle_fraction"], sm["generator_idle_fraction"])


def search(recipe: str | None, overrides: Sequence[str], *, cores: int, staleness_cap: int,
           vary_batch: bool = False, vary_group: bool = False, min_samples_per_s: float | None = None,
           tie: float = TIE, load: Callable[..., Any] | None = None
           ) -> tuple[Candidate, list[Candidate], Candidate]:
    """The best candidate, every distinct candidate ranked (best first: by samples/s, those within
    ``tie`` of the fastest first and by mean staleness among themselves; or, with
    ``min_samples_per_s``, by mean staleness among those that reach it, then samples/s), and the
    recipe as given, simulated the same way."""
    from tether.config import load_config

    if not 0.0 <= tie < 1.0:
        raise ConfigError(f"--tie {tie:g}: a fraction of the fastest throughput in [0, 1), e.g. 0.03; "
                          "0 ranks by samples/s alone")
    load = load or load_config
    base = load(recipe, list(overrides))
    if base.plan.gen_time <= 0 or base.plan.train_time <= 0:
        raise ConfigError("--optimize prices recipes from measured timings: set plan.gen_time (a run's "
                          "time/generate) and plan.train_time (its time/train / train.updates_per_batch)")
    batches = min(base.train.num_batches, 200)
    fixed = [f"train.num_batches={batches}", "eval.interval=0", "checkpoint.interval=0"]
    given = evaluate(load(recipe, [*overrides, *fixed]), ("(the recipe as given)",), batches)
    ranked = []
    for extra in candidates(base, cores=cores, staleness_cap=staleness_cap, vary_batch=vary_batch,
                            vary_group=vary_group):
        try:
            cfg = load(recipe, [*overrides, *extra, *fixed])
        except ConfigError:
            continue  # a combination the recipe's family, engine or backend refuses
        cfg = priced(cfg, base)
        if cfg.budget().mode.extra_work and cfg.family().plan_lengths(cfg)[0] <= 0:
            continue
        ranked.append(evaluate(cfg, extra, batches))
    if not ranked:
        raise ConfigError("no candidate recipe passed the recipe's checks; widen --cores or --staleness-cap")
    ranked = _distinct(ranked)
    if min_samples_per_s is None:
        ranked.sort(key=lambda c: (-c.samples_per_s, c.mean_staleness))
        floor = ranked[0].samples_per_s * (1.0 - tie)
        near = sorted((c for c in ranked if c.samples_per_s >= floor),
                      key=lambda c: (c.mean_staleness, _cost(c)))
        ranked = [*near, *(c for c in ranked if c.samples_per_s < floor)]
    else:
        ranked.sort(key=lambda c: (c.samples_per_s < min_samples_per_s, c.mean_staleness, -c.samples_per_s))
        if ranked[0].samples_per_s < min_samples_per_s:
            best = max(c.samples_per_s for c in ranked)
            raise ConfigError(f"no candidate reaches {min_samples_per_s:g} samples/s (the fastest: "
                              f"{best:.2f}); lower --min-samples-per-s, or allow more cores or staleness")
    return ranked[0], ranked, given
