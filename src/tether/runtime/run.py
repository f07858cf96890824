"""``tether train``: recipe → parts (``tether.runtime.assemble``) → model, data, reward → rollout
workers and learner → the driver loop.

Everything that can be checked without starting a process is checked first (config, what this
Python can run, model path, data, reward), so a bad recipe fails before any worker exists.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path

from tether.config import Config
from tether.control import AsyncControl, admission_notes
from tether.errors import ConfigError, NothingLearnedError
from tether.loop import Driver, LoopState, Observers, TraceRecorder
from tether.runtime.assemble import Prepared, assemble

log = logging.getLogger("tether.run")


def _refuse_nonempty(run_dir: Path, *, locked: bool = False) -> None:
    """A new run needs an empty directory, or one whose earlier start never trained a batch (a
    start that failed or was stopped before its first batch: it is reused, ``rundir.never_trained``)."""
    from tether.paths import check_folder_to_write
    from tether.runtime.rundir import LOCK_NAME, RunLock, never_trained

    check_folder_to_write(run_dir, "--run-dir")
    used = run_dir.exists() and any(p.name != LOCK_NAME for p in run_dir.iterdir())
    if used and not never_trained(run_dir):
        raise ConfigError(f"run directory {run_dir} already exists and is not empty; pass --resume {run_dir} "
                          "to continue it, or choose another --run-dir")
    if used and not locked:  # a start still before its first batch holds it: refused now, not after preparing
        RunLock(run_dir).acquire().release()


def claim_run_dir(run_dir: Path, cfg: Config, prepared: Prepared, *, resume: bool, force: bool,
                  overrides: Sequence[str]):
    """Lock ``run_dir`` for this process, clean what interrupted saves left, and record this
    start. A new run needs an empty directory; a resume is refused when it would change the run
    (``rundir.check_resume``) or has nothing left to train. Returns the held lock, on resume the
    newest good checkpoint's (state, path), verified once here, and what records the start: a new
    run's is recorded here; a resume's (its config and its line in the starts) only once the
    checkpoint is restored, by calling it, so a resume that fails leaves the run as it was."""
    from tether.config import load_config
    from tether.runtime.checkpoint import Checkpointer
    from tether.runtime.rundir import (
        RunLock,
        check_resume,
        clean_leftovers,
        data_fingerprint,
        never_trained,
        record_start,
        reuse_untrained,
    )

    lock, found = RunLock(run_dir).acquire(), None

    def begin(**started) -> None:
        record_start(run_dir, overrides=list(overrides), fingerprint=fingerprint, **started)
        (run_dir / "config.yaml").write_text(cfg.to_yaml())  # the config the run continues with

    try:
        clean_leftovers(run_dir)
        fingerprint = data_fingerprint(prepared.data.train)
        if resume:
            if never_trained(run_dir):
                raise ConfigError(
                    f"nothing to resume: {run_dir} never trained a batch (no metrics row, no checkpoint); "
                    f"start the run again without --resume, with --run-dir {run_dir}: the directory is "
                    "reused")
            forced = check_resume(run_dir, load_config(run_dir / "config.yaml").to_dict(), cfg.to_dict(),
                                  fingerprint, force=force)
            found = state, ckpt = Checkpointer(run_dir / "checkpoints").newest_good()
            if state.trained_batches >= cfg.train.num_batches:
                raise ConfigError(
                    f"nothing to resume: {state.trained_batches} batches already trained of "
                    f"train.num_batches={cfg.train.num_batches}; extend it with "
                    f"train.num_batches=N (N > {state.trained_batches})")
            return lock, found, lambda: begin(resumed_from=ckpt.name, forced=forced)
        _refuse_nonempty(run_dir, locked=True)  # again under the lock: another start may have won the race
        if never_trained(run_dir):
            reuse_untrained(run_dir)
        begin(resumed_from=None)
    except BaseException:
        lock.release()
        raise
    return lock, found, lambda: None


def train(cfg: Config, run_dir: str | Path, *, resume: bool = False, force: bool = False,
          overrides: Sequence[str] = (), progress_plain: bool | None = None) -> dict:
    """Run (or resume) training into ``run_dir``; returns the summary it also writes.
    (``tether.train``, ``tether.api``, is this with Python objects and recipes in any form.)

    SIGINT and SIGTERM stop it at the next safe point with a final checkpoint
    (``tether.runtime.stopping``); the run directory is locked for the whole call."""
    from tether.runtime.stopping import StopSignals
    from tether.runtime.supervise import supervised

    if not isinstance(cfg, Config):
        raise ConfigError(f"train: cfg must be a Config (tether.load_config), got {type(cfg).__name__}; "
                          "tether.train takes a recipe path or mapping too")
    run_dir = Path(run_dir)

    with StopSignals(repeat_window_s=1.0 if supervised() else 0.0) as stop:
        return _train(cfg, run_dir, stop, resume=resume, force=force, overrides=overrides,
                      progress_plain=progress_plain)


def _train(cfg: Config, run_dir: Path, stop, *, resume: bool, force: bool, overrides: Sequence[str],
           progress_plain: bool | None) -> dict:
    import torch

    from tether.data.stream import PromptStream
    from tether.rollout.notes import sampling_notes
    from tether.runtime.checkpoint import Checkpointer
    from tether.runtime.progress import Progress
    from tether.runtime.sinks import ProgressSink, require_wandb

    if cfg.run.wandb_project:
        require_wandb()
    parts = assemble(cfg)
    parts.check_here()
    for note in [*parts.notes(), *parts.family.notes(cfg)]:
        log.warning("note %s", note)
    if not resume:
        _refuse_nonempty(run_dir)  # before a warm start that may take minutes, and before the lock
    prepared = parts.prepare(progress_plain=progress_plain)
    torch.set_num_threads(cfg.train.threads)
    for note in sampling_notes(cfg.sampling()):
        log.info("note %s", note)
    stream = PromptStream(prepared.data.train, cfg.rollout.batch_size, seed=cfg.run.seed)
    trace = TraceRecorder()
    with contextlib.ExitStack() as stack:
        lock, found, begin = claim_run_dir(run_dir, cfg, prepared, resume=resume, force=force,
                                           overrides=overrides)
        stack.callback(lock.release)
        session = stack.enter_context(parts.session(run_dir))
        stop.reinstall()  # a Ray session installs handlers of its own
        parts.start_early()
        learner, evaluate = parts.learner(prepared, session, stack, run_dir)
        state, engine_weights, engine_version = _restore(found, learner, run_dir)
        begin()
        hooks = _Hooks(evaluate, Checkpointer(run_dir / "checkpoints", keep=cfg.checkpoint.keep), learner)
        wall_start = time.time()
        sinks = stack.enter_context(_sinks(cfg, run_dir, wall_start))
        with Progress(cfg.train.num_batches, "train", fields=ProgressSink.FIELDS,
                      plain=progress_plain) as progress:
            if state is not None:
                progress.update(state.trained_batches, {})
            weights = learner.export_weights() if engine_weights is None else engine_weights
            hooks.pool = stack.enter_context(parts.pool(prepared, stream.batch, weights, session,
                                                        initial_version=engine_version or 0))
            notes = admission_notes(cfg.budget(), anchor=cfg.train.anchor)
            for note in notes:  # shown at start, not only logged: each says what a number buys
                log.warning("note %s", note)
            driver = Driver(AsyncControl(cfg.budget()), hooks.pool, learner, hooks=hooks,
                            observer=Observers(trace, *sinks, ProgressSink(progress)),
                            wait_timeout_s=cfg.async_.wait_timeout_s, notes=notes)
            stop.attach(driver)
            try:
                final = driver.run(state)
            finally:
                stop.detach()
    summary = summarize_run(cfg, trace, final, time.time() - wall_start, run_dir)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _check_learned(trace, final, started=state or LoopState())
    return summary


def _check_learned(trace: TraceRecorder, final: LoopState, *, started: LoopState) -> None:
    """A run that trained batches and committed no update fails, saying why (its run directory is
    complete: the summary says the same)."""
    records = trace.records
    if not records or final.train_version != started.train_version:
        return
    counts = {key: int(sum(r.metrics.get(key, 0.0) for r in records))
              for key in ("train/skipped_no_signal", "train/skipped_nonfinite_grad")}
    raise NothingLearnedError(
        f"{len(records)} batches trained and no update committed: {counts['train/skipped_no_signal']} had "
        "nothing to learn from (no token in the loss with a non-zero advantage: every group's rewards equal "
        f"— see reward/std and reward/frac_zero_std — or every sample masked) and "
        f"{counts['train/skipped_nonfinite_grad']} a non-finite gradient (see mismatch/* and ratio/max). "
        "The weights are those the run started with; make the reward vary within groups, or look at what "
        "sets the loss (the flow section's noise, the corrections, train.lr)")


@contextlib.contextmanager
def _sinks(cfg: Config, run_dir: Path, wall_start: float):
    """Where every batch's metrics go: metrics.jsonl, TensorBoard, and W&B when asked; and its
    samples, where the family records them (``Family.recorders``); closed at the end however the
    run ends."""
    from tether.runtime.sinks import JsonlSink, TensorBoardSink, WandbSink

    sinks: list = [JsonlSink(run_dir, wall_start=wall_start), TensorBoardSink(run_dir),
                   *cfg.family().recorders(cfg, run_dir)]
    if cfg.run.wandb_project:
        sinks.append(WandbSink(cfg.run.wandb_project, run_dir, cfg.to_dict()))
    try:
        yield sinks
    finally:
        for sink in sinks:
            sink.close()


def _restore(found, learner, run_dir: Path) -> tuple[LoopState | None, object, int | None]:
    """On resume: the learner loaded from the checkpoint ``found``, the logs trimmed to it, and
    the loop state with the weights and version the engines start with (``_engine_start``)."""
    if found is None:
        return None, None, 0
    from tether.runtime.checkpoint import published_weights, trim_jsonl
    from tether.runtime.rundir import STARTS_NAME

    state, ckpt = found
    learner.load(ckpt / "learner")
    log.info("resuming from %s: %d batches trained, train version %d", ckpt, state.trained_batches,
             state.train_version)
    for path in sorted(run_dir.glob("*.jsonl")):  # metrics, evals, a family's records (by step)
        if path.name not in (STARTS_NAME, "events.jsonl"):
            trim_jsonl(path, state.trained_batches)
    return (state, *_engine_start(state, ckpt, published_weights(ckpt)))


def _engine_start(state: LoopState, ckpt: Path, published):
    """(weights, version) the engines start a resume with. When the checkpoint was written with
    the engines behind the learner (a stop between publications) they get those very weights
    back, so the abandoned batches are generated again under the version the engines held: the
    one they were launched with when publications drain, no older than it otherwise.
    (None, None): the learner's weights, published before anything is launched (a checkpoint
    written before the engines' version was recorded)."""
    if state.rollout_version is None:
        log.warning("checkpoint %s does not record the engines' version (written by an older Tether); "
                    "publishing the learner's weights first: batches generated after the resume may be "
                    "less stale than in an uninterrupted run", ckpt)
        return None, None
    if state.rollout_version == state.train_version:
        return None, state.train_version
    log.info("the engines held version %d at the stop: loading it back (the learner is at %d)",
             state.rollout_version, state.train_version)
    return published, state.rollout_version


class _Hooks:
    """Evaluate and checkpoint at hard boundaries (and at a stop)."""

    def __init__(self, evaluate, checkpointer, learner) -> None:
        self.evaluate_at = evaluate
        self.checkpointer = checkpointer
        self.learner = learner
        self.pool = None  # set once the workers run: a stop's checkpoint keeps what they hold

    def evaluate(self, step: int, version: int):
        return self.evaluate_at(step)

    def save(self, step: int, state: LoopState) -> None:
        published = None
        if state.rollout_version != state.train_version:  # a stop between two publications
            published = self.pool.published_weights()
        self.checkpointer.save(step, state, self.learner, published=published)


def _finite_max(values) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return max(finite) if finite else None


def summarize_run(cfg: Config, trace: TraceRecorder, final: LoopState, wall_s: float, run_dir: Path) -> dict:
    records = trace.records
    evals = trace.evals
    staleness = [r.staleness_batches for r in records]
    first_eval = evals[0][1].get("eval/pass_at_1") if evals else None
    last_eval = evals[-1][1].get("eval/pass_at_1") if evals else None
    samples = sum(cfg.rollout.batch_size * cfg.rollout.group_size for _ in records)
    return {
        "run_dir": str(run_dir),
        "trained_batches": final.trained_batches,
        "train_version": final.train_version,
        "dropped_batches": final.dropped_batches,
        "wall_s": wall_s,
        "samples_per_s": samples / wall_s if wall_s > 0 else 0.0,
        "eval_pass_at_1_first": first_eval,
        "eval_pass_at_1_last": last_eval,
        "eval_pass_at_1_gain": (last_eval - first_eval) if evals else None,
        "evals": [{"step": s, **m} for s, m in evals],
        "memory_peak_mb": {
            "trainer": max((r.metrics.get("memory/trainer_peak_mb", 0.0) for r in records), default=0.0),
            "rollout_worker": max((r.metrics.get("memory/rollout_peak_mb", 0.0) for r in records),
                                  default=0.0),
        },
        # how off-policy the run was, beyond staleness: the largest engine-vs-trainer log-prob
        # difference overall (staleness and numerics) and on same-weight tokens (numerics alone)
        "logprob_abs_diff_max": _finite_max(r.metrics.get("mismatch/logprob_abs_diff_max") for r in records),
        "numeric_logprob_abs_diff_max": _finite_max(
            r.metrics.get("mismatch/numeric_logprob_abs_diff_max") for r in records),
        "is_weight_max": _finite_max(r.metrics.get("ratio/is_weight_max") for r in records),
        "staleness_batches_max": max(staleness, default=0.0),
        "staleness_batches_mean": sum(staleness) / len(staleness) if staleness else 0.0,
        "syncs_after": [e.detail["step"] for e in trace.of_kind("sync") if e.detail.get("published")],
        "notes": [{"code": c, "message": m} for c, m in trace.notes],
    }
