"""The supervised warm-start loop every family's warm start runs (``warmstart`` recipe section).

A base model whose groups are all wrong gets zero group-relative advantage and never moves, so
RL starts from a model with a non-trivial held-out pass rate. The loop takes AdamW steps on a
family's supervised loss, checks held-out pass@1 every ``eval_every`` steps and stops as soon as
it reaches ``target_pass_rate`` — or at ``max_steps``. Steps and the target decide it, never the
clock, so the same model comes out on a fast machine and a slow one (at the same thread count,
which the caller sets); ``max_seconds`` is only a safety ceiling, and says so when it fires.
``lr_schedule`` decays the rate over ``max_steps`` (``tether.train.schedule``'s shapes, no
warm-up), so a warm start that runs its steps out ends settled rather than wherever a high constant
rate left it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tether.train.schedule import lr_factor
from tether.vocabulary import Progress

log = logging.getLogger("tether.warmstart")


@dataclass
class WarmstartResult:
    data: str
    steps: int
    seconds: float
    pass_at_1_before: float
    pass_at_1_after: float
    stopped_because: str
    history: list[dict[str, float]] = field(default_factory=list)
    before: dict[str, float] = field(default_factory=dict)
    """Every held-out figure before the first step (``pass_at_1``, and what else the family measures)."""
    after: dict[str, float] = field(default_factory=dict)
    """The same figures at the end."""


def warmstart_loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   loss_at: Callable[[int], torch.Tensor], evaluate: Callable[[], Mapping[str, float]],
                   settings: Any, *, data: str,
                   on_progress: Progress | None = None) -> WarmstartResult:
    """Train ``model`` on ``loss_at(step)`` (steps from 1) under the ``warmstart`` section's
    ``settings``; ``evaluate()`` returns held-out figures with ``pass_at_1`` among them."""
    s = settings
    t0 = time.monotonic()
    before = dict(evaluate())
    result = WarmstartResult(data=data, steps=0, seconds=0.0, pass_at_1_before=before["pass_at_1"],
                             pass_at_1_after=before["pass_at_1"], stopped_because="max_steps",
                             before=before, after=before)
    model.train()
    base_lrs = [group["lr"] for group in optimizer.param_groups]
    for step in range(1, s.max_steps + 1):
        factor = lr_factor(step - 1, kind=s.lr_schedule, warmup_steps=0, total_steps=s.max_steps - 1,
                           min_ratio=s.min_lr_ratio)
        for group, base in zip(optimizer.param_groups, base_lrs, strict=True):
            group["lr"] = base * factor
        loss = loss_at(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        result.steps = step
        metrics = {"loss": float(loss.detach()), "seconds": time.monotonic() - t0}
        if step % s.eval_every == 0 or step == s.max_steps:
            result.after = dict(evaluate())
            metrics.update(result.after)
            result.history.append({"step": step, **metrics})
        if on_progress is not None:
            on_progress(step, metrics)
        if "pass_at_1" in metrics and result.after["pass_at_1"] >= s.target_pass_rate:
            result.stopped_because = "target_pass_rate"
            break
        if metrics["seconds"] > s.max_seconds:
            log.warning("the warm start reached its safety ceiling warmstart.max_seconds=%g after %d of at "
                        "most %d steps, before held-out pass@1 reached warmstart.target_pass_rate=%g: where "
                        "it stopped now depends on this machine's speed; raise the ceiling", s.max_seconds,
                        step, s.max_steps, s.target_pass_rate)
            result.stopped_because = "max_seconds"
            result.after = dict(evaluate())
            break
    result.pass_at_1_after = result.after["pass_at_1"]
    result.seconds = time.monotonic() - t0
    if result.stopped_because == "max_steps" and s.target_pass_rate < 1 and \
            result.pass_at_1_after < s.target_pass_rate:
        # a target of 1 means "stop by steps" (the flow demo); below it, RL starts weaker than asked
        log.warning("the warm start used all warmstart.max_steps=%d steps and held-out pass@1 reached "
                    "%.1f%%, short of warmstart.target_pass_rate=%g: RL from a weaker start than the "
                    "recipe asks for may gain little (docs/data.md); raise warmstart.max_steps",
                    s.max_steps, 100 * result.pass_at_1_after, s.target_pass_rate)
    return result


def write_record(out: Path, result: WarmstartResult, settings: dict[str, Any]) -> None:
    """``warmstart.json``: how the model at ``out`` was warm-started (the build keys a later
    recipe is compared with, ``tether.data.prepare.built_otherwise``)."""
    record = {k: v for k, v in asdict(result).items() if k not in ("before", "after")}
    extra = {f"{k}_{when}": v for when, figures in (("before", result.before), ("after", result.after))
             for k, v in figures.items() if k != "pass_at_1"}
    record = {**record, **extra, "settings": settings}
    (out / "warmstart.json").write_text(json.dumps(record, indent=2) + "\n")
