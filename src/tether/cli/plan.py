"""``tether plan``: run the real driver loop in virtual time and show what it would do."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from tether.config import Config, load_config
from tether.control import MODES, inflight_mode
from tether.errors import ConfigError
from tether.loop.virtual import Simulation, plan_document, simulate, timings_of

# flag → recipe key; a flag wins over the recipe and over key=value overrides.
STALENESS_CAP = 8
"""--optimize's largest S by default."""
TOP = 5
"""--optimize's alternatives printed by default."""

FLAG_KEYS = {
    "max_staleness": "async.max_staleness",
    "updates_per_batch": "train.updates_per_batch",
    "num_batches": "train.num_batches",
    "max_inflight": "async.max_inflight",
    "sync_when_idle": "async.sync_when_idle",
    "inflight_update": "async.inflight_update",
    "eval_interval": "eval.interval",
    "save_interval": "checkpoint.interval",
    "workers": "rollout.num_workers",
    "commits": "plan.commits",
    "gen_time": "plan.gen_time",
    "gen_jitter": "plan.gen_jitter",
    "train_time": "plan.train_time",
    "sync_time": "plan.sync_time",
    "seed": "plan.seed",
    "mean_length": "plan.mean_length",
    "prefill_cost": "plan.prefill_cost",
    "turns": "plan.turns",
    "env_time": "plan.env_time",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="simulate a recipe's schedule in virtual time (publications, staleness, idle time)",
        description="Run the real driver loop against a simulated pool and learner and print "
        "which batch trains at what staleness, when weights are published and why, the admission "
        "notes, and where the time goes. Flags win over the recipe and over key=value overrides.",
    )
    p.add_argument("args", nargs="*", metavar="RECIPE|KEY=VALUE",
                   help="an optional YAML recipe, then section.key=value overrides")
    p.add_argument("--max-staleness", type=int, help="S, in rollout batches (async.max_staleness)")
    p.add_argument("--updates-per-batch", type=int, help="U (train.updates_per_batch)")
    p.add_argument("--num-batches", type=int, help="rollout batches to train (train.num_batches)")
    p.add_argument("--max-inflight", type=int, help="concurrent generations (async.max_inflight)")
    p.add_argument("--sync-when-idle", action="store_const", const="true",
                   help="also publish whenever no generation is in flight (async.sync_when_idle)")
    p.add_argument("--inflight-update", choices=list(MODES),
                   help="whether a publication waits for generations in flight (async.inflight_update); "
                   "recompute and abort need --mean-length")
    p.add_argument("--eval-interval", type=int, help="eval every N batches, 0 = off (eval.interval)")
    p.add_argument("--save-interval", type=int,
                   help="checkpoint every N batches, 0 = off (checkpoint.interval)")
    p.add_argument("--workers", type=int, help="engines generating concurrently (rollout.num_workers)")
    p.add_argument("--commits", type=str,
                   help="committed updates per consumed batch, cycled, e.g. 2,1,2 (plan.commits)")
    p.add_argument("--gen-time", type=float, help="seconds per rollout batch (plan.gen_time)")
    p.add_argument("--turns", type=float, help="agent family: turns per rollout batch (plan.turns)")
    p.add_argument("--env-time", type=float,
                   help="agent family: environment seconds per turn (plan.env_time)")
    p.add_argument("--gen-jitter", type=float,
                   help="coefficient of variation of generation time (plan.gen_jitter)")
    p.add_argument("--train-time", type=float, help="seconds per optimizer update (plan.train_time)")
    p.add_argument("--sync-time", type=float, help="seconds per weight publication (plan.sync_time)")
    p.add_argument("--seed", type=int, help="seed for generation-time jitter and lengths (plan.seed)")
    p.add_argument("--mean-length", type=float,
                   help="mean completion length in tokens: model each sequence, lengths geometric up to "
                   "rollout.max_new_tokens (plan.mean_length)")
    p.add_argument("--prefill-cost", type=float,
                   help="recompute: one prefix token run again, in decode steps (plan.prefill_cost)")
    p.add_argument("--closed-form", action="store_true",
                   help="also print the mean staleness in closed form (Tether's for the recipe's "
                   "publication rule, and Applied Compute's queueing forms with their five parameters) "
                   "beside the simulation's")
    p.add_argument("--optimize", action="store_true",
                   help="search recipes (S, max_inflight, workers, the publication rule; batch and group "
                   "size with --vary-batch/--vary-group) for the most samples/s from the recipe's measured "
                   "plan.gen_time / train_time / sync_time, and print the best few")
    p.add_argument("--cores", type=int, help="--optimize: cores for the learner's threads and the "
                   "engines (default: this machine's)")
    p.add_argument("--staleness-cap", type=int, default=STALENESS_CAP,
                   help="--optimize: the largest S to consider")
    p.add_argument("--vary-batch", action="store_true",
                   help="--optimize: also half and double rollout.batch_size")
    p.add_argument("--vary-group", action="store_true",
                   help="--optimize: also half and double rollout.group_size")
    p.add_argument("--min-samples-per-s", type=float,
                   help="--optimize: rank by lowest mean staleness among recipes reaching this throughput")
    p.add_argument("--tie", type=float, default=None,
                   help="--optimize: throughputs within this fraction of the fastest count as equal, and the "
                        "least stale of them is chosen (default 0.03)")
    p.add_argument("--top", type=int, default=TOP, help="--optimize: alternatives to print")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    p.add_argument("--width", type=int, default=72, help="timeline width in characters")
    p.add_argument("--all", action="store_true", dest="show_all",
                   help="list every step and draw the whole run's timeline (by default a long run "
                   "shows each distinct sync period once, the last steps, and the first periods' timeline)")
    p.set_defaults(func=run)


def split_recipe_args(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """The first positional is a recipe unless it is a key=value override."""
    if args and "=" not in args[0]:
        return args[0], list(args[1:])
    for a in args:
        if "=" not in a:
            raise ConfigError(f"{a!r} is not a key=value override; only the first argument may be a recipe")
    return None, list(args)


def recipe_and_overrides(ns: argparse.Namespace) -> tuple[str | None, list[str]]:
    """The recipe and its overrides: the key=value words, then each flag given as its key."""
    recipe, overrides = split_recipe_args(ns.args)
    for flag, key in FLAG_KEYS.items():
        value = getattr(ns, flag)
        if value is not None:
            overrides.append(f"{key}={value}")
    return recipe, overrides


def config_from_args(ns: argparse.Namespace) -> Config:
    return load_config(*recipe_and_overrides(ns))


def optimize(ns: argparse.Namespace) -> int:
    import os
    from dataclasses import asdict

    from tether.loop.optimize import search

    recipe, overrides = recipe_and_overrides(ns)
    cores = ns.cores or os.cpu_count() or 1
    best, ranked, given = search(recipe, overrides, cores=cores, staleness_cap=ns.staleness_cap,
                                 vary_batch=ns.vary_batch, vary_group=ns.vary_group,
                                 min_samples_per_s=ns.min_samples_per_s,
                                 **({} if ns.tie is None else {"tie": ns.tie}))
    if ns.json:
        print(json.dumps({"best": asdict(best), "given": asdict(given),
                          "ranked": [asdict(c) for c in ranked[:max(ns.top, 1)]],
                          "candidates": len(ranked), "cores": cores}, indent=2))
        return 0
    tie = 0.03 if ns.tie is None else ns.tie
    goal = (f"most samples/s (within {tie:.0%} of the fastest: the least stale)"
            if ns.min_samples_per_s is None
            else f"least mean staleness at {ns.min_samples_per_s:g} samples/s or more")
    print(f"tether plan --optimize: {len(ranked)} distinct outcomes simulated on {cores} cores, "
          f"S ≤ {ns.staleness_cap}; goal: {goal}")
    print("as given:\n  " + given.line())
    print("chosen:\n  " + best.line())
    print("then:")
    for c in ranked[1:max(ns.top, 1) + 1]:
        print("  " + c.line())
    print("run it: tether train " + " ".join([*([recipe] if recipe else []), *best.overrides]))
    return 0


OPTIMIZE_ONLY = {"cores": None, "staleness_cap": STALENESS_CAP, "vary_batch": False, "vary_group": False,
                 "min_samples_per_s": None, "tie": None, "top": TOP}
"""The options that shape ``--optimize``'s search, with their defaults: given without it, refused."""

MIN_WIDTH = 10


def check_options(ns: argparse.Namespace) -> None:
    """Refuse what ``tether plan`` would otherwise ignore or fail on: a search option without
    ``--optimize``, and counts below what they can mean."""
    if not ns.optimize:
        given = [name for name, default in OPTIMIZE_ONLY.items() if vars(ns)[name] != default]
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise ConfigError(f"{flags} only appl{'ies' if len(given) == 1 else 'y'} with --optimize: add "
                              "--optimize, or drop it")
    if ns.width < MIN_WIDTH:
        raise ConfigError(f"--width must be {MIN_WIDTH} or more (characters of the timeline), got {ns.width}")
    for name, least in (("cores", 1), ("staleness_cap", 0), ("top", 1)):
        value = vars(ns)[name]
        if value is not None and value < least:
            raise ConfigError(f"--{name.replace('_', '-')} must be {least} or more, got {value}")


def run(ns: argparse.Namespace) -> int:
    check_options(ns)
    if ns.optimize:
        return optimize(ns)
    cfg = config_from_args(ns)
    if inflight_mode(cfg.async_.inflight_update).extra_work and cfg.family().plan_lengths(cfg)[0] <= 0:
        raise ConfigError(f"the extra work of async.inflight_update={cfg.async_.inflight_update} (a prefix "
                          "run again, or sequences sampled again) depends on each sequence's length: set "
                          "plan.mean_length (--mean-length, the mean completion length in tokens, e.g. "
                          "a run's response/length_mean) so the planner models each sequence")
    sim = simulate(cfg.budget(), timings_of(cfg), num_groups=cfg.rollout.batch_size,
                   group_size=cfg.rollout.group_size, anchor=cfg.train.anchor)
    doc = plan_document(sim)
    if cfg.rollout.dynamic_sampling:
        b, draws = cfg.rollout.batch_size, cfg.rollout.dynamic_sampling_max_draws
        doc["dynamic_sampling"] = {
            "prompts_per_batch": b, "max_prompts_per_batch": draws * b,
            "extra_prompts_of_batch_k": f"positions {(draws - 1) * b}·k … {(draws - 1) * b}·k + "
                                        f"{(draws - 1) * b - 1} of the extra stream",
        }
    if ns.closed_form:
        from tether.loop.closed_form import closed_forms

        t = timings_of(cfg)
        doc["closed_form"] = closed_forms(cfg, gen_time=t.gen_time, train_time=t.train_time,
                                          sync_time=t.sync_time)
    if ns.json:
        print(json.dumps(doc, indent=2))
    else:
        print(render_text(sim, doc, width=ns.width, show_all=ns.show_all))
        if ns.closed_form:
            print("\n" + "\n".join(closed_form_lines(doc["closed_form"],
                                                     doc["summary"]["mean_staleness_batches"])))
    return 0


def closed_form_lines(forms: dict, simulated: float, measured: float | None = None) -> list[str]:
    """The closed forms beside the simulated (and a run's measured) mean staleness, in batches."""
    ac = forms["applied_compute"]
    how = {"lazy": "lazy publication rule: exact", "idle": "idle syncs: approximate",
           "eager": "a publication every step: approximate"}[forms["rule"]]
    seen = f"simulated {simulated:.2f}" + ("" if measured is None else f", measured {measured:.2f}")
    why = forms["withheld"]
    capped = "" if ac["uncapped_batches"] <= ac["mean_staleness_batches"] else \
        f" (uncapped {ac['uncapped_batches']:.2f}; no batch trains staler than S)"
    params = f"[rho={ac['rho']:.2f}, B={ac['B']}, C={ac['C']:g}, q={ac['q']:g}, M_tail={ac['M_tail']:.2f}]"
    ours = f"not printed: {why['tether']}" if why["tether"] else f"{forms['mean_staleness_batches']:.2f}"
    theirs = f"not printed: {why['applied_compute']}" if why["applied_compute"] else \
        f"{ac['mean_staleness_batches']:.2f}{capped}"
    return [
        f"mean staleness (batches): {seen}",
        f"  closed form ({how}): {ours}",
        f"  Applied Compute's {ac['regime']} form {params}: {theirs}",
    ]


def render_text(sim: Simulation, doc: dict, *, width: int = 72, show_all: bool = False) -> str:
    s = sim.settings
    out = [
        f"tether plan: S={s.max_staleness} batches, U={s.updates_per_batch} updates/batch, "
        f"{s.total_batches} batches, max_inflight={s.max_inflight}, workers={sim.timings.workers}",
        f"  staleness_budget = S·U = {doc['staleness_budget']} updates   "
        f"admission_depth = S+1 = {doc['admission_depth']} batches   "
        f"weights published {s.describe_sync_schedule()}",
        "",
    ]
    if "dynamic_sampling" in doc:
        d = doc["dynamic_sampling"]
        more = d["max_prompts_per_batch"] - d["prompts_per_batch"]
        out += [f"dynamic sampling: each batch generates its {d['prompts_per_batch']} prompts of the stream, "
                f"then draws up to {more} more from its own slice "
                f"({d['extra_prompts_of_batch_k']}) until it has {d['prompts_per_batch']} groups with "
                "reward variance; the stream's cursor moves by the batch size either way. plan.gen_time is "
                "per batch, redraws included: give the measured time/generate.", ""]
    if doc["notes"]:
        out.append("notes:")
        out += [f"  [{n['code']}] {n['message']}" for n in doc["notes"]]
        out.append("")
    syncs = {e.detail["step"]: e for e in sim.trace.of_kind("sync")}
    consumed_at = {e.batch: e.t for e in sim.trace.of_kind("consume")}
    out.append(" step  batch  behavior  trained at  staleness        accrued (updates)  committed  "
               "consumed (s)  then")
    out.append("                version   version     updates batches  lag  gen  queue")
    periods = _periods(doc["batches"], syncs)
    for kind, part in _shown(periods, syncs, show_all):
        if kind == "skip":
            out.append(f"   … steps {part[0][0]['step']}–{part[-1][-1]['step']}: {len(part)} more sync "
                       "period(s) like those above (--all lists every step)")
            continue
        for b in part:
            out.append(_row(b, syncs.get(b["step"]), consumed_at.get(b["index"], 0.0)))
    sm = doc["summary"]
    out += [
        "",
        f"publications after batches: {_listed(doc['syncs_after'], show_all)}",
        f"staleness (batches): max {sm['max_staleness_batches']:g}, mean "
        f"{sm['mean_staleness_batches']:.2f}, histogram {sm['staleness_histogram_batches']}",
        f"where it accrued (mean updates): {sm['mean_staleness_at_launch_updates']:.2f} publish lag at "
        f"launch, {sm['mean_staleness_generating_updates']:.2f} while generating, "
        f"{sm['mean_staleness_queued_updates']:.2f} waiting to be trained",
        *([] if s.drains else [
            f"per token (inflight_update={s.inflight_update}"
            f"{' at turn boundaries' if s.drain_at_turns else ''}): mean staleness "
            f"{sm['mean_token_staleness_updates']:.2f} updates (a batch's own is its oldest token's); "
            f"{sm['multi_version_batch_frac']:.0%} of batches generated under more than one version"
            + ("" if "multi_version_seq_frac" not in sm else
               f", {sm['multi_version_seq_frac']:.0%} of sequences; "
               f"{sm['wasted_tokens_per_batch']:.1f} tokens wasted per batch")]),
        f"time: {sm['makespan_s']:.2f}s total, {sm['mean_step_time_s']:.3f}s per batch; trainer "
        f"idle {sm['trainer_idle_fraction']:.0%}, generators idle {sm['generator_idle_fraction']:.0%}",
        "",
        render_timeline(sim, width=width, until=None if show_all else _window(sim, periods)),
    ]
    return "\n".join(out)


def _listed(steps: list[int], show_all: bool, head: int = 12) -> str:
    if not steps:
        return "none"
    if show_all or len(steps) <= head + 1:
        return ", ".join(map(str, steps))
    return f"{', '.join(map(str, steps[:head]))}, …, {steps[-1]} ({len(steps)} in all; --all lists them)"


def _row(b: dict, sync, consumed: float) -> str:
    then = ""
    if sync is not None:
        why = "+".join(sync.detail["reasons"])
        then = f"publish v{sync.version} ({why})" if sync.detail["published"] else f"drain ({why})"
    return (f" {b['step']:4d}  {b['index']:5d}  {b['behavior_version']:8d}  {b['train_version']:10d}"
            f"  {b['staleness_updates']:7d} {b['staleness_batches']:7.2f}"
            f"  {b['staleness_at_launch_updates']:3d}  {b['staleness_generating_updates']:3d}"
            f"  {b['staleness_queued_updates']:5d}  {b['committed_updates']:9d}  {consumed:12.2f}  {then}")


def _periods(batches: list[dict], syncs: dict) -> list[list[dict]]:
    """The rows cut after each step that syncs (a sync period each)."""
    periods, current = [], []
    for b in batches:
        current.append(b)
        if b["step"] in syncs:
            periods.append(current)
            current = []
    return periods + ([current] if current else [])


def _shown(periods: list[list[dict]], syncs: dict, show_all: bool):
    """("rows", period) for the periods to print — the first, each unlike every one before it,
    and the last — and ("skip", [periods…]) for each run of repeats between them."""
    def signature(period):
        return tuple((b["staleness_updates"], b["staleness_at_launch_updates"],
                      b["staleness_generating_updates"], b["staleness_queued_updates"],
                      b["committed_updates"], syncs[b["step"]].detail["reasons"] if b["step"] in syncs
                      else ()) for b in period)

    seen, skipped = set(), []
    for i, period in enumerate(periods):
        sig = signature(period)
        if show_all or i in (0, len(periods) - 1) or sig not in seen:
            if skipped:
                yield "skip", skipped
                skipped = []
            yield "rows", period
        else:
            skipped.append(period)
        seen.add(sig)


def _window(sim: Simulation, periods: list[list[dict]], shown: int = 4) -> float | None:
    """The virtual time by which the first ``shown`` sync periods have trained (None: all)."""
    if len(periods) <= shown:
        return None
    last = periods[shown - 1][-1]["index"]
    ends = [e.end or e.t for e in sim.trace.of_kind("train") if e.batch == last]
    return ends[0] if ends else None


def render_timeline(sim: Simulation, *, width: int = 72, until: float | None = None) -> str:
    """Lanes of generation (one per engine), training and sync over virtual time, from 0 to
    ``until`` (default: the whole run)."""
    end = (until or sim.makespan) or 1.0
    scale = width / end

    def lane(spans: list[tuple[float, float, str]]) -> str:
        cells = [" "] * width
        for start, stop, mark in spans:
            if start >= end:
                continue
            a = min(width - 1, int(start * scale))
            b = max(a + 1, min(width, round(stop * scale)))
            for i in range(a, b):
                cells[i] = mark
        return "".join(cells)

    marks = "0123456789abcdefghijklmnopqrstuvwxyz"
    window = f"the first {end:.2f}s of {sim.makespan:.2f}s" if until else f"0 → {end:.2f}s"
    lines = [f"timeline ({window}, one column ≈ {end / width:.3g}s; digits are batch indices mod 36):"]
    for w in range(sim.timings.workers):
        spans = [(st, en, marks[i % 36]) for eng, st, en, i in sim.pool.spans if eng == w]
        lines.append(f"  gen{w:<3d}|{lane(spans)}|")
    train = [(e.t, e.end or e.t, marks[(e.batch or 0) % 36]) for e in sim.trace.of_kind("train")]
    lines.append(f"  train |{lane(train)}|")
    sync = [(e.t, max(e.end or e.t, e.t + end / width / 2), "S" if e.detail["published"] else "d")
            for e in sim.trace.of_kind("sync")]
    lines.append(f"  sync  |{lane(sync)}|")
    return "\n".join(lines)
