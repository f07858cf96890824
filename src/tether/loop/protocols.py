"""The two seams the driver loop is written against, and the records that cross them.

A *rollout pool* turns generation requests into complete, scored rollout batches; a *learner*
turns a batch into committed optimizer updates. Real, Ray-backed, simulated and fake worlds all
implement these, and the same loop runs in each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class GenerationRequest:
    """One rollout batch to generate.

    ``index`` is the launch index: the data cursor in rollout batches (batch ``index`` of the
    prompt stream). ``version`` is the published version the batch is generated under.
    """

    index: int
    version: int


@dataclass(frozen=True)
class RolloutBatch:
    """A complete, scored rollout batch with its prompt groups intact.

    ``behavior_version`` is the oldest policy version that touched any of its tokens;
    ``newest_version`` the newest (equal unless weights changed mid-generation).
    ``payload`` is the world's own data (token tensors and rewards for the real world).
    """

    index: int
    behavior_version: int
    num_groups: int
    group_size: int
    payload: Any = None
    newest_version: int | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    completed_at: float | None = None
    """When the pool received the finished batch, in the driver's clock (``time.monotonic`` for
    real pools, virtual time for the simulated one); None if the pool does not say."""
    work_s: float | None = None
    """Seconds the worker spent generating and scoring it (the rest of launch → ready is queueing
    behind other batches and waiting to be reaped); None if unknown."""
    version_shares: Mapping[int, float] | None = None
    """The share of its completion tokens generated under each policy version (summing to 1);
    more than one version when weights changed mid-generation. None if the pool does not say."""

    def __post_init__(self) -> None:
        if self.num_groups < 1 or self.group_size < 1:
            raise ValueError(
                f"rollout batch {self.index}: num_groups and group_size must be >= 1, "
                f"got {self.num_groups} and {self.group_size}"
            )
        if self.newest_version is not None and self.newest_version < self.behavior_version:
            raise ValueError(
                f"rollout batch {self.index}: newest_version {self.newest_version} is older "
                f"than behavior_version {self.behavior_version}"
            )

    @property
    def num_samples(self) -> int:
        return self.num_groups * self.group_size


@dataclass(frozen=True)
class TrainResult:
    """What one rollout batch's training step did. ``committed_updates`` moves the clock."""

    committed_updates: int
    attempted_updates: int
    metrics: Mapping[str, float] = field(default_factory=dict)


@runtime_checkable
class RolloutPool(Protocol):
    """Generates rollout batches concurrently with the driver."""

    @property
    def inflight(self) -> int:
        """Launched generations not yet returned by ``reap``, ``wait`` or ``quiesce``."""
        ...

    def launch(self, request: GenerationRequest) -> None:
        """Start generating a batch; returns at once."""

    def reap(self) -> list[RolloutBatch]:
        """Every batch completed so far, in completion order, without blocking."""
        ...

    def wait(self, timeout: float | None) -> list[RolloutBatch]:
        """Block until at least one in-flight batch completes; return those completed."""
        ...

    def quiesce(self, timeout: float | None) -> list[RolloutBatch]:
        """Finish every in-flight generation and return the batches, in completion order;
        ``timeout`` bounds the wait for each next completion."""
        ...

    def publish(self, weights: Any, version: int) -> Mapping[str, float]:
        """Load ``weights`` as ``version`` into every engine: while quiesced, or — for a pool
        built for ``async.inflight_update`` other than drain — with generations running, which
        continue under the new weights."""
        ...


@runtime_checkable
class Learner(Protocol):
    """Trains on rollout batches and exports its weights for publication."""

    def train(self, batch: RolloutBatch, *, train_version: int) -> TrainResult:
        """Make up to U updates from ``batch``; report how many were committed."""
        ...

    def export_weights(self) -> Any:
        """The current weights, in whatever form this world's pool publishes."""
        ...


@dataclass(frozen=True)
class LoopState:
    """Where a run stands between batches; all the loop needs to resume."""

    trained_batches: int = 0
    launched_batches: int = 0
    """Next fresh launch index (the data cursor, in rollout batches)."""
    dropped_batches: int = 0
    train_version: int = 0
    pending: tuple[int, ...] = ()
    """Launch indices abandoned by an interrupt before they trained; relaunched first on resume."""
    rollout_version: int | None = None
    """The version the engines held (last published). A resume that gives the engines these
    weights again continues exactly; None (older checkpoints) forces a publish on resume."""


class BoundaryHooks(Protocol):
    """What happens at hard boundaries, after the drain and the publish."""

    def evaluate(self, step: int, version: int) -> Mapping[str, float]:
        """Evaluate the published weights after ``step`` trained batches."""
        ...

    def save(self, step: int, state: LoopState) -> None:
        """Checkpoint after ``step`` trained batches; nothing is outstanding."""
