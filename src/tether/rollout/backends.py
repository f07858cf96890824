"""Where rollout workers run (``rollout.backend``), as plug-ins.

A backend plug-in says which recipe section is its own, checks its own keys, opens what the run
needs of it for its whole length (a Ray session), and builds the ``RolloutPool``. Importing this
module loads neither torch nor Ray.

    local   worker processes of this machine, weights through shared memory (``ProcessPool``)
    ray     Ray actors, weights through Ray's object store (``RayPool``); its section ``ray``
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether.errors import ConfigError


@dataclass(frozen=True)
class BackendPlugin:
    """One ``rollout.backend`` choice."""

    name: str
    section: str | None = None
    """The recipe section only this backend reads."""
    keys: tuple[str, ...] = ()
    supervised: bool = False
    """Train in a child process with ``tether train`` as its parent, which reports an end the run
    could not (``tether.runtime.supervise``)."""
    local_workers: bool = True
    """Its workers run this Python on this machine, so what they need is checked here at once."""

    def check(self, cfg: Any) -> None:
        """Rules of its own keys (config time)."""

    def check_here(self, cfg: Any) -> None:
        """Refuse at once, before anything starts, a backend this Python cannot drive."""

    def session(self, cfg: Any, run_dir: Path) -> contextlib.AbstractContextManager[Any]:
        """What the run holds open for this backend; yields it (or None) to ``pool``."""
        return contextlib.nullcontext()

    def pool(self, settings: Any, batches: Callable[[int], Sequence[Any]], weights: Any, session: Any, *,
             initial_version: int, extras: Callable[[int], Sequence[Any]] | None) -> Any:
        raise NotImplementedError


class _Local(BackendPlugin):
    def pool(self, settings, batches, weights, session, *, initial_version, extras):
        from tether.rollout.pool import ProcessPool

        return ProcessPool(settings, batches, weights, initial_version=initial_version, extras=extras)


class _Ray(BackendPlugin):
    def check_here(self, cfg: Any) -> None:
        from tether.rollout.ray_pool import require_ray

        require_ray()

    def check(self, cfg: Any) -> None:
        r = cfg.ray
        if r.learner_placement != "PACK" and (r.learner != "actor" or cfg.train.world_size == 1):
            raise ConfigError(f"ray.learner_placement={r.learner_placement} places learner ranks, which "
                              "exist only with ray.learner=actor and train.world_size > 1; set both, or "
                              "remove ray.learner_placement")

    @contextlib.contextmanager
    def session(self, cfg: Any, run_dir: Path):
        from tether.rollout.ray_pool import RayOptions, RaySession

        session = RaySession(RayOptions.of(cfg), run_dir)
        try:
            yield session
        finally:
            session.close()

    def pool(self, settings, batches, weights, session, *, initial_version, extras):
        from tether.rollout.ray_pool import RayOptions, RayPool

        return RayPool(settings, batches, weights, options=RayOptions.of(settings.cfg), session=session,
                       initial_version=initial_version, extras=extras)


LOCAL = _Local("local")
RAY = _Ray("ray", section="ray", supervised=True, local_workers=False)
