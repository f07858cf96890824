"""Mean staleness in closed form, beside ``tether plan``'s simulation.

Two closed forms, for two ways of publishing:

**Tether's lazy schedule** (``async.inflight_update=drain`` without ``async.sync_when_idle``):
weights are published only when the budget is spent or an eval or checkpoint is due, and every
publication drains what is in flight. Every batch of a sync period is then launched under the
period's version, and the j-th batch of the period trains after the j batches before it committed
their updates. Its staleness is those updates, whatever the timings: the form is exact, a function
of the schedule (S, U, the intervals, the commits) alone.

**Applied Compute's queueing forms** (2026-07-03, "Predicting and Controlling Staleness in Fully
Asynchronous RL Training", as summarised publicly; docs/concepts.md) describe engines that take up
every update (Tether: ``sync_when_idle``, or an in-flight mode other than ``drain``). Five
parameters: ρ, rollout throughput over training throughput; B, the batch in samples; C, the samples
generating at once; q, the ready queue's capacity over B; M_tail, E[longest of a group] / E[length].

    rollout-bound (ρ < 1):  C·M_tail/B + ρ
    train-bound  (ρ ≥ 1):  C·M_tail/(ρB) + (2q + ρ − 1)/(2ρ)

in versions (one per batch, as Tether's ``staleness/batches``). ``QueueModel`` measures the five
from a recipe's timings (``plan.*``) and caps the forms at the budget S, which they do not know.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tether.control.budget import BudgetSettings


def lazy_staleness_updates(settings: BudgetSettings, commits: tuple[int, ...] = ()) -> list[int]:
    """Each batch's staleness in updates under the lazy rule: the updates committed since the last
    publication when it trains (``commits`` cycled, else U every step). Publication after a step
    follows ``ControlPlane.sync_decision``: an eval or a save due, or the publish lag past the
    budget with batches left."""
    s = settings
    out, lag = [], 0
    for step in range(1, s.total_batches + 1):
        out.append(lag)
        lag += commits[(step - 1) % len(commits)] if commits else s.updates_per_batch
        if s.eval_due(step) or s.save_due(step) or (step < s.total_batches and lag > s.staleness_budget):
            lag = 0
    return out


def lazy_mean_staleness_batches(settings: BudgetSettings, commits: tuple[int, ...] = ()) -> float:
    """The mean of ``lazy_staleness_updates`` in batches: (P − 1)/2 for a regular period of P
    batches with full commits (S/2 without intervals), over whole periods."""
    per = lazy_staleness_updates(settings, commits)
    return sum(per) / len(per) / settings.updates_per_batch


def tail_multiplier(mean_length: float, max_length: int, group_size: int) -> float:
    """M_tail = E[the longest of a group's lengths] / E[a length], for lengths as the planner draws
    them (geometric with mean ``mean_length``, capped at ``max_length``); 1 without a length model
    (``plan.gen_time`` is then a whole batch's time, its tail included)."""
    if mean_length <= 0 or group_size <= 1:
        return 1.0
    from tether.loop.sequences import Lengths

    # a mean at or past the cap makes every length the cap
    return Lengths(mean_length, max_length, group_size).expected_longest() / min(mean_length, max_length)


@dataclass(frozen=True)
class QueueModel:
    """Applied Compute's five parameters, measured from a recipe, and its forms."""

    rho: float
    batch: int
    """B: samples per rollout batch (prompts × group size)."""
    concurrency: float
    """C: samples generating at once (min(workers, max_inflight, S + 1) batches of B)."""
    queue: float
    """q: the ready queue's capacity over B (what admission lets wait beside the batches generating)."""
    tail: float
    """M_tail."""
    budget: int
    """S, in batches: no batch trains staler (the forms do not know it)."""

    @property
    def regime(self) -> str:
        return "rollout-bound" if self.rho < 1 else "train-bound"

    @property
    def uncapped(self) -> float:
        """The form of the regime, in versions (batches)."""
        c, b, q, m, r = self.concurrency, self.batch, self.queue, self.tail, self.rho
        if r < 1:
            return c * m / b + r
        return c * m / (r * b) + (2 * q + r - 1) / (2 * r)

    @property
    def mean_staleness(self) -> float:
        return min(self.uncapped, float(self.budget))

    def as_dict(self) -> dict[str, Any]:
        return {"rho": self.rho, "B": self.batch, "C": self.concurrency, "q": self.queue, "M_tail": self.tail,
                "regime": self.regime, "uncapped_batches": self.uncapped,
                "mean_staleness_batches": self.mean_staleness}


def queue_model(cfg: Any, *, gen_time: float, train_time: float, sync_time: float) -> QueueModel:
    """The five parameters of a recipe with a batch's generation time (environment included),
    an update's training time and a publication's time: engines and the trainer each at their
    rate, the trainer's per batch U updates plus its share of publications (one per step when
    engines take every update, one per sync period otherwise)."""
    s = cfg.budget()
    b = cfg.rollout.batch_size * cfg.rollout.group_size
    generating = min(cfg.rollout.num_workers, s.max_inflight, s.admission_depth)
    lazy = s.drains and not s.sync_when_idle
    per_batch = s.updates_per_batch * train_time + sync_time / (s.sync_gaps[0] if lazy else 1)
    rollout_rate = generating * b / gen_time if gen_time > 0 else float("inf")
    train_rate = b / per_batch if per_batch > 0 else float("inf")
    rho = rollout_rate / train_rate if train_rate != float("inf") else 0.0
    tail = tail_multiplier(cfg.plan.mean_length, cfg.rollout.max_new_tokens, cfg.rollout.group_size)
    return QueueModel(rho=rho, batch=b, concurrency=float(generating * b),
                      queue=float(max(0, s.admission_depth - generating)), tail=tail, budget=s.max_staleness)


def closed_forms(cfg: Any, *, gen_time: float, train_time: float, sync_time: float,
                 num_batches: int | None = None) -> dict[str, Any]:
    """Tether's closed form for a recipe's publication rule, and Applied Compute's forms with their
    five parameters, from a batch's generation time, an update's training time and a publication's
    time (``num_batches``: over that many batches instead of ``train.num_batches``).

    Tether's form, by rule:

    - ``lazy`` (drain, no idle syncs): ``lazy_mean_staleness_batches``, exact;
    - ``idle`` (drain with ``async.sync_when_idle``): with one generation at a time
      (``async.max_inflight`` 1, or S ≤ 1), min(1, S) in either regime: rollout-bound, the
      engines are idle each time the batch the trainer waits for completes, and an idle sync
      fires then; train-bound, the loop launches one batch a step, so the queue never fills.
      Otherwise, train-bound, the ready queue stays full to the budget, so S; rollout-bound,
      the engines are idle only when every generation in flight has finished, which depends on
      the timings, and the form (the lazy one) is withheld;
    - ``eager`` (an in-flight mode other than drain: a publication after every step):
      rollout-bound, Applied Compute's rollout-bound form (engines current, a batch as old as the
      batches trained while it generated, plus ρ), capped at S; train-bound, S, or min(1, S)
      with one generation at a time.
    """
    s = cfg.budget()
    if num_batches is not None:
        from dataclasses import replace

        s = replace(s, total_batches=num_batches)
    model = queue_model(cfg, gen_time=gen_time, train_time=train_time, sync_time=sync_time)
    lazy = lazy_mean_staleness_batches(s, tuple(cfg.plan.commits))
    if s.drains and not s.sync_when_idle:
        rule, value = "lazy", lazy
    elif s.drains:
        rule = "idle"
        if one_at_a_time(s):
            value = float(min(1, s.max_staleness))
        else:
            value = float(s.max_staleness) if model.rho >= 1 else lazy
    else:
        rule = "eager"
        if model.rho >= 1:
            value = float(min(1, s.max_staleness)) if one_at_a_time(s) else float(s.max_staleness)
        else:
            value = min(float(s.max_staleness), model.concurrency * model.tail / model.batch + model.rho)
    return {"rule": rule, "mean_staleness_batches": value, "exact": rule == "lazy",
            "applied_compute": model.as_dict(), "withheld": withheld(model, rule, s)}


def one_at_a_time(s: BudgetSettings) -> bool:
    """One generation in flight at a time (``async.max_inflight`` 1), or a budget of one batch or
    none, which admits no second beside the batch the trainer waits for: a rollout-bound run's
    engines are then idle each time a batch completes (idle syncs fire there), and a train-bound
    run launches a batch a step."""
    return s.max_inflight == 1 or s.max_staleness <= 1


BALANCE = (0.8, 1.5)
"""ρ in [0.8, 1.5): how the ready queue fills there is in neither the approximate forms nor Applied
Compute's (errors up to 5 batches on simulated recipes, benchmarks/closed_form.py)."""


def withheld(model: QueueModel, rule: str, settings: BudgetSettings) -> dict[str, str | None]:
    """Why each form's number would be wrong for this recipe, naming what puts it outside the form's
    assumptions; None where the form holds. The numbers stay in the document (the benchmark
    measures their errors); ``tether plan`` and ``tether report`` print the reason instead."""
    rho = model.rho
    idle_lazy = rule == "idle" and rho < 1 and not one_at_a_time(settings)
    timings = None
    if not 0 < rho < float("inf"):
        timings = (f"rho = {rho:g}: the forms need a positive, finite generation time and training time "
                   "(plan.gen_time, plan.train_time, or a run's measured time/generate and time/train)")
    near = (f"rho = {rho:.2f} is near balance ({BALANCE[0]} <= rho < {BALANCE[1]}), where how the ready "
            "queue fills is not in the form (errors up to 5 batches); the simulation holds")
    balanced = BALANCE[0] <= rho < BALANCE[1]
    several = (f"rollout-bound with async.max_inflight = {settings.max_inflight} and async.max_staleness = "
               f"{settings.max_staleness}: an idle sync fires only when every generation in flight has "
               "finished, which depends on the timings; the simulation holds (async.max_inflight=1 "
               "publishes at every batch's completion)")
    tether = None if rule == "lazy" else (timings or (near if balanced else None)
                                          or (several if idle_lazy else None))
    if timings:
        ac = timings
    elif balanced and rule != "lazy":
        ac = near
    elif idle_lazy:
        ac = several
    elif rule == "lazy":
        ac = ("the forms model engines that take up every update; this recipe publishes lazily (async."
              "inflight_update: drain without async.sync_when_idle), so a batch's staleness is its place "
              "in the sync period, which Tether's form gives")
    elif rule == "idle" and rho < 1:
        ac = ("one generation at a time, idle syncs publish as each batch completes, so every batch "
              "trains one batch stale; the forms add rho for engines that take up updates while generating")
    elif rho >= BALANCE[1] and one_at_a_time(settings):
        ac = (f"train-bound (rho = {rho:.2f}) with one generation at a time: the loop launches a batch a "
              "step, so each trains one batch stale, which the form does not know")
    elif rho >= BALANCE[1]:
        ac = (f"train-bound (rho = {rho:.2f}): Tether's admission keeps the ready queue full to the budget "
              f"(async.max_staleness = {model.budget}), so batches train at about S, which the form "
              "does not know")
    else:
        ac = None
    return {"tether": tether, "applied_compute": ac}
