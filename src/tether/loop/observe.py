"""What the driver loop tells the outside world: timestamped events and per-batch records."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LoopEvent:
    """One thing that happened: launch, ready, consume, drop, train, sync, eval, save, drain,
    abandon or worker_lost. Spans (train, sync, eval, save) have an ``end``."""

    kind: str
    t: float
    end: float | None = None
    batch: int | None = None
    version: int | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BatchRecord:
    """One consumed-and-trained rollout batch, with every metric of that step."""

    step: int
    """Trained batches after this one (1-based)."""
    batch_index: int
    """The batch's launch index (its position in the prompt stream)."""
    behavior_version: int
    staleness_updates: int
    staleness_batches: float
    metrics: Mapping[str, float]
    payload: Any = None
    """The batch's samples (its family's payload), for observers that record them."""


class LoopObserver:
    """Receives the loop's output. Subclass and override what you need; all default to no-ops."""

    def on_note(self, code: str, message: str) -> None:
        """An admission note, once at start."""

    def on_event(self, event: LoopEvent) -> None:
        """A timestamped event (launch, ready, consume, drop, train, sync, eval, save, drain, abandon,
        worker_lost)."""

    def on_batch(self, record: BatchRecord) -> None:
        """A trained batch, after its sync, eval and save."""

    def on_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        """Evaluation results after ``step`` trained batches (0 = before training)."""


class Observers(LoopObserver):
    """Fan one loop's output out to several observers, in order."""

    def __init__(self, *observers: LoopObserver) -> None:
        self.observers = [o for o in observers if o is not None]

    def on_note(self, code: str, message: str) -> None:
        for o in self.observers:
            o.on_note(code, message)

    def on_event(self, event: LoopEvent) -> None:
        for o in self.observers:
            o.on_event(event)

    def on_batch(self, record: BatchRecord) -> None:
        for o in self.observers:
            o.on_batch(record)

    def on_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        for o in self.observers:
            o.on_eval(step, metrics)


class Recorder(LoopObserver):
    """Appends what ``lines(record)`` says about every ``every``-th trained batch to the JSON-lines
    file ``path``, a line flushed as it is written; each line carries its batch's ``step`` (so a
    resume can trim the file to its checkpoint)."""

    def __init__(self, path, every: int, lines) -> None:
        self.path, self.every, self.lines = path, every, lines
        self.file = None  # opened at the first line: a run with nothing to record leaves no file

    def on_batch(self, record: BatchRecord) -> None:
        if not self.every or record.step % self.every:
            return
        for line in self.lines(record):
            if self.file is None:
                self.file = open(self.path, "a", buffering=1)  # noqa: SIM115 - held for the run, closed by close()
            row = {"step": record.step, "batch_index": record.batch_index, **line}
            self.file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class TraceRecorder(LoopObserver):
    """Keeps everything in memory: the event trace, the records, evals and notes."""

    def __init__(self) -> None:
        self.events: list[LoopEvent] = []
        self.records: list[BatchRecord] = []
        self.evals: list[tuple[int, Mapping[str, float]]] = []
        self.notes: list[tuple[str, str]] = []

    def on_note(self, code: str, message: str) -> None:
        self.notes.append((code, message))

    def on_event(self, event: LoopEvent) -> None:
        self.events.append(event)

    def on_batch(self, record: BatchRecord) -> None:
        self.records.append(record)

    def on_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        self.evals.append((step, dict(metrics)))

    def of_kind(self, kind: str) -> list[LoopEvent]:
        return [e for e in self.events if e.kind == kind]
