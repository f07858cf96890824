"""The mutable half of the control plane: versions, staleness, admission, and the sync rule.

``train_version`` counts *committed* optimizer updates; ``rollout_version`` is the version last
published to the rollout engines. Their difference is ``publish_lag`` (weight-sync debt). A
batch's staleness is ``train_version − behavior_version`` when it starts training.

Launch rule (docs/architecture.md §2), evaluated each time the driver looks for a batch:

    no launch while publish_lag > staleness_budget
    freshness = (staleness_budget − publish_lag) // U + 1
    allowed   = min(freshness, total − trained, hard_boundary − trained)
    slots     = max(0, min(max_inflight − inflight, allowed − inflight − ready))

Every outstanding batch was launched against the current published version (a sync drains all
of them), and each batch consumed before it adds at most U updates, so the j-th outstanding batch
(j = 0, 1, …) trains at staleness ≤ publish_lag + j·U. ``freshness`` is the number of j that keep
this within the budget; the floor means a partially committed step never admits a generation
the budget cannot cover.

Without draining (``inflight_update`` keep, recompute, abort) a publication leaves generations
running, so outstanding batches were launched under different versions, and batches complete in
any order: one launched later may overtake an older one and train before it. A batch's
staleness is still measured from its *oldest* token, whose version is its launch version v_b
(tokens after a switch are newer). Worst case for a batch still generating: every other
outstanding batch trains first. With n batches outstanding after a launch (the new ones
included), the bound for a generating batch b is

    train_version − v_b + (n − 1)·U ≤ S·U,

tightest for the oldest launch version still generating, v_min. So the rule is the one above
with ``lag = train_version − min(rollout_version, v_min)`` in place of ``publish_lag``: it keeps
the bound for every batch already generating (its count of batches ahead never exceeds n − 1) and
for the new ones (launched at the published version, ≥ v_min). Batches already complete sit in
the FIFO in training order and nothing launched later can overtake them. When every generation
was launched at the published version — always, when syncs drain — it is the rule above.
"""

from __future__ import annotations

from dataclasses import dataclass

from tether.control.budget import BudgetSettings
from tether.errors import ControlError, StaleBatchError


@dataclass(frozen=True)
class Staleness:
    """How old a batch's behavior policy is when the batch starts training."""

    updates: int
    batches: float
    within_budget: bool


@dataclass(frozen=True)
class SyncDecision:
    """Why weights must be published after a step (empty reasons = no sync)."""

    reasons: tuple[str, ...]

    @property
    def due(self) -> bool:
        return bool(self.reasons)


class AsyncControl:
    """Versions plus the budget rules. Pure Python; the driver loop is its only writer."""

    def __init__(self, settings: BudgetSettings, *, train_version: int = 0) -> None:
        self.settings = settings
        self._train_version = 0
        self._rollout_version = 0
        self.publish_required = False
        if train_version:
            self.restore(train_version)

    # -- versions -----------------------------------------------------------------------------

    @property
    def train_version(self) -> int:
        return self._train_version

    @property
    def rollout_version(self) -> int:
        return self._rollout_version

    @property
    def publish_lag(self) -> int:
        return self._train_version - self._rollout_version

    def commit(self, updates: int) -> None:
        """Advance the clock by the updates a step actually committed (0 ≤ updates ≤ U)."""
        u = self.settings.updates_per_batch
        if isinstance(updates, bool) or not isinstance(updates, int) or not 0 <= updates <= u:
            raise ControlError(f"a step commits between 0 and U={u} updates, got {updates!r}")
        self._train_version += updates

    def mark_published(self, version: int | None = None) -> int:
        """Record that the engines now hold ``version`` (default: the current train version)."""
        version = self._train_version if version is None else version
        if version > self._train_version:
            raise ControlError(
                f"published version {version} is ahead of train version {self._train_version}"
            )
        if version < self._rollout_version:
            raise ControlError(
                f"published version would go backwards: {self._rollout_version} -> {version}"
            )
        self._rollout_version = version
        self.publish_required = False
        return version

    def restore(self, train_version: int, rollout_version: int | None = None) -> None:
        """Resume: the train version comes from the restored optimizer state.

        ``rollout_version`` is the version the engines held when the checkpoint was written, when
        the resume gives the engines those very weights again (the run then continues exactly as
        it would have). Without it the engines' version is unknown: it is reset to 0 and a
        publish is forced before anything is launched.
        """
        for name, v in (("train", train_version), ("rollout", rollout_version)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ControlError(f"restored {name} version must be an integer >= 0, got {v!r}")
        if rollout_version is not None and rollout_version > train_version:
            raise ControlError(f"restored rollout version {rollout_version} is ahead of the train "
                               f"version {train_version}")
        self._train_version = train_version
        if rollout_version is None:
            self._rollout_version = 0
            self.publish_required = train_version > 0
        else:
            self._rollout_version = rollout_version
            self.publish_required = False

    # -- staleness ----------------------------------------------------------------------------

    def staleness(self, behavior_version: int) -> Staleness:
        """Staleness of a batch generated under ``behavior_version``, were it to train now."""
        if behavior_version > self._train_version:
            raise ControlError(
                f"batch behavior version {behavior_version} is in the future "
                f"(train version {self._train_version})"
            )
        if behavior_version < 0:
            raise ControlError(f"batch behavior version must be >= 0, got {behavior_version}")
        updates = self._train_version - behavior_version
        return Staleness(
            updates=updates,
            batches=updates / self.settings.updates_per_batch,
            within_budget=updates <= self.settings.staleness_budget,
        )

    def check_consumable(self, behavior_version: int, batch_index: int) -> Staleness:
        """Staleness of the batch at the head of the queue; fail closed above budget.

        With ``on_stale=drop`` the verdict is returned and the caller drops and counts the batch.
        """
        s = self.staleness(behavior_version)
        if not s.within_budget and self.settings.on_stale == "error":
            raise StaleBatchError(
                f"rollout batch {batch_index} is {s.updates} updates stale "
                f"(behavior version {behavior_version}, train version {self._train_version}), "
                f"above the budget of {self.settings.staleness_budget} updates "
                f"(async.max_staleness={self.settings.max_staleness} × "
                f"train.updates_per_batch={self.settings.updates_per_batch}). Admission should "
                "never let this happen; set async.on_stale=drop to drop such batches instead."
            )
        return s

    # -- admission ----------------------------------------------------------------------------

    def freshness(self, oldest_generating: int | None = None) -> int:
        """Batches that may be outstanding, given the oldest launch version of the generations
        still running (``oldest_generating``; None when none is). It sets the bound where the mode
        says so (``InflightMode.bounds_by_oldest``); where syncs drain, every generation running
        was launched at the published version, and the bound is the publish lag."""
        budget = self.settings.staleness_budget
        lag = self.publish_lag
        if oldest_generating is not None:
            if oldest_generating > self._rollout_version:
                raise ControlError(f"a generation launched at version {oldest_generating} is ahead of "
                                   f"the published version {self._rollout_version}")
            if self.settings.mode.bounds_by_oldest:
                lag = self._train_version - oldest_generating
        if self.publish_required or lag > budget:
            return 0
        return (budget - lag) // self.settings.updates_per_batch + 1

    def launch_slots(self, *, inflight: int, ready: int, trained_batches: int,
                     oldest_generating: int | None = None) -> int:
        """How many generations to launch now (docs/architecture.md §2 rule 2; ``oldest_generating``: see
        ``freshness``)."""
        s = self.settings
        boundary = s.next_hard_boundary(trained_batches)
        allowed = min(self.freshness(oldest_generating), s.total_batches - trained_batches,
                      boundary - trained_batches)
        return max(0, min(s.max_inflight - inflight, allowed - inflight - ready))

    # -- sync rule ----------------------------------------------------------------------------

    def idle_sync_due(self, step: int, *, engines_idle: bool) -> bool:
        """With ``sync_when_idle``, after ``step`` trained batches: no generation is in flight and
        the trainer has weights the engines lack. Asked at a step's end and again whenever the
        loop is about to launch (a rollout-bound run's engine finishing while the trainer waits)."""
        s = self.settings
        return s.sync_when_idle and engines_idle and self.publish_lag > 0 and step < s.total_batches

    def sync_decision(self, step: int, *, engines_idle: bool = False) -> SyncDecision:
        """After ``step`` trained batches: publish for an eval, a save, or an exhausted budget;
        with ``sync_when_idle``, also whenever the engines are idle and the trainer is ahead
        (reason ``idle``: nothing to drain, so publishing costs only the copy); without draining,
        whenever the trainer is ahead (reason ``eager``).

        An idle sync is safe for the budget: admission bounds each launch by the batches then
        outstanding, whatever version they were launched under, so batches still queued from an
        older snapshot keep their own bound (docs/architecture.md §2, rule 2)."""
        s = self.settings
        reasons = []
        if s.eval_due(step):
            reasons.append("eval")
        if s.save_due(step):
            reasons.append("save")
        if step < s.total_batches and self.publish_lag > s.staleness_budget:
            reasons.append("budget")
        if not reasons and self.idle_sync_due(step, engines_idle=engines_idle):
            reasons.append("idle")
        if not reasons and not s.drains and self.publish_lag > 0 and step < s.total_batches:
            reasons.append("eager")  # publishing waits for nothing: keep the engines current
        return SyncDecision(tuple(reasons))
