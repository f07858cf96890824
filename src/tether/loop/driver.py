"""The driver loop (docs/architecture.md §2): reap → launch → consume → train → sync → eval/save.

Single-threaded; the pool's workers run concurrently with it. The same loop runs for real, in
virtual time (``tether plan``) and in tests, against the ``RolloutPool`` and ``Learner`` seams.

Waiting: when nothing is ready the loop blocks until the *next* in-flight batch completes, not
specifically the oldest. When syncs drain, every outstanding batch was launched against the same
published version, so the order of consumption cannot change any batch's staleness bound; when
they do not (``async.inflight_update``), admission assumes the worst order for every batch still
generating (tether.control.control). Either way taking whichever finishes first keeps the trainer
from idling behind a slow one.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tether.control import AdmissionNote, AsyncControl, Staleness, admission_notes
from tether.errors import AdmissionStallError, ControlError, StopRequested
from tether.loop.observe import BatchRecord, LoopEvent, LoopObserver
from tether.vocabulary import (
    BoundaryHooks,
    GenerationRequest,
    Learner,
    LoopState,
    RolloutBatch,
    RolloutPool,
)

log = logging.getLogger("tether.loop")


@dataclass
class StepTimes:
    """Seconds one step spent in each phase (``time/*`` metrics)."""

    start: float
    generate_wait: float = 0.0
    train: float = 0.0
    sync: float = 0.0
    eval: float = 0.0
    sync_metrics: Mapping[str, float] | None = None
    """What the pool reported for this step's publication (``sync/*``), if there was one."""


class NoHooks:
    """Boundary hooks that do nothing (eval returns no metrics)."""

    def evaluate(self, step: int, version: int) -> Mapping[str, float]:
        return {}

    def save(self, step: int, state: LoopState) -> None:
        return None


class Driver:
    """Runs one training run's batches through the control rules."""

    def __init__(
        self,
        control: AsyncControl,
        pool: RolloutPool,
        learner: Learner,
        *,
        hooks: BoundaryHooks | None = None,
        observer: LoopObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        wait_timeout_s: float | None = None,
        notes: Sequence[AdmissionNote] | None = None,
    ) -> None:
        self.control = control
        self.settings = control.settings
        self.pool = pool
        self.learner = learner
        self.hooks = hooks or NoHooks()
        self.observer = observer or LoopObserver()
        self.clock = clock
        self.wait_timeout_s = wait_timeout_s  # for each batch awaited, at a sync's drain too
        self.notes = admission_notes(control.settings) if notes is None else list(notes)
        self.ready: deque[RolloutBatch] = deque()
        self.trained = 0
        self.launched = 0
        self.dropped = 0
        self.consecutive_drops = 0
        self.outstanding: set[int] = set()  # launched, not yet trained (to completion) or dropped
        self.pending: list[int] = []  # abandoned, or lost with a worker; relaunched before fresh indices
        self.worker_restarts = 0  # rollout workers the pool replaced (rollout/worker_restarts)
        self.stop_requested: str | None = None  # the stop signal's name, once one arrived
        self.in_critical = False  # inside train / publish / evaluate / save
        self.interrupted_in_critical = False  # then the learner may be mid-update: never save it
        self.last_publication: int | None = 0  # the step weights were last published after (None: unknown)
        # where each batch's staleness accrued: the train version when it was launched and when
        # it completed (from the commit history and the pool's completion time, else at reaping)
        self._launch_version: dict[int, int] = {}
        self._generating: dict[int, int] = {}  # launch index → published version it was launched at
        self._complete_version: dict[int, int] = {}
        self._commits: list[tuple[float, int]] = []  # (when, train version after that commit)
        self._start_version = 0

    # -- the loop -----------------------------------------------------------------------------

    def run(self, resume: LoopState | None = None) -> LoopState:
        """Train until ``settings.total_batches`` batches have trained; return the final state."""
        self._begin(resume)
        try:
            while self.trained < self.settings.total_batches:
                times = StepTimes(start=self.clock())
                batch, staleness = self._next_batch(times)
                self._critical(self._step, batch, staleness, times)
                if self.stop_requested:
                    raise StopRequested(self.stop_requested)
        except KeyboardInterrupt:
            self._interrupted()
            raise
        except BaseException as primary:
            self._teardown(primary)
            raise
        self._teardown(None)
        return self.state()

    def request_stop(self, signal_name: str = "SIGINT") -> bool:
        """Ask the loop to stop at the next safe point (SIGINT, SIGTERM). True when it is safe to
        raise ``StopRequested`` right now (the loop is only waiting), False when the loop will
        stop by itself after the step in progress."""
        self.stop_requested = signal_name
        return not self.in_critical

    def _critical(self, fn, *args):
        self.in_critical = True
        try:
            return fn(*args)
        except KeyboardInterrupt:
            self.interrupted_in_critical = True
            raise
        finally:
            self.in_critical = False

    def state(self) -> LoopState:
        return LoopState(
            trained_batches=self.trained,
            launched_batches=self.launched,
            dropped_batches=self.dropped,
            train_version=self.control.train_version,
            pending=tuple(sorted([*self.pending, *self.outstanding])),
            rollout_version=self.control.rollout_version,
        )

    # -- steps --------------------------------------------------------------------------------

    def _begin(self, resume: LoopState | None) -> None:
        """Notes once; on resume, restore counters and publish first; baseline eval when fresh."""
        for note in self.notes:
            log.debug("admission note %s", note)
            self.observer.on_note(note.code, note.message)
        if resume is not None:
            if resume.trained_batches >= self.settings.total_batches:
                raise ControlError(
                    f"nothing to resume: {resume.trained_batches} batches already trained "
                    f"of train.num_batches={self.settings.total_batches}"
                )
            self.trained = resume.trained_batches
            self.launched = resume.launched_batches
            self.dropped = resume.dropped_batches
            self.pending = sorted(resume.pending)
            self.control.restore(resume.train_version, resume.rollout_version)
            self._start_version = resume.train_version
            self.last_publication = None  # not recorded in a checkpoint: no gap for the first sync
        if self.control.publish_required:
            self._publish(("resume",))
            self.last_publication = self.trained
        if self.trained == 0 and self.settings.eval_interval > 0:
            self._evaluate(0)

    def _next_batch(self, times: StepTimes) -> tuple[RolloutBatch, Staleness]:
        """Reap, launch, and take the head of the ready FIFO (waiting for a completion if empty)."""
        while True:
            self._reap(self.pool.reap())
            self._sync_if_idle(times)
            self._launch()
            if not self.ready:
                if self.pool.inflight == 0:
                    raise AdmissionStallError(
                        "nothing is in flight or ready and the staleness budget admits no new "
                        f"generation (train_version={self.control.train_version}, "
                        f"rollout_version={self.control.rollout_version}, trained={self.trained}); "
                        "this is a bug in the control plane, please report it"
                    )
                t0 = self.clock()
                self._reap(self.pool.wait(self.wait_timeout_s))
                times.generate_wait += self.clock() - t0
                continue
            batch = self.ready.popleft()
            staleness = self.control.check_consumable(batch.behavior_version, batch.index)
            if staleness.within_budget:
                self._emit("consume", batch=batch.index, version=batch.behavior_version,
                           detail={"staleness_updates": staleness.updates})
                self.consecutive_drops = 0
                return batch, staleness
            self._drop(batch, staleness)

    def _step(self, batch: RolloutBatch, staleness: Staleness, times: StepTimes) -> None:
        """Train, sync and evaluate if due, report, save if due: one unit that a first stop
        signal never splits. The row is written before the checkpoint, so a checkpoint never
        counts a batch whose metrics row is missing, even when the process is killed between."""
        train_metrics = self._train(batch, times)
        self._boundaries(times)
        self._report(batch, staleness, train_metrics, times)
        if self.settings.save_due(self.trained):
            self._save()

    def _train(self, batch: RolloutBatch, times: StepTimes) -> Mapping[str, float]:
        t0 = self.clock()
        result = self.learner.train(batch, train_version=self.control.train_version)
        self.control.commit(result.committed_updates)
        self.trained += 1
        self.outstanding.discard(batch.index)
        t1 = self.clock()
        if result.committed_updates:
            self._commits.append((t1, self.control.train_version))
        self._emit("train", t=t0, end=t1, batch=batch.index, version=self.control.train_version,
                   detail={"committed": result.committed_updates, "attempted": result.attempted_updates})
        metrics = dict(result.metrics)
        metrics["async/optimizer_updates"] = result.committed_updates
        times.train = t1 - t0
        return metrics

    def _boundaries(self, times: StepTimes) -> None:
        """Sync if due (a save is a reason too), then evaluate if due."""
        step = self.trained
        if self.settings.sync_when_idle:
            self._reap(self.pool.reap())  # a finished generation still counts as in flight until reaped
        decision = self.control.sync_decision(step, engines_idle=self.pool.inflight == 0)
        if decision.due:
            self._timed_publish(decision.reasons, times)
        if self.settings.eval_due(step):
            times.eval = self._evaluate(step)

    def _sync_if_idle(self, times: StepTimes) -> None:
        """An idle sync before launching (``sync_when_idle``): when generation is the slower side,
        the engines are busy at every step's end, and the one moment they are idle is when the
        batch the trainer waits for completes. Publishing then lets the next generation start at
        once under the newest weights, overlapping the training of the batch just taken, instead
        of waiting a training step for the budget's publication."""
        if self.settings.sync_when_idle and self.control.idle_sync_due(
                self.trained, engines_idle=self.pool.inflight == 0):
            self._critical(self._timed_publish, ("idle",), times)
            if self.stop_requested:  # a stop that arrived during the publication: nothing is half done
                raise StopRequested(self.stop_requested)

    def _timed_publish(self, reasons: tuple[str, ...], times: StepTimes) -> None:
        seconds, metrics = self._publish(reasons)
        times.sync += seconds
        times.sync_metrics = metrics or times.sync_metrics

    def _save(self) -> None:
        """Checkpoint after the step's row is written; its duration is the ``save`` event's."""
        t0 = self.clock()
        self.hooks.save(self.trained, self.state())
        self._emit("save", t=t0, end=self.clock(), version=self.control.train_version,
                   detail={"step": self.trained})

    # -- pieces -------------------------------------------------------------------------------

    def _reap(self, batches: list[RolloutBatch]) -> None:
        self._relaunch_lost()
        for batch in batches:
            self._generating.pop(batch.index, None)
            self.ready.append(batch)
            self._complete_version[batch.index] = self._version_at(batch.completed_at)
            detail = {} if batch.completed_at is None else {"completed_at": batch.completed_at,
                                                             "work_s": batch.work_s}
            self._emit("ready", batch=batch.index, version=batch.behavior_version, detail=detail)

    def _relaunch_lost(self) -> None:
        """A batch whose worker died (the pool replaced it) goes back to ``pending``: it is launched
        again as a new request at the version published then, so admission counts it and its
        staleness follows the rules like any launch's; nothing is dropped or trained twice."""
        for loss in self.pool.lost():
            self.worker_restarts = loss.restarts
            index = loss.batch_index
            if index is not None:
                self._generating.pop(index, None)
                self._launch_version.pop(index, None)
                self.outstanding.discard(index)
                bisect.insort(self.pending, index)
            self._emit("worker_lost", batch=index,
                       detail={"worker": loss.worker, "cause": loss.cause, "restarts": loss.restarts})

    def _launch(self) -> None:
        slots = self.control.launch_slots(
            inflight=self.pool.inflight, ready=len(self.ready), trained_batches=self.trained,
            oldest_generating=min(self._generating.values(), default=None),
        )
        for _ in range(slots):
            if self.pending:
                index = self.pending.pop(0)
            else:
                index, self.launched = self.launched, self.launched + 1
            request = GenerationRequest(index=index, version=self.control.rollout_version)
            self._launch_version[index] = self.control.train_version
            self._generating[index] = request.version
            self.pool.launch(request)
            self.outstanding.add(index)
            self._emit("launch", batch=request.index, version=request.version)

    def _drop(self, batch: RolloutBatch, staleness: Staleness) -> None:
        self.outstanding.discard(batch.index)
        self.dropped += 1
        self.consecutive_drops += 1
        log.warning(
            "dropped rollout batch %d: %d updates stale, budget %d (async.on_stale=drop); "
            "%d dropped so far",
            batch.index, staleness.updates, self.settings.staleness_budget, self.dropped,
        )
        length = batch.metrics.get("response/length_mean")  # what `tether report` weighs against
        self._emit("drop", batch=batch.index, version=batch.behavior_version,
                   detail={"staleness_updates": staleness.updates,
                           "samples": batch.num_groups * batch.group_size,
                           **({} if length is None else {"length_mean": float(length)})})
        limit = self.settings.max_consecutive_drops
        if self.consecutive_drops >= limit:
            raise ControlError(
                f"{self.consecutive_drops} rollout batches in a row were above the staleness "
                f"budget and dropped (async.max_consecutive_drops={limit}); the engines seem to "
                "generate with weights older than the version they were launched with. Check the "
                "weight sync, or raise async.max_consecutive_drops if the drops are expected."
            )

    def _publish(self, reasons: tuple[str, ...]) -> tuple[float, Mapping[str, float] | None]:
        """Quiesce, check nothing was outstanding, publish if there is anything new. Without
        draining (``async.inflight_update``), a publication that is not for a boundary leaves the
        generations running and the queue as it is.

        Returns the seconds it took and the pool's publication metrics (None if nothing new).
        """
        t0 = self.clock()
        outstanding = self.pool.inflight + len(self.ready)
        drain = self.settings.drains or bool({"eval", "save", "resume"} & set(reasons))
        if drain:
            self._reap(self.pool.quiesce(self.wait_timeout_s))
        if drain and self.ready and reasons != ("idle",):  # an idle sync may leave older batches queued
            raise ControlError(
                f"{len(self.ready)} rollout batch(es) outstanding at a weight sync after "
                f"{self.trained} batches (reasons: {', '.join(reasons)}); admission must leave "
                "the queue empty at every sync"
            )
        sync_metrics = None
        if self.control.publish_lag > 0 or self.control.publish_required:
            sync_metrics = self.pool.publish(self.learner.export_weights(), self.control.train_version)
            self.control.mark_published()
        published = sync_metrics is not None
        t1 = self.clock()
        self._emit("sync", t=t0, end=t1, version=self.control.rollout_version,
                   detail={"step": self.trained, "reasons": reasons, "published": published,
                           "outstanding": outstanding, "drained": drain})
        return t1 - t0, sync_metrics

    def _evaluate(self, step: int) -> float:
        t0 = self.clock()
        metrics = self.hooks.evaluate(step, self.control.rollout_version)
        t1 = self.clock()
        self._emit("eval", t=t0, end=t1, version=self.control.rollout_version, detail={"step": step})
        self.observer.on_eval(step, metrics)
        return t1 - t0

    def _report(self, batch: RolloutBatch, staleness: Staleness, train_metrics: Mapping[str, float],
                times: StepTimes) -> None:
        step_s = self.clock() - times.start
        c = self.control
        metrics: dict[str, float] = {**batch.metrics, **train_metrics}
        metrics.update({
            "async/train_version": c.train_version,
            "async/rollout_version": c.rollout_version,
            "async/publish_lag": c.publish_lag,
            "async/behavior_version": batch.behavior_version,
            # the period of a regular schedule; NaN when eval/save intervals make it irregular
            "async/sync_period_batches": (math.nan if self.settings.sync_period_batches is None
                                          else self.settings.sync_period_batches),
            "async/dropped_batches": self.dropped,
            "rollout/worker_restarts": self.worker_restarts,
            "async/inflight": self.pool.inflight,
            "async/ready": len(self.ready),
            "staleness/updates": staleness.updates,
            "staleness/batches": staleness.batches,
            "time/generate_wait": times.generate_wait,
            "time/train": times.train,
            "time/sync": times.sync,
            "time/eval": times.eval,
            "time/step": step_s,
            "throughput/samples_per_s": batch.num_samples / step_s if step_s > 0 else 0.0,
        })
        if times.sync_metrics:
            metrics.update(times.sync_metrics)
            if self.last_publication is not None:
                metrics["async/sync_gap_batches"] = self.trained - self.last_publication
            self.last_publication = self.trained
        if batch.newest_version is not None:
            metrics["staleness/span_updates"] = batch.newest_version - batch.behavior_version
        if batch.version_shares:  # per token: the batch's own staleness is its oldest token's
            consumed = batch.behavior_version + staleness.updates
            metrics["staleness/token_mean_updates"] = sum(
                share * (consumed - version) for version, share in batch.version_shares.items())
            metrics["staleness/token_min_updates"] = consumed - max(batch.version_shares)
            for version, share in batch.version_shares.items():  # a histogram: the share k updates old
                key = f"staleness/token_share_{consumed - version}"
                metrics[key] = metrics.get(key, 0.0) + share
        metrics.update(self._accrual(batch, staleness))
        self.observer.on_batch(BatchRecord(
            step=self.trained, batch_index=batch.index, behavior_version=batch.behavior_version,
            staleness_updates=staleness.updates, staleness_batches=staleness.batches,
            metrics=metrics, payload=batch.payload,
        ))

    def _version_at(self, when: float | None) -> int:
        """The train version at time ``when`` (now, if the pool gave no completion time)."""
        if when is None:
            return self.control.train_version
        at = bisect.bisect_right(self._commits, (when, float("inf")))
        return self._commits[at - 1][1] if at else self._start_version

    def _accrual(self, batch: RolloutBatch, staleness: Staleness) -> dict[str, float]:
        """Where a batch's staleness accrued, in updates (the three add up to
        ``staleness/updates``): the engines' publish lag when it was launched, the updates
        committed while it was generated (launch → complete), and while it waited to be trained
        (complete → consumed)."""
        # without draining a batch queued behind others may start after a publication: its oldest
        # token is then newer than the train version at its launch, and its staleness starts there
        launched = max(batch.behavior_version, self._launch_version.pop(batch.index, batch.behavior_version))
        completed = max(launched, self._complete_version.pop(batch.index, launched))
        consumed = batch.behavior_version + staleness.updates
        return {"staleness/at_launch_updates": launched - batch.behavior_version,
                "staleness/generating_updates": completed - launched,
                "staleness/queued_updates": consumed - completed}

    def _interrupted(self) -> None:
        """A stop signal: abandon in-flight work (the pool's close stops it) and, when checkpoints
        are on and the learner is between steps, save a final checkpoint whose ``pending`` lists
        the abandoned batches so a resume generates them again, under the version the engines
        held (``rollout_version``), as the uninterrupted run would have."""
        abandoned = sorted(self.outstanding)
        self._emit("abandon", detail={"batches": abandoned})
        self.ready.clear()
        if self.settings.save_interval > 0 and not self.interrupted_in_critical and self.trained > 0:
            log.warning("interrupted after %d batches; saving a final checkpoint (%d batch(es) "
                        "abandoned, to be generated again on resume)", self.trained, len(abandoned))
            try:
                self.hooks.save(self.trained, self.state())
            except KeyboardInterrupt:
                log.warning("the final checkpoint was abandoned by a second stop signal (nothing "
                            "partial is left; the newest complete checkpoint is unchanged)")
            except Exception as exc:
                log.error("the final checkpoint could not be written: %s", exc)
            else:
                self._emit("save", version=self.control.train_version,
                           detail={"step": self.trained, "final": True})
        elif abandoned:
            log.warning("interrupted after %d batches; %d in-flight batch(es) abandoned",
                        self.trained, len(abandoned))

    def _teardown(self, primary: BaseException | None) -> None:
        """After the last batch nothing may be outstanding. After an error whatever is still
        outstanding is abandoned at once (the pool's close stops it): waiting for work that may
        be what failed would only delay the error."""
        if self.pool.inflight == 0 and not self.ready:
            return
        if primary is not None:
            self._emit("abandon", detail={"batches": sorted(self.outstanding)})
            self.ready.clear()
            return
        self._reap(self.pool.quiesce(self.wait_timeout_s))
        self._emit("drain", detail={"batches": [b.index for b in self.ready]})
        raise ControlError(
            f"{len(self.ready)} rollout batch(es) were outstanding after the final batch; "
            "the final hard boundary must leave nothing in flight"
        )

    def _emit(self, kind: str, *, t: float | None = None, end: float | None = None,
              batch: int | None = None, version: int | None = None,
              detail: Mapping[str, object] | None = None) -> None:
        self.observer.on_event(LoopEvent(
            kind=kind, t=self.clock() if t is None else t, end=end, batch=batch, version=version,
            detail=detail or {},
        ))

