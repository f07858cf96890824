"""The Ray backend's plug-in (``rollout.backend=ray``): its section (``ray``), its rules, the Ray
session a run holds, and Ray actors as rollout workers (``pool.RayPool``). Importing it loads
neither torch nor Ray."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tether.config.fields import Dropped, knob, recipe_value
from tether.control.inflight import INFLIGHT_UPDATE_CHOICES
from tether.errors import ConfigError
from tether.plugins import BackendPlugin


@dataclass(frozen=True)
class RaySection:
    """The Ray backend (used when rollout.backend=ray)."""

    address: str = knob(
        "",
        "Ray cluster to connect to ('auto', 'host:6379' or 'ray://host:10001'); empty = start a "
        "local Ray instance for this run (no dashboard, no usage reporting, temp dir in the run "
        "directory) and shut it down at the end.",
    )
    local_cpus: int = knob(
        0, "CPUs the local Ray instance offers (0 = all of this machine's). Ignored with ray.address.",
        min=0,
    )
    cpus_per_worker: float = knob(
        0.0, "CPUs each rollout actor requests (0 = rollout.threads_per_worker).", min=0
    )
    learner: Literal["driver", "actor"] = knob(
        "driver",
        "Where the learner (and held-out evaluation) runs: 'driver' = in the `tether train` "
        "process; 'actor' = in a Ray actor of its own requesting train.threads CPUs, its weights "
        "going straight from it to the object store. With 'actor' on a cluster, the run directory "
        "must be on a filesystem the learner's node sees (it writes the checkpoints).",
        feature="learner_actor",
    )
    learner_placement: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = knob(
        "PACK",
        "With ray.learner=actor and train.world_size > 1: the Ray placement group strategy of the "
        "ranks' bundles (train.threads CPUs each, plus one GPU when train.device is CUDA), reserved "
        "together before any rank starts. PACK = as few nodes as fit (one node's fast links when it "
        "has room); STRICT_PACK = one node or refuse; SPREAD / STRICT_SPREAD = across nodes.",
        dropped=Dropped("with train.world_size=1, or ray.learner other than actor", lambda recipe: (
            "it places learner ranks, and train.world_size=1"
            if recipe_value(recipe, "train.world_size", 1) == 1
            else "it places learner actors, and ray.learner is not actor"
            if recipe_value(recipe, "ray.learner", "driver") != "actor" else None)),
    )
    gpus_per_worker: float = knob(
        0.0,
        "GPUs each rollout actor requests; above 0 the actor's engine samples on its GPU (CUDA, "
        "float32 weights copied in at every publication; fractions share a GPU). 0 = sample on "
        "CPUs. The learner trains where train.device says.",
        min=0,
    )
    learner_resources: dict[str, float] = knob(
        {},
        "With ray.learner=actor: Ray custom resources the learner's actor (each rank's actor, and "
        "its placement group bundle) requests besides its CPUs and GPU, e.g. {trainer: 1} to place it "
        "on the nodes started with `ray start --resources '{\"trainer\": 1}'`. Empty = any node.",
    )
    worker_resources: dict[str, float] = knob(
        {},
        "Ray custom resources every rollout actor requests besides ray.cpus_per_worker and "
        "ray.gpus_per_worker, e.g. {sampler: 1} to place them on the nodes started with that "
        "resource. Empty = any node.",
    )


# Ray's own resources, requested through their own keys
_BUILT_IN = {
    ("worker_resources", "CPU"): "ray.cpus_per_worker", ("learner_resources", "CPU"): "train.threads",
    ("worker_resources", "GPU"): "ray.gpus_per_worker", ("learner_resources", "GPU"): "train.device",
}


class _Ray(BackendPlugin):
    def worker_device(self, cfg: Any) -> str:
        return "cuda" if cfg.ray.gpus_per_worker > 0 else "cpu"

    def check_here(self, cfg: Any) -> None:
        from tether.rollout.backends.ray.cluster import require_ray

        require_ray()

    def check(self, cfg: Any) -> None:
        r = cfg.ray
        if r.learner_placement != "PACK" and (r.learner != "actor" or cfg.train.world_size == 1):
            raise ConfigError(f"ray.learner_placement={r.learner_placement} places learner ranks, which "
                              "exist only with ray.learner=actor and train.world_size > 1; set both, or "
                              "remove ray.learner_placement")
        if r.learner_resources and r.learner != "actor":
            raise ConfigError("ray.learner_resources places the learner's Ray actor, and ray.learner="
                              f"{r.learner}; set ray.learner=actor, or remove ray.learner_resources")
        for key in ("learner_resources", "worker_resources"):
            for name, amount in getattr(r, key).items():
                if name in ("CPU", "GPU", "memory", "object_store_memory"):
                    instead = _BUILT_IN.get((key, name))
                    raise ConfigError(f"ray.{key} names Ray's built-in resource {name!r}; "
                                      + (f"request it with {instead}" if instead else
                                         "it is not a resource to place actors by") + ", and remove it from "
                                      f"ray.{key}")
                if amount <= 0:
                    raise ConfigError(f"ray.{key}[{name!r}] must be > 0, got {amount:g}; remove the "
                                      "entry to request none")
        if cfg.rollout.weight_sync == "collective" and r.learner == "actor":
            raise ConfigError("rollout.weight_sync=collective broadcasts from the driver's process, and "
                              "ray.learner=actor keeps the weights in the learner's actor; set ray.learner="
                              "driver or rollout.weight_sync=auto")

    @contextlib.contextmanager
    def session(self, cfg: Any, run_dir: Path):
        from tether.rollout.backends.ray.cluster import RayOptions, RaySession

        session = RaySession(RayOptions.of(cfg), run_dir)
        try:
            yield session
        finally:
            session.close()

    def pool(self, settings, batches, weights, session, *, initial_version, extras):
        from tether.rollout.backends.ray.cluster import RayOptions
        from tether.rollout.backends.ray.pool import RayPool

        return RayPool(settings, batches, weights, options=RayOptions.of(settings.cfg), session=session,
                       initial_version=initial_version, extras=extras)


RAY = _Ray("ray", section=("ray", RaySection), weight_channel="object_store", other_channels=("collective",),
           inflight_updates=INFLIGHT_UPDATE_CHOICES, supervised=True,
           local_workers=False)
