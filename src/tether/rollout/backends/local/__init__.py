"""The local backend's plug-in (``rollout.backend=local``): worker processes of this machine,
weights through shared memory or a collective broadcast (``pool.ProcessPool``). Importing it loads
no torch."""

from __future__ import annotations

from tether.control.inflight import INFLIGHT_UPDATE_CHOICES
from tether.plugins import BackendPlugin


class _Local(BackendPlugin):
    def warm_up(self, cfg):
        from tether.procinfo import start_child_server

        start_child_server()  # the workers' fork server imports torch while the learner builds

    def pool(self, settings, batches, weights, session, *, initial_version, extras):
        from tether.rollout.backends.local.pool import ProcessPool

        return ProcessPool(settings, batches, weights, initial_version=initial_version, extras=extras)


LOCAL = _Local("local", weight_channel="shared_memory", other_channels=("collective",),
               inflight_updates=INFLIGHT_UPDATE_CHOICES)
