"""``tether train``: recipe → model → data → rollout workers → learner → the driver loop.

Everything that can be checked without starting a process is checked first (config, model path,
data, reward), so a bad recipe fails before any worker exists.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether.config import Config
from tether.control import AsyncControl, admission_notes
from tether.errors import ConfigError
from tether.loop import Driver, LoopState, Observers, TraceRecorder
from tether.runtime.settings import learner_settings, sampling

log = logging.getLogger("tether.run")


@dataclass
class Prepared:
    """What was built and checked before any process starts."""

    model_path: Path
    data: Any
    score: Any


def prepare(cfg: Config, *, progress_plain: bool | None = None) -> Prepared:
    """Model (built if asked), data and reward, all checked; no process started."""
    from transformers import AutoTokenizer

    from tether.data.prepare import ensure_model
    from tether.data.rewards import scorer
    from tether.data.source import resolve_data
    from tether.runtime.progress import Progress

    if cfg.model.family == "flow":
        return _prepare_flow(cfg, progress_plain)
    score = scorer(cfg.reward.function, task=cfg.data.task or None)
    if cfg.rollout.backend == "ray":
        from tether.rollout.ray_pool import require_ray

        require_ray()
    if (Path(cfg.model.path) / "config.json").is_file():
        model_path = ensure_model(cfg)
    else:
        with Progress(cfg.warmstart.max_steps, "warm start", fields=("loss", "pass_at_1"),
                      plain=progress_plain, eta_label="at most") as progress:
            model_path = ensure_model(cfg, progress.update)
        warm = json.loads((model_path / "warmstart.json").read_text())
        log.info("warm start: held-out pass@1 %.1f%% → %.1f%% in %d steps, %.0fs",
                 100 * warm["pass_at_1_before"], 100 * warm["pass_at_1_after"], warm["steps"],
                 warm["seconds"])
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    data = resolve_data(cfg.data, tokenizer, seed=cfg.run.seed)
    if data.skipped_long_prompts:
        log.warning("skipped %d prompts longer than data.max_prompt_tokens=%d", data.skipped_long_prompts,
                    cfg.data.max_prompt_tokens)
    return Prepared(model_path=model_path, data=data, score=score)


def _prepare_flow(cfg: Config, progress_plain: bool | None) -> Prepared:
    from tether.data.prepare import ensure_model
    from tether.flow.task import flow_data, flow_scorer
    from tether.runtime.progress import Progress

    score = flow_scorer(cfg.reward.function, task=cfg.data.task)
    data = flow_data(cfg.data.task, cfg.data.num_train, cfg.data.num_eval, seed=cfg.run.seed)
    if (Path(cfg.model.path) / "config.json").is_file():
        return Prepared(model_path=ensure_model(cfg), data=data, score=score)
    with Progress(cfg.warmstart.max_steps, "warm start", fields=("loss", "pass_at_1", "reward"),
                  plain=progress_plain, eta_label="at most") as progress:
        model_path = ensure_model(cfg, progress.update)
    warm = json.loads((model_path / "warmstart.json").read_text())
    log.info("warm start: held-out reward %.3f → %.3f, pass@1 %.1f%% → %.1f%% in %d steps, %.0fs",
             warm["reward_before"], warm["reward_after"], 100 * warm["pass_at_1_before"],
             100 * warm["pass_at_1_after"], warm["steps"], warm["seconds"])
    return Prepared(model_path=model_path, data=data, score=score)


def _refuse_nonempty(run_dir: Path) -> None:
    from tether.runtime.rundir import LOCK_NAME

    if run_dir.exists() and any(p.name != LOCK_NAME for p in run_dir.iterdir()):
        raise ConfigError(f"run directory {run_dir} already exists and is not empty; pass --resume {run_dir} "
                          "to continue it, or choose another --run-dir")


def claim_run_dir(run_dir: Path, cfg: Config, prepared: Prepared, *, resume: bool, force: bool,
                  overrides: Sequence[str]):
    """Lock ``run_dir`` for this process, clean what interrupted saves left, and record this
    start. A new run needs an empty directory; a resume is refused when it would change the run
    (``rundir.check_resume``) or has nothing left to train. Returns the held lock and, on resume,
    the newest good checkpoint's (state, path), verified once here."""
    from tether.config import load_config
    from tether.runtime.checkpoint import Checkpointer
    from tether.runtime.rundir import (
        RunLock,
        check_resume,
        clean_leftovers,
        data_fingerprint,
        record_start,
    )

    lock, found = RunLock(run_dir).acquire(), None
    try:
        clean_leftovers(run_dir)
        fingerprint = data_fingerprint(prepared.data.train)
        if resume:
            forced = check_resume(run_dir, load_config(run_dir / "config.yaml").to_dict(), cfg.to_dict(),
                                  fingerprint, force=force)
            found = state, ckpt = Checkpointer(run_dir / "checkpoints").newest_good()
            if state.trained_batches >= cfg.train.num_batches:
                raise ConfigError(
                    f"nothing to resume: {state.trained_batches} batches already trained of "
                    f"train.num_batches={cfg.train.num_batches}; extend it with "
                    f"train.num_batches=N (N > {state.trained_batches})")
            record_start(run_dir, overrides=list(overrides), resumed_from=ckpt.name, fingerprint=fingerprint,
                         forced=forced)
        else:
            _refuse_nonempty(run_dir)  # again under the lock: another start may have won the race
            record_start(run_dir, overrides=list(overrides), resumed_from=None, fingerprint=fingerprint)
        (run_dir / "config.yaml").write_text(cfg.to_yaml())  # the config the run continues with
    except BaseException:
        lock.release()
        raise
    return lock, found


def train(cfg: Config, run_dir: Path, *, resume: bool = False, force: bool = False,
          overrides: Sequence[str] = (), progress_plain: bool | None = None) -> dict:
    """Run (or resume) training into ``run_dir``; returns the summary it also writes.

    SIGINT and SIGTERM stop it at the next safe point with a final checkpoint
    (``tether.runtime.stopping``); the run directory is locked for the whole call."""
    from tether.cli.supervise import supervised
    from tether.runtime.stopping import StopSignals

    with StopSignals(repeat_window_s=1.0 if supervised() else 0.0) as stop:
        return _train(cfg, run_dir, stop, resume=resume, force=force, overrides=overrides,
                      progress_plain=progress_plain)


def _train(cfg: Config, run_dir: Path, stop, *, resume: bool, force: bool, overrides: Sequence[str],
           progress_plain: bool | None) -> dict:
    import torch

    from tether.data.stream import PromptStream
    from tether.rollout.notes import sampling_notes
    from tether.runtime.checkpoint import Checkpointer, published_weights
    from tether.runtime.progress import Progress
    from tether.runtime.sinks import JsonlSink, ProgressSink, TensorBoardSink, WandbSink, require_wandb

    if cfg.run.wandb_project:
        require_wandb()
    check_engine_installed(cfg)
    if not resume:
        _refuse_nonempty(run_dir)  # before a warm start that may take minutes, and before the lock
    prepared = prepare(cfg, progress_plain=progress_plain)
    torch.set_num_threads(cfg.train.threads)
    checkpointer = Checkpointer(run_dir / "checkpoints", keep=cfg.checkpoint.keep)
    params = sampling(cfg)
    for note in sampling_notes(params):
        log.info("note %s", note)
    stream = PromptStream(prepared.data.train, cfg.rollout.batch_size, seed=cfg.run.seed)
    trace = TraceRecorder()
    sinks: list = []
    with contextlib.ExitStack() as stack:
        lock, found = claim_run_dir(run_dir, cfg, prepared, resume=resume, force=force, overrides=overrides)
        stack.callback(lock.release)
        session = None
        if cfg.rollout.backend == "ray":
            from tether.rollout.ray_pool import RaySession

            session = stack.enter_context(contextlib.closing(RaySession(ray_options(cfg), run_dir)))
            stop.reinstall()
        learner, evaluate = _learner(cfg, prepared, session, stack)
        if cfg.model.family == "flow":  # pictures of the fixed held-out prompts at every evaluation
            evaluate.images_to = run_dir / "samples"
        state, engine_weights, engine_version = None, None, 0
        if found is not None:
            from tether.runtime.checkpoint import trim_jsonl

            state, ckpt = found
            learner.load(ckpt / "learner")
            log.info("resuming from %s: %d batches trained, train version %d", ckpt, state.trained_batches,
                     state.train_version)
            for name in ("metrics.jsonl", "eval.jsonl"):
                trim_jsonl(run_dir / name, state.trained_batches)
            engine_weights, engine_version = _engine_start(state, ckpt, published_weights(ckpt))
        hooks = _Hooks(evaluate, checkpointer, learner)
        wall_start = time.time()
        sinks += [JsonlSink(run_dir, wall_start=wall_start), TensorBoardSink(run_dir)]
        if cfg.run.wandb_project:
            sinks.append(WandbSink(cfg.run.wandb_project, run_dir, cfg.to_dict()))
        try:
            with Progress(cfg.train.num_batches, "train", fields=ProgressSink.FIELDS,
                          plain=progress_plain) as progress:
                observer = Observers(trace, *sinks, ProgressSink(progress))
                if state is not None:
                    progress.update(state.trained_batches, {})
                weights = learner.export_weights() if engine_weights is None else engine_weights
                hooks.pool = stack.enter_context(rollout_pool(
                    cfg, _pool_settings(cfg, prepared, params), stream.batch, weights, session,
                    initial_version=engine_version or 0, extras=extra_prompts(cfg, prepared.data.train)))
                notes = admission_notes(cfg.budget(), anchor=cfg.train.anchor)
                for note in notes:  # shown at start, not only logged: each says what a number buys
                    log.warning("note %s", note)
                driver = Driver(AsyncControl(cfg.budget()), hooks.pool, learner, hooks=hooks,
                                observer=observer, wait_timeout_s=cfg.async_.wait_timeout_s, notes=notes)
                stop.attach(driver)
                try:
                    final = driver.run(state)
                finally:
                    stop.detach()
        finally:
            for sink in sinks:
                sink.close()
    summary = summarize_run(cfg, trace, final, time.time() - wall_start, run_dir)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _engine_start(state: LoopState, ckpt: Path, published):
    """(weights, version) the engines start a resume with. When the checkpoint was written with
    the engines behind the learner (a stop between publications) they get those very weights
    back, so the abandoned batches are generated again under the version they were launched
    with. (None, None): the learner's weights, published before anything is launched (a
    checkpoint written before the engines' version was recorded)."""
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


def _learner(cfg: Config, prepared: Prepared, session, stack: contextlib.ExitStack):
    """(learner, evaluate): a TorchLearner here, or one in a Ray actor (``ray.learner: actor``)."""
    if cfg.ray.learner == "actor":
        from tether.runtime.remote_learner import RemoteLearner

        learner = RemoteLearner(session.ray, cfg, str(prepared.model_path), prepared.data.eval,
                                prepared.data.stop_text)
        stack.callback(learner.close)
        if learner.world == 1:
            log.info("ray: learner actor ready (pid %s)", learner.pid)
        else:
            log.info("ray: %d learner rank actors ready (pids %s) in placement group(s) %s (%s)",
                     learner.world, learner.pids, sorted(set(map(str, learner.placement))),
                     cfg.ray.learner_placement)
        return learner, learner.evaluate
    data = prepared.data
    learner, evaluate = local_learner(cfg, prepared.model_path, data.eval, prepared.score, data.stop_text)
    if hasattr(learner, "close"):  # the ranks of a sharded learner
        stack.callback(learner.close)
        log.info("learner: %d ranks ready (pids %s)", cfg.train.world_size, learner.pids)
    return learner, evaluate


def local_learner(cfg: Config, model_path, eval_examples, score, stop_text: str):
    """A TorchLearner and the held-out evaluator that runs on its model (in this process, or in
    the learner's Ray actor); with train.world_size > 1, a ShardedLearner (its ranks in processes
    of their own) and an evaluator on a whole copy of the model here, given the ranks' current
    weights before each evaluation."""
    if cfg.train.world_size > 1:
        return _sharded_learner(cfg, model_path, eval_examples, score, stop_text)
    from tether.train.learner import TorchLearner

    learner = TorchLearner(model_path, learner_settings(cfg))
    return learner, evaluator(cfg, learner.model, learner.tokenizer, eval_examples, score, stop_text)


def _sharded_learner(cfg: Config, model_path, eval_examples, score, stop_text: str):
    from tether.modeling import copy_weights, learner_device, load_causal_lm
    from tether.train.sharded import ShardedLearner

    learner = ShardedLearner(model_path, learner_settings(cfg), world_size=cfg.train.world_size,
                             threads=cfg.train.threads)
    try:
        model, tokenizer = load_causal_lm(model_path)
        model.to(learner_device(cfg.train.device)).eval()
        held_out = evaluator(cfg, model, tokenizer, eval_examples, score, stop_text)
    except BaseException:
        learner.close()
        raise
    def evaluate(step: int):
        copy_weights(model, learner.export_weights())
        return held_out(step)

    return learner, evaluate


def evaluator(cfg: Config, model, tokenizer, examples, score, stop_text: str, *,
              num_samples: int | None = None):
    """The recipe's held-out evaluator on ``model`` (``num_samples`` overrides eval.num_samples)."""
    from tether.runtime.evaluate import Evaluator

    k = cfg.eval.num_samples if num_samples is None else num_samples
    if cfg.model.family == "flow":
        from tether.data.prepare import flow_sampling
        from tether.flow.evaluate import FlowEvaluator

        return FlowEvaluator(model, examples, score, eval_steps=cfg.flow.eval_steps,
                             sampling=flow_sampling(cfg), seed=cfg.run.seed, num_samples=k)
    return Evaluator(model, tokenizer, examples, score, stop_text=stop_text, params=sampling(cfg),
                     seed=cfg.run.seed, num_samples=k, decoder=cfg.rollout.decoder)


def _pool_settings(cfg: Config, prepared: Prepared, params):
    from tether.data.prepare import flow_sampling
    from tether.rollout.dispatch import PoolSettings

    return PoolSettings(
        model_path=str(prepared.model_path), num_workers=cfg.rollout.num_workers,
        threads_per_worker=cfg.rollout.threads_per_worker, group_size=cfg.rollout.group_size, params=params,
        reward=cfg.reward.function, task=cfg.data.task or None, stop_text=prepared.data.stop_text,
        reward_on_error=cfg.reward.on_error, seed=cfg.run.seed, dynamic=dynamic_sampling(cfg),
        engine=cfg.rollout.engine, vllm=vllm_options(cfg), decoder=cfg.rollout.decoder,
        inflight_update=cfg.async_.inflight_update,
        family=cfg.model.family, flow=flow_sampling(cfg) if cfg.model.family == "flow" else None,
    )


def check_engine_installed(cfg: Config) -> None:
    """With local workers (which run this Python on this machine), refuse at once, before
    anything starts, rollout.engine=vllm where vLLM is not installed and rollout.decoder=native
    where the native decoder cannot be built or loaded. (Ray actors may run elsewhere: there a
    worker that cannot fails its first batch, saying why.)"""
    import importlib.util

    r = cfg.rollout
    if r.engine == "torch" and r.decoder == "native" and r.backend == "local" and cfg.model.family == "lm":
        from tether.decoding import native
        from tether.errors import NativeDecoderError

        try:
            native.library("native")
        except NativeDecoderError as e:
            raise ConfigError(str(e)) from e
    if r.engine == "vllm" and r.backend == "local" and importlib.util.find_spec("vllm") is None:
        from tether.rollout.vllm_engine import INSTALL_HINT

        raise ConfigError(f"rollout.engine=vllm, but vLLM is not installed in this Python "
                          f"({sys.executable}); {INSTALL_HINT}")


def vllm_options(cfg: Config):
    """The vllm section as the engine reads it, or None with the built-in engine."""
    if cfg.rollout.engine != "vllm":
        return None
    import dataclasses

    from tether.rollout.vllm_engine import VllmOptions

    return VllmOptions(**dataclasses.asdict(cfg.vllm))


def dynamic_sampling(cfg: Config):
    """The rollout.dynamic_sampling* keys, or None when it is off."""
    from tether.rollout.dynamic import DynamicSampling

    r = cfg.rollout
    if not r.dynamic_sampling:
        return None
    return DynamicSampling(r.dynamic_sampling_max_draws, r.dynamic_sampling_on_short)


def extra_prompts(cfg: Config, examples):
    """Dynamic sampling's extra prompts: batch k's own slice of a second stream over the data."""
    if not cfg.rollout.dynamic_sampling:
        return None
    from tether.data.stream import PromptStream

    per_batch = dynamic_sampling(cfg).extra_per_batch(cfg.rollout.batch_size)
    return PromptStream(examples, per_batch, seed=cfg.run.seed, name="extra").batch


def ray_options(cfg: Config):
    from tether.rollout.ray_pool import RayOptions

    r = cfg.ray
    return RayOptions(address=r.address, local_cpus=r.local_cpus,
                      cpus_per_worker=r.cpus_per_worker or float(cfg.rollout.threads_per_worker),
                      gpus_per_worker=r.gpus_per_worker,
                      reserved_cpus=float(cfg.train.threads * cfg.train.world_size) if r.learner == "actor"
                      else 0.0, reserved_gpus=learner_gpus(cfg) * cfg.train.world_size)


def learner_gpus(cfg: Config) -> float:
    """GPUs the learner's Ray actor requests: one when it trains on CUDA, else none."""
    return 1.0 if cfg.ray.learner == "actor" and cfg.train.device != "cpu" else 0.0


def rollout_pool(cfg: Config, settings, batches, weights, session, *, initial_version: int = 0,
                 extras=None):
    """The recipe's rollout backend: local worker processes or Ray actors."""
    if cfg.rollout.backend == "ray":
        from tether.rollout.ray_pool import RayPool

        return RayPool(settings, batches, weights, options=ray_options(cfg), session=session,
                       initial_version=initial_version, extras=extras)
    from tether.rollout.pool import ProcessPool

    return ProcessPool(settings, batches, weights, initial_version=initial_version, extras=extras)


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
