"""How an engine takes up weights published while it generates (``async.inflight_update`` other
than drain): the part of ``tether.vocabulary.Engine`` every engine shares, whatever it samples.

The worker hands the engine a ``poll`` (``watch``): called at a safe point, it binds the newest
complete weights the worker holds and returns their version, or returns None. The engine calls it
before each step of a generation; a family calls ``take_up`` at a boundary of its own (an agent's
turn) and samples inside ``holding`` when a sequence must stay on one version.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from tether.control.inflight import KEEP, InflightMode
from tether.errors import ConfigError

Poll = Callable[[], "int | None"]


class Watched:
    """``watch``, ``take_up`` and ``holding`` over a ``poll`` (None while draining)."""

    poll: Poll | None = None
    """Asked before every step of a generation; None: the weights change only between batches."""
    inflight: InflightMode = KEEP
    """The mode a switch follows (keep, recompute, abort: its ``on_switch`` says what happens to
    the sequences in flight); read once ``poll`` is set."""

    def watch(self, poll: Poll, inflight: InflightMode) -> None:
        """Switch weights mid-generation: before every step ``poll`` puts newer weights in place
        (through ``bind``) and returns their version, or returns None; ``inflight`` (keep,
        recompute, abort) says what happens to the sequences then."""
        if not inflight.switches:
            raise ConfigError(f"async.inflight_update={inflight.name} does not switch weights mid-generation")
        self.poll, self.inflight = poll, inflight

    def take_up(self) -> int | None:
        """A safe point: take up the newest weights the worker holds, if newer; their version, or
        None (nothing newer, or no ``watch``)."""
        return self.poll() if self.poll is not None else None

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Inside, no weights are taken up mid-generation: each sequence sampled is one version's."""
        poll, self.poll = self.poll, None
        try:
            yield
        finally:
            self.poll = poll
