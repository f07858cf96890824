"""The composition root: from a recipe to the parts of a run.

Every choice between plug-ins is made here and nowhere else: the policy family, the rollout
backend and engine (``tether.registry``), and the learner's layout — one process, ranks on this
machine, or Ray actors (``learner_layout``). The recipe was checked when it was read
(``tether.config.features``: what each plug-in owns and supports); what can be known only on this
machine (is vLLM installed, can the native decoder be built, is Ray importable) is checked by
``Parts.check_here`` before anything starts. ``tether.runtime.run`` then wires the parts to the
driver loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether import registry
from tether.config import Config
from tether.control import AdmissionNote
from tether.vocabulary import DataBundle, Evaluate, Family

log = logging.getLogger("tether.run")


@dataclass
class Prepared:
    """What was built and checked before any process starts."""

    model_path: Path
    data: DataBundle
    score: Any


def learner_layout(cfg: Config) -> str:
    """Where the learner runs: ``process`` (in the driver), ``ranks`` (train.world_size processes
    of this machine) or ``actor`` (Ray actors, one per rank; ray.learner=actor)."""
    if cfg.ray.learner == "actor":
        return "actor"
    return "ranks" if cfg.train.world_size > 1 else "process"


@dataclass
class Parts:
    """The plug-ins a recipe chose."""

    cfg: Config
    family: Family
    backend: Any
    engine: Any
    layout: str

    def check_here(self) -> None:
        """Refuse, before anything starts, what cannot run in this Python: the backend's own
        needs, — where the workers run this Python (local workers) — the engine's, and where the
        learner runs here, its precision on its device."""
        self.backend.check_here(self.cfg)
        if self.backend.local_workers:
            self.engine.check_here(self.cfg)
        if self.layout != "actor":  # the learner runs here: can its device compute in train.dtype
            from tether.modeling import check_dtype_on_device

            check_dtype_on_device(self.cfg.train.dtype, self.cfg.train.device)

    def prepare(self, *, progress_plain: bool | None = None) -> Prepared:
        """Model (built and warm-started if asked), data and reward, all checked; no process started."""
        from tether.data.prepare import ensure_model
        from tether.modeling import is_model_dir
        from tether.runtime.progress import Progress

        cfg, family = self.cfg, self.family
        score = family.scorer(cfg)
        if is_model_dir(cfg.model.path):
            model_path = ensure_model(cfg)
        else:
            with Progress(cfg.warmstart.max_steps, "warm start", fields=family.warmstart_fields,
                          plain=progress_plain, eta_label="at most") as progress:
                model_path = ensure_model(cfg, progress.update)
        if cfg.train.lora_rank:  # LoRA's targets, on the model's skeleton (tether.adapters.check)
            from tether.adapters import check

            check(model_path, cfg.train)
        data = family.data(cfg, model_path)
        if data.skipped_long_prompts:
            log.warning("skipped %d prompts longer than data.max_prompt_tokens=%d", data.skipped_long_prompts,
                        cfg.data.max_prompt_tokens)
        return Prepared(model_path=model_path, data=data, score=score)

    def notes(self, cpus: int | None = None) -> list[AdmissionNote]:
        """What the recipe's processes cost on this machine, where it costs (``cpus``: the CPUs this
        process may use)."""
        cfg = self.cfg
        cpus = len(os.sched_getaffinity(0)) if cpus is None else cpus
        here = self.backend.local_workers or not cfg.ray.address  # a local Ray instance runs here too
        learner = cfg.train.threads * cfg.train.world_size if (self.layout != "actor" or here) else 0
        rollout = cfg.rollout.num_workers * cfg.rollout.threads_per_worker if here else 0
        if learner + rollout <= cpus:
            return []
        ranks = (f"{cfg.train.world_size} learner ranks × train.threads={cfg.train.threads}"
                 if cfg.train.world_size > 1 else f"the learner's train.threads={cfg.train.threads}")
        return [AdmissionNote(
            "oversubscribed",
            f"{ranks} and {cfg.rollout.num_workers} rollout worker(s) × rollout.threads_per_worker="
            f"{cfg.rollout.threads_per_worker} want {learner + rollout} threads on {cpus} CPUs: they take "
            "turns on the cores, so every step is slower than the threads suggest (ranks also wait in each "
            "collective for the slowest, and each takes seconds to start); lower train.world_size or the "
            "thread counts to fit, unless the run is a check of the layout itself")]

    def session(self, run_dir: Path) -> contextlib.AbstractContextManager[Any]:
        """What the backend holds open for the run (a Ray session, or nothing)."""
        return self.backend.session(self.cfg, run_dir)

    def start_early(self) -> None:
        """Start what the learner's ranks and the backend's workers will wait for (the fork server
        they start from: ``tether.procinfo.child_context``), so that it overlaps the learner's build."""
        if self.layout == "ranks":
            from tether.procinfo import start_child_server

            start_child_server()
        self.backend.warm_up(self.cfg)

    def learner(self, prepared: Prepared, session: Any, stack: contextlib.ExitStack,
                run_dir: Path | None = None) -> tuple[Any, Evaluate]:
        """(learner, held-out evaluator) in the recipe's layout; whatever it starts is closed by
        ``stack``."""
        layout = registry.learner_layouts.get(self.layout)
        return layout(self.cfg, prepared, session, stack, run_dir)

    def pool(self, prepared: Prepared, batches: Any, weights: Any, session: Any, *,
             initial_version: int = 0) -> Any:
        """The rollout pool (its workers started, holding ``weights`` as ``initial_version``)."""
        from tether.rollout.settings import PoolSettings

        settings = PoolSettings(self.cfg, str(prepared.model_path), prepared.data.stop_text)
        return self.backend.pool(settings, batches, weights, session, initial_version=initial_version,
                                 extras=extra_prompts(self.cfg, prepared.data.train))


def assemble(cfg: Config) -> Parts:
    """The family, backend, engine and learner layout ``cfg`` chose."""
    return Parts(cfg=cfg, family=cfg.family(), backend=registry.backends.get(cfg.rollout.backend),
                 engine=registry.engines.get(cfg.rollout.engine), layout=learner_layout(cfg))


def extra_prompts(cfg: Config, examples):
    """Dynamic sampling's extra prompts: batch k's own slice of a second stream over the data."""
    dynamic = cfg.dynamic_sampling()
    if dynamic is None:
        return None
    from tether.data.stream import PromptStream

    per_batch = dynamic.extra_per_batch(cfg.rollout.batch_size)
    return PromptStream(examples, per_batch, seed=cfg.run.seed, name="extra").batch


# -- the learner layouts (``tether.registry.learner_layouts``) --------------------------------------


def in_process(cfg: Config, prepared: Prepared, session: Any, stack: contextlib.ExitStack,
               run_dir: Path | None) -> tuple[Any, Evaluate]:
    """A ``TorchLearner`` in this process, evaluated on its own model."""
    from tether.train.learner import TorchLearner

    learner = TorchLearner(prepared.model_path, cfg)
    evaluate = cfg.family().evaluator(cfg, learner.model, learner.tokenizer, prepared.data, prepared.score,
                                      run_dir=run_dir)
    return learner, learner.evaluating(evaluate)  # in the training forward's dtype, on the EMA's weights


def local_ranks(cfg: Config, prepared: Prepared, session: Any, stack: contextlib.ExitStack,
                run_dir: Path | None) -> tuple[Any, Evaluate]:
    """``train.world_size`` FSDP2 ranks as processes of this machine; rank 0 evaluates."""
    from tether.train.ranks import ProcessRanks, RankGroup

    group = RankGroup(ProcessRanks(cfg, prepared.model_path, _held_out(prepared), run_dir=run_dir))
    stack.callback(group.close)
    log.info("learner: %d ranks ready (pids %s)", group.world, group.pids)
    return group, group.evaluate


def ray_actors(cfg: Config, prepared: Prepared, session: Any, stack: contextlib.ExitStack,
               run_dir: Path | None) -> tuple[Any, Evaluate]:
    """The learner as Ray actors, one per rank, in one placement group; rank 0 evaluates and puts
    the weights into the object store."""
    from tether.rollout.backends.ray.cluster import RayOptions, check_fits, check_resources
    from tether.train.ranks import RankGroup
    from tether.train.ray_ranks import ActorRanks, check_placement

    # before any actor starts: the custom resources, the ranks alone, then the ranks beside the
    # rollout actors
    check_resources(session.ray, cfg.rollout.num_workers, RayOptions.of(cfg))
    check_placement(session.ray, cfg)
    check_fits(session.ray, cfg.rollout.num_workers, RayOptions.of(cfg))
    transport = ActorRanks(session.ray, cfg, str(prepared.model_path), _held_out(prepared), run_dir=run_dir)
    group = RankGroup(transport)
    stack.callback(group.close)
    if group.world == 1:
        log.info("ray: learner actor ready (pid %s) on node %s", group.pids[0], str(transport.nodes[0])[:8])
    else:
        log.info("ray: %d learner rank actors ready (pids %s) on nodes %s in placement group(s) %s (%s)",
                 group.world, group.pids, ", ".join(str(n)[:8] for n in transport.nodes),
                 sorted(set(map(str, transport.placement))), cfg.ray.learner_placement)
    return group, group.evaluate


def _held_out(prepared: Prepared) -> DataBundle:
    """What a rank needs of the data: the held-out split (rank 0 evaluates), not the train split."""
    return dataclasses.replace(prepared.data, train=[])
