"""``tether plan``: run the real driver loop in virtual time and show what it would do."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from tether.config import Config, load_config
from tether.errors import ConfigError
from tether.loop.virtual import Simulation, Timings, plan_document, simulate

# flag → recipe key; a flag wins over the recipe and over key=value overrides.
FLAG_KEYS = {
    "max_staleness": "async.max_staleness",
    "updates_per_batch": "train.updates_per_batch",
    "num_batches": "train.num_batches",
    "max_inflight": "async.max_inflight",
    "sync_when_idle": "async.sync_when_idle",
    "eval_interval": "eval.interval",
    "save_interval": "checkpoint.interval",
    "workers": "rollout.num_workers",
    "commits": "plan.commits",
    "gen_time": "plan.gen_time",
    "gen_jitter": "plan.gen_jitter",
    "train_time": "plan.train_time",
    "sync_time": "plan.sync_time",
    "seed": "plan.seed",
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
    p.add_argument("--eval-interval", type=int, help="eval every N batches, 0 = off (eval.interval)")
    p.add_argument("--save-interval", type=int,
                   help="checkpoint every N batches, 0 = off (checkpoint.interval)")
    p.add_argument("--workers", type=int, help="engines generating concurrently (rollout.num_workers)")
    p.add_argument("--commits", type=str,
                   help="committed updates per consumed batch, cycled, e.g. 2,1,2 (plan.commits)")
    p.add_argument("--gen-time", type=float, help="seconds per rollout batch (plan.gen_time)")
    p.add_argument("--gen-jitter", type=float,
                   help="coefficient of variation of generation time (plan.gen_jitter)")
    p.add_argument("--train-time", type=float, help="seconds per optimizer update (plan.train_time)")
    p.add_argument("--sync-time", type=float, help="seconds per weight publication (plan.sync_time)")
    p.add_argument("--seed", type=int, help="seed for generation-time jitter (plan.seed)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    p.add_argument("--width", type=int, default=72, help="timeline width in characters")
    p.set_defaults(func=run)


def split_recipe_args(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """The first positional is a recipe unless it is a key=value override."""
    if args and "=" not in args[0]:
        return args[0], list(args[1:])
    for a in args:
        if "=" not in a:
            raise ConfigError(f"{a!r} is not a key=value override; only the first argument may be a recipe")
    return None, list(args)


def config_from_args(ns: argparse.Namespace) -> Config:
    recipe, overrides = split_recipe_args(ns.args)
    for flag, key in FLAG_KEYS.items():
        value = getattr(ns, flag)
        if value is not None:
            overrides.append(f"{key}={value}")
    return load_config(recipe, overrides)


def timings_of(cfg: Config) -> Timings:
    p = cfg.plan
    return Timings(gen_time=p.gen_time, gen_jitter=p.gen_jitter, train_time=p.train_time,
                   sync_time=p.sync_time, eval_time=p.eval_time, save_time=p.save_time,
                   workers=cfg.rollout.num_workers, commits=tuple(p.commits), seed=p.seed)


def run(ns: argparse.Namespace) -> int:
    cfg = config_from_args(ns)
    sim = simulate(cfg.budget(), timings_of(cfg), num_groups=cfg.rollout.batch_size,
                   group_size=cfg.rollout.group_size, anchor=cfg.train.anchor)
    doc = plan_document(sim)
    if ns.json:
        print(json.dumps(doc, indent=2))
    else:
        print(render_text(sim, doc, width=ns.width))
    return 0


def render_text(sim: Simulation, doc: dict, *, width: int = 72) -> str:
    s = sim.settings
    out = [
        f"tether plan: S={s.max_staleness} batches, U={s.updates_per_batch} updates/batch, "
        f"{s.total_batches} batches, max_inflight={s.max_inflight}, workers={sim.timings.workers}",
        f"  staleness_budget = S·U = {doc['staleness_budget']} updates   "
        f"admission_depth = S+1 = {doc['admission_depth']} batches   "
        f"weights published {s.describe_sync_schedule()}",
        "",
    ]
    if doc["notes"]:
        out.append("notes:")
        out += [f"  [{n['code']}] {n['message']}" for n in doc["notes"]]
        out.append("")
    syncs = {e.detail["step"]: e for e in sim.trace.of_kind("sync")}
    consumed_at = {e.batch: e.t for e in sim.trace.of_kind("consume")}
    out.append(" step  batch  behavior  trained at  staleness        committed  consumed (s)  then")
    out.append("                version   version     updates batches")
    for b in doc["batches"]:
        e = syncs.get(b["step"])
        then = ""
        if e is not None:
            why = "+".join(e.detail["reasons"])
            then = f"publish v{e.version} ({why})" if e.detail["published"] else f"drain ({why})"
        out.append(
            f" {b['step']:4d}  {b['index']:5d}  {b['behavior_version']:8d}  {b['train_version']:10d}"
            f"  {b['staleness_updates']:7d} {b['staleness_batches']:7.2f}  {b['committed_updates']:9d}"
            f"  {consumed_at.get(b['index'], 0.0):12.2f}  {then}"
        )
    sm = doc["summary"]
    out += [
        "",
        f"publications after batches: {', '.join(map(str, doc['syncs_after'])) or 'none'}",
        f"staleness (batches): max {sm['max_staleness_batches']:g}, mean "
        f"{sm['mean_staleness_batches']:.2f}, histogram {sm['staleness_histogram_batches']}",
        f"time: {sm['makespan_s']:.2f}s total, {sm['mean_step_time_s']:.3f}s per batch; trainer "
        f"idle {sm['trainer_idle_fraction']:.0%}, generators idle {sm['generator_idle_fraction']:.0%}",
        "",
        render_timeline(sim, width=width),
    ]
    return "\n".join(out)


def render_timeline(sim: Simulation, *, width: int = 72) -> str:
    """Lanes of generation (one per engine), training and sync over virtual time."""
    end = sim.makespan or 1.0
    scale = width / end

    def lane(spans: list[tuple[float, float, str]]) -> str:
        cells = [" "] * width
        for start, stop, mark in spans:
            a = min(width - 1, int(start * scale))
            b = max(a + 1, min(width, round(stop * scale)))
            for i in range(a, b):
                cells[i] = mark
        return "".join(cells)

    marks = "0123456789abcdefghijklmnopqrstuvwxyz"
    lines = [f"timeline (0 → {end:.2f}s, one column ≈ {end / width:.3g}s; digits are batch indices mod 36):"]
    for w in range(sim.timings.workers):
        spans = [(st, en, marks[i % 36]) for eng, st, en, i in sim.pool.spans if eng == w]
        lines.append(f"  gen{w:<3d}|{lane(spans)}|")
    train = [(e.t, e.end or e.t, marks[(e.batch or 0) % 36]) for e in sim.trace.of_kind("train")]
    lines.append(f"  train |{lane(train)}|")
    sync = [(e.t, max(e.end or e.t, e.t + end / width / 2), "S" if e.detail["published"] else "d")
            for e in sim.trace.of_kind("sync")]
    lines.append(f"  sync  |{lane(sync)}|")
    return "\n".join(lines)
