"""The control plane: versions, the staleness budget, admission, the sync rule, the batch FIFO.

Pure Python. Importing it must never load torch (a test checks).
"""

from tether.control.budget import ON_STALE_CHOICES, BudgetSettings, OnStale
from tether.control.control import AsyncControl, Staleness, SyncDecision
from tether.control.inflight import MODES, InflightMode, inflight_mode
from tether.control.notes import AdmissionNote, admission_notes
from tether.control.queue import BatchQueue

__all__ = [
    "MODES",
    "ON_STALE_CHOICES",
    "AdmissionNote",
    "AsyncControl",
    "BatchQueue",
    "BudgetSettings",
    "InflightMode",
    "OnStale",
    "Staleness",
    "SyncDecision",
    "admission_notes",
    "inflight_mode",
]
