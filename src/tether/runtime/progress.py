"""Progress on long work: a live bar on a terminal, plain log lines elsewhere."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import TextIO


def _fmt(key: str, value: float) -> str:
    if isinstance(value, float) and not value.is_integer():
        return f"{key} {value:.3g}" if abs(value) < 1000 else f"{key} {value:.0f}"
    return f"{key} {value:g}"


class Progress:
    """``update(step, metrics)`` shows the latest values of ``fields``; use as a context manager.

    On a terminal (and with rich installed) a live progress bar with an ETA; otherwise one plain
    line every ``every_s`` seconds and at the end, so logs stay readable.
    """

    def __init__(self, total: int, description: str, *, fields: tuple[str, ...] = (),
                 stream: TextIO | None = None, plain: bool | None = None, every_s: float = 5.0,
                 console=None, eta_label: str = "ETA") -> None:
        """``eta_label``: what precedes the time remaining; "at most" for work that may stop
        before ``total`` (a warm start ends at its target pass rate)."""
        self.total = total
        self.eta_label = eta_label
        self.description = description
        self.fields = fields
        self.stream = stream or sys.stderr
        self.every_s = every_s
        self.latest: dict[str, float] = {}
        self.step = 0
        self._t0 = time.monotonic()
        self._last_line = -float("inf")
        use_plain = plain if plain is not None else not self.stream.isatty()
        self._rich = None
        if not use_plain:
            try:
                from rich.progress import BarColumn, TextColumn, TimeRemainingColumn
                from rich.progress import Progress as RichProgress
            except ImportError:
                use_plain = True
            else:
                class TwoLines(RichProgress):
                    """The bar, count and ETA on one line; the figures on the next, so both
                    fit an 80-column terminal."""

                    def get_renderables(self):
                        yield self.make_tasks_table(self.tasks)
                        for task in self.tasks:
                            yield "  " + task.fields.get("status", "")

                self._rich = TwoLines(
                    TextColumn("[bold]{task.description}"), BarColumn(),
                    TextColumn("{task.completed}/{task.total}"), TextColumn(eta_label),
                    TimeRemainingColumn(), transient=False, console=console,
                )
                self._task = self._rich.add_task(description, total=total, status="")
        self.plain = use_plain

    def __enter__(self) -> Progress:
        if self._rich is not None:
            self._rich.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def status(self) -> str:
        shown = [(k, self.latest[k]) for k in self.fields if k in self.latest]
        return "  ".join(_fmt(k, v) for k, v in shown)

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        self.step = step
        self.latest.update({k: v for k, v in metrics.items() if isinstance(v, int | float)})
        if self._rich is not None:
            self._rich.update(self._task, completed=step, status=self.status())
            return
        now = time.monotonic()
        if now - self._last_line >= self.every_s or step >= self.total:
            self._last_line = now
            elapsed = now - self._t0
            eta = elapsed / step * (self.total - step) if step else 0.0
            print(f"{self.description}: {step}/{self.total}  {self.status()}  "
                  f"[{elapsed:.0f}s elapsed, {self.eta_label} {eta:.0f}s]", file=self.stream, flush=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
