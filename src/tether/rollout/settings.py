"""What a rollout pool and each of its workers are told, whatever the backend: the pool's settings
(the recipe, and what preparing the run found) and one worker's start (``WorkerSpec``), picklable
for a spawned process or a Ray actor."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tether.config import Config
from tether.control.inflight import InflightMode, inflight_mode

if TYPE_CHECKING:
    from tether.rollout.channel import Layout
    from tether.rollout.collective import GroupAddress


@dataclass(frozen=True)
class PoolSettings:
    """What a pool and its workers are told: the recipe, and what preparing the run found (the
    model directory, the task's stop text)."""

    cfg: Config
    model_path: str
    stop_text: str = "\n"
    startup_timeout_s: float = 300.0

    @property
    def num_workers(self) -> int:
        return self.cfg.rollout.num_workers

    @property
    def threads_per_worker(self) -> int:
        return self.cfg.rollout.threads_per_worker

    @property
    def group_size(self) -> int:
        return self.cfg.rollout.group_size

    @property
    def drain_at_turns(self) -> bool:
        """Publications drain only the turns in flight (``Family.drains_at_turns``)."""
        return self.cfg.family().drains_at_turns(self.cfg)

    @functools.cached_property
    def inflight(self) -> InflightMode:
        """How the engines meet a publication (``tether.control.inflight``), read once from the
        recipe: the mode of ``async.inflight_update``, or, draining at turn boundaries, the one it
        runs at turn safe points (``InflightMode.turn_mode``: each takes new weights up between
        turns only). What an engine's ``watch`` is told."""
        declared = inflight_mode(self.cfg.async_.inflight_update)
        return declared.at_turns() if self.drain_at_turns else declared

    def worker_spec(self, worker_id: int, version: int, **where: Any):
        """The ``WorkerSpec`` of worker ``worker_id`` starting at ``version``; ``where`` adds the
        backend's fields (its weight channel, its device)."""
        return WorkerSpec(worker_id=worker_id, settings=self, initial_version=version, **where)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to start, picklable for a spawned process: the pool's settings
    (the recipe among them) and where this worker gets its weights."""

    worker_id: int
    settings: PoolSettings
    initial_version: int = 0
    channel_name: str | None = None
    """The shared-memory weight channel (process workers); None where weights come otherwise."""
    channel_layout: Layout | None = None
    group: GroupAddress | None = None
    """The collective weight group to join as rank ``worker_id + 1`` (``rollout.weight_sync=
    collective``), with ``channel_layout``; None otherwise."""
    device: str = "cpu"
    """Where the engine samples: ``cpu``, or ``cuda`` for a Ray actor given a GPU."""

    @property
    def inflight(self) -> InflightMode:
        return self.settings.inflight
