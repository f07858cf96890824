"""Admission notes: settings whose number does not buy what its name implies.

Logged once at start. Each note states the number that actually takes effect, so a recipe that
asks for a deep budget but clamps it with an eval interval says so instead of running silently
shallower (docs/architecture.md §2, the admission notes).
"""

from __future__ import annotations

from dataclasses import dataclass

from tether.control.budget import BudgetSettings


@dataclass(frozen=True)
class AdmissionNote:
    """One note: a stable ``code`` for tests and tooling, and a sentence for people."""

    code: str
    message: str

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


# How deep a budget the literature supports, in rollout batches (AReaL's versions: one per
# consumed batch, so AReaL's η is Tether's S). AReaL (Fu et al. 2025, arXiv 2505.24298)
# recommends a staleness of at most 8 with its decoupled PPO objective (Tether's
# train.anchor=proximal); the peers that anchor the ratio on the behavior policy cap it lower by
# default: SkyRL's max_staleness_steps and TRL's async GRPO max_staleness are both 4.
DEEP_BUDGET = {"proximal": 8, "behavior": 4}


def admission_notes(s: BudgetSettings, *, anchor: str | None = None) -> list[AdmissionNote]:
    """The notes for these settings, in a fixed order (possibly none). ``anchor``
    (``train.anchor``) adds the deep-budget caution, stronger without the decoupled objective."""
    notes: list[AdmissionNote] = []
    depth = s.admission_depth
    schedule = s.describe_sync_schedule()
    longest = max(s.capping_gaps)
    if s.max_staleness == 0:
        notes.append(
            AdmissionNote(
                "no_overlap",
                "async.max_staleness=0: every batch trains on exactly the published policy, so "
                "generation of the next batch cannot start until the current one has trained and "
                "been published; generation and training do not overlap (synchronous mode).",
            )
        )
    if s.max_inflight > depth:
        notes.append(
            AdmissionNote(
                "inflight_surplus",
                f"async.max_inflight={s.max_inflight} exceeds admission_depth={depth} "
                f"(max_staleness + 1): at most {depth} generations are ever outstanding, so "
                f"{s.max_inflight - depth} slot(s) are never used.",
            )
        )
    if depth > s.max_inflight + 1 and s.drains:
        notes.append(
            AdmissionNote(
                "depth_surplus",
                f"admission_depth={depth} exceeds async.max_inflight + 1 = {s.max_inflight + 1}: "
                "the extra depth adds no concurrent generation; it only spaces the weight syncs "
                f"further apart (weights are published {schedule}).",
            )
        )
    clamps = [
        (key, interval)
        for key, interval in (("eval.interval", s.eval_interval), ("checkpoint.interval", s.save_interval))
        if 0 < interval < depth
    ]
    if clamps:
        which = " and ".join(f"{key}={interval}" for key, interval in clamps)
        notes.append(
            AdmissionNote(
                "boundary_clamp",
                f"{which} is below admission_depth={depth}: "
                + (f"weights are published {schedule}, and " if s.drains else "admission stops at each, so ")
                + f"data is never more than {longest - 1} batch(es) stale, not the "
                f"{s.max_staleness} that async.max_staleness allows; the rest of the budget is "
                "never spent.",
            )
        )
    if s.drains and s.total_batches < min(s.sync_gaps):
        notes.append(
            AdmissionNote(
                "short_run",
                f"train.num_batches={s.total_batches} is shorter than the gap between two weight "
                f"syncs ({min(s.sync_gaps)} batches): data is never more than {s.total_batches - 1} "
                "batch(es) stale in this run.",
            )
        )
    depth_note = _deep_budget(s, anchor)
    if depth_note is not None:
        notes.append(depth_note)
    return notes


def _deep_budget(s: BudgetSettings, anchor: str | None) -> AdmissionNote | None:
    reach = s.effective_max_staleness
    if anchor not in DEEP_BUDGET or reach <= DEEP_BUDGET[anchor]:
        return None
    if anchor == "proximal":
        return AdmissionNote(
            "deep_budget",
            f"data can reach {reach} batches of staleness (async.max_staleness={s.max_staleness}), beyond "
            f"the {DEEP_BUDGET['proximal']} that AReaL recommends even with the decoupled objective used "
            "here (train.anchor=proximal); watch ratio/clip_frac_* and ratio/is_weight_* against "
            "staleness/batches, or lower async.max_staleness.",
        )
    return AdmissionNote(
        "deep_budget_behavior",
        f"data can reach {reach} batches of staleness (async.max_staleness={s.max_staleness}) while the "
        "PPO ratio is anchored on the behavior policy (train.anchor=behavior): nothing absorbs the drift "
        "of stale data but the clip range, which then clips most tokens of the stalest batches. Peers "
        f"that train this way cap staleness at {DEEP_BUDGET['behavior']} (SkyRL, TRL); AReaL's decoupled "
        "objective supports up to 8. Set train.anchor=proximal, or lower async.max_staleness.",
    )
