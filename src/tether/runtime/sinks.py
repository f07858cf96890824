"""Where a run's numbers go: metrics.jsonl, eval.jsonl, events.jsonl, TensorBoard, the progress line."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tether.loop.observe import BatchRecord, LoopEvent, LoopObserver
from tether.runtime.progress import Progress


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class JsonlSink(LoopObserver):
    """One JSON line per trained batch (metrics.jsonl), per eval (eval.jsonl), per event (events.jsonl).

    Every line is flushed as it is written, so a crash loses at most the line being written.
    """

    def __init__(self, run_dir: Path, *, wall_start: float) -> None:
        self.wall_start = wall_start
        self.metrics = (run_dir / "metrics.jsonl").open("a", buffering=1)
        self.evals = (run_dir / "eval.jsonl").open("a", buffering=1)
        self.events = (run_dir / "events.jsonl").open("a", buffering=1)

    def _t(self) -> float:
        return time.time() - self.wall_start

    def on_batch(self, record: BatchRecord) -> None:
        row = {"step": record.step, "batch_index": record.batch_index, "wall_s": self._t(),
               **{k: _clean(v) for k, v in record.metrics.items()}}
        self.metrics.write(json.dumps(row) + "\n")

    def on_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        self.evals.write(json.dumps({"step": step, "wall_s": self._t(), **metrics}) + "\n")

    def on_note(self, code: str, message: str) -> None:
        row = {"kind": "note", "t": self._t(), "code": code, "message": message}
        self.events.write(json.dumps(row) + "\n")

    def on_event(self, event: LoopEvent) -> None:
        row = {"kind": event.kind, "t": event.t, "end": event.end, "batch": event.batch,
               "version": event.version,
               **{k: (list(v) if isinstance(v, tuple) else v) for k, v in event.detail.items()}}
        self.events.write(json.dumps(row) + "\n")

    def close(self) -> None:
        for f in (self.metrics, self.evals, self.events):
            f.close()


class TensorBoardSink(LoopObserver):
    """Scalars under their slash-namespaced names, by trained-batch step."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def on_batch(self, record: BatchRecord) -> None:
        for key, value in record.metrics.items():
            if isinstance(value, int | float) and math.isfinite(value):
                self.writer.add_scalar(key, value, record.step)

    def on_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink(LoopObserver):
    """Metrics and evaluations to Weights & Biases, by trained-batch step."""

    def __init__(self, project: str, run_dir: Path, config: Mapping[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=project, name=run_dir.name, dir=str(run_dir), config=dict(config))

    def on_batch(self, record: BatchRecord) -> None:
        self.wandb.log({k: v for k, v in record.metrics.items() if isinstance(v, int | float)},
                       step=record.step)

    def on_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        self.wandb.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


def require_wandb() -> None:
    """Fail early, before any process starts, when W&B is asked for but not installed."""
    import importlib.util

    from tether.errors import ConfigError

    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("run.wandb_project is set but wandb is not installed: pip install wandb "
                          "(or leave run.wandb_project empty)")


class ProgressSink(LoopObserver):
    """Feeds the progress display: batch, reward, eval accuracy, staleness, lag, samples/s (and
    turns per episode for agent runs)."""

    FIELDS = ("reward", "eval_acc", "turns", "staleness", "lag", "samples/s")

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.eval_acc: float | None = None

    def on_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        self.eval_acc = metrics.get("eval/pass_at_1")
        if self.eval_acc is not None:
            self.progress.update(self.progress.step, {"eval_acc": self.eval_acc})

    def on_batch(self, record: BatchRecord) -> None:
        m = record.metrics
        self.progress.update(record.step, {
            "reward": m.get("reward/mean", float("nan")),
            "staleness": record.staleness_batches,
            "lag": m.get("async/publish_lag", 0.0),
            "samples/s": m.get("throughput/samples_per_s", 0.0),
            **({"turns": m["agent/turns_mean"]} if "agent/turns_mean" in m else {}),
        })
