"""The driver loop (pure Python) and the worlds it runs in: fakes and virtual time."""

from tether.loop.driver import Driver, NoHooks
from tether.loop.observe import BatchRecord, LoopEvent, LoopObserver, Observers, TraceRecorder
from tether.loop.virtual import Simulation, Timings, plan_document, simulate, summarize
from tether.vocabulary import (
    BoundaryHooks,
    GenerationRequest,
    Learner,
    LoopState,
    RolloutBatch,
    RolloutPool,
    TrainResult,
)

__all__ = [
    "BatchRecord",
    "BoundaryHooks",
    "Driver",
    "GenerationRequest",
    "Learner",
    "LoopEvent",
    "LoopObserver",
    "LoopState",
    "NoHooks",
    "Observers",
    "RolloutBatch",
    "RolloutPool",
    "Simulation",
    "Timings",
    "TraceRecorder",
    "TrainResult",
    "plan_document",
    "simulate",
    "summarize",
]
