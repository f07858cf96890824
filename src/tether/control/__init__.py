"""The control plane: versions, the staleness budget, admission, the sync rule, the batch FIFO.

Pure Python. Importing it must never load torch (a test checks).
"""

from tether.control.budget import ON_STALE_CHOICES, BudgetSettings, OnStale
from tether.control.control import AsyncControl, Staleness, SyncDecision
from tether.control.notes import AdmissionNote, admission_notes
from tether.control.queue import BatchQueue

__all__ = [
    "ON_STALE_CHOICES",
    "AdmissionNote",
    "AsyncControl",
    "BatchQueue",
    "BudgetSettings",
    "OnStale",
    "Staleness",
    "SyncDecision",
    "admission_notes",
]
