"""A run's events (``events.jsonl``) replayed through the budget rules themselves.

Whatever the machine's timing, every decision a run recorded must be one ``AsyncControl`` allows
in the state the earlier events leave: each burst of launches at most the slots the launch rule
gives then (bounded by the oldest version still generating where syncs do not drain, by the publish
lag where they do), no batch consumed above the budget, a publication after every step that
leaves the trainer ahead where syncs do not drain (and after every step that exhausts the budget
where they do), and every eval or save boundary drained.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tether.control.control import AsyncControl


def rule_violations(settings: Any, events: Iterable[Mapping[str, Any]]) -> list[str]:
    """What in ``events`` (in the order the driver wrote them) the rules of ``settings`` (a run's
    ``cfg.budget()``) would not have done; empty when the run followed them."""
    control = AsyncControl(settings)
    generating: dict[int, int] = {}  # batch → the published version it was launched at
    ready = trained = 0
    burst: list[int] | None = None  # [slots the rule gave, launches made] in this burst
    owed: int | None = None  # the step after which a publication is due, until one comes
    out: list[str] = []
    for e in events:
        kind = e["kind"]
        if kind == "launch":
            if burst is None:
                slots = control.launch_slots(inflight=len(generating), ready=ready, trained_batches=trained,
                                             oldest_generating=min(generating.values(), default=None))
                burst = [slots, 0]
            burst[1] += 1
            if e["version"] != control.rollout_version:
                out.append(f"batch {e['batch']} launched at version {e['version']}, the engines hold "
                           f"{control.rollout_version}")
            if burst[1] > burst[0]:
                out.append(f"batch {e['batch']}: launch {burst[1]} of a burst the rule gave {burst[0]} "
                           f"slots (train {control.train_version}, published {control.rollout_version}, "
                           f"generating {sorted(generating.items())}, ready {ready})")
            generating[e["batch"]] = e["version"]
            continue
        burst = None
        if kind == "ready":
            generating.pop(e["batch"], None)
            ready += 1
        elif kind == "consume":
            ready -= 1
            if e["staleness_updates"] > settings.staleness_budget:
                out.append(f"batch {e['batch']} consumed {e['staleness_updates']} updates stale")
        elif kind == "train":
            control.commit(e["committed"])
            trained += 1
            if control.train_version != e["version"]:
                out.append(f"after batch {e['batch']} the trainer is at {e['version']}, the rules count "
                           f"{control.train_version}")
            if owed is not None:
                out.append(f"no publication after step {owed}, which the rules required")
            decision = control.sync_decision(trained)
            owed = trained if decision.due else None
            due = set(decision.reasons)
        elif kind == "sync":
            reasons = set(e["reasons"])
            if {"eval", "save"} & reasons and not e["drained"]:
                out.append(f"the {'/'.join(sorted(reasons))} sync at step {e['step']} did not drain")
            if owed is not None and reasons != due:
                out.append(f"the sync after step {owed} gave {sorted(reasons)}, the rules {sorted(due)}")
            owed = None
            if e["published"]:
                control.mark_published(e["version"])
    if owed is not None and owed < settings.total_batches:
        out.append(f"no publication after step {owed}, which the rules required")
    return out
