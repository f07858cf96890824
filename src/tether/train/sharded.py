"""``train.world_size`` > 1: the learner as N ranks of PyTorch's FSDP2, seen by the loop as one.

``ShardedLearner`` lives in the driver and implements what the loop and the runner use of a
learner (``train``, ``export_weights``, ``save``, ``load``, ``close``). Each rank is a process
(spawned; gloo on CPU, NCCL on GPUs) holding a ``TorchLearner`` whose model is sharded with
``fully_shard`` per decoder layer and at the root. Every rank receives the whole rollout batch;
the learner's ``Ranks`` collective splits each mini-batch by whole prompt groups and makes the
update the single-process one (tether.train.collective).

Ranks ignore SIGINT and SIGTERM (the driver stops them in order) and exit when the driver is
gone: each watches a lifeline pipe whose only write end the driver holds. A rank that dies or
raises fails the call with a ``LearnerLostError`` naming the rank; every rank is then stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from tether.errors import LearnerError, LearnerLostError
from tether.loop.protocols import RolloutBatch, TrainResult
from tether.train.learner import LearnerSettings

START_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RankSpec:
    rank: int
    world: int
    init_file: str
    model_path: str
    settings: LearnerSettings
    threads: int


def rank_main(spec: RankSpec, conn: Connection, lifeline: Connection) -> None:
    """A rank's process: join the group, build the sharded learner, answer the driver."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from tether.procinfo import exit_when_closed

    exit_when_closed(lifeline.fileno())
    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec.threads)
    try:
        from tether.train.collective import Ranks
        from tether.train.learner import TorchLearner

        backend = "nccl" if spec.settings.device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(spec.rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"file://{spec.init_file}", rank=spec.rank,
                                world_size=spec.world)
        learner = TorchLearner(spec.model_path, spec.settings, group=Ranks())
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    blocks: dict[str, Any] = {}  # the weight channel's shared block, attached at its first write
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            kind = msg[0]
            if kind == "stop":
                return
            try:
                if kind == "train":
                    answer = learner.train(msg[1], train_version=msg[2])
                elif kind == "export":
                    answer = learner.export_weights()
                elif kind == "write":
                    answer = _write_rows(learner, msg[1], msg[2], blocks)
                elif kind == "save":
                    answer = learner.save(msg[1])
                elif kind == "load":
                    answer = learner.load(msg[1])
                else:
                    raise ValueError(f"unknown message {kind!r}")
                conn.send(("ok", answer if spec.rank == 0 else None))
            except BaseException as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        for block in blocks.values():
            block.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _write_rows(learner, name: str, layout, blocks: dict[str, Any]) -> None:
    """This rank's rows of every weight, into the channel's shared block ``name``."""
    from tether.rollout.channel import WeightReader
    from tether.train import fsdp

    if name not in blocks:
        for old in blocks.values():
            old.close()
        blocks.clear()
        blocks[name] = WeightReader(name, layout)  # attached to write: its views are the block's bytes
    fsdp.write_own_rows(learner.model, learner.names, blocks[name].views(), rank=learner.group.rank)


class RankWeights(Mapping):
    """The ranks' weights as they are at export. A weight channel has every rank write its own
    rows straight into the shared block (``write_into``: nothing is gathered, nothing crosses a
    pipe); used as a mapping (a Ray snapshot, an evaluation copy, the channel's first write) they
    are gathered whole on rank 0 once, on first use. Either must happen before the learner
    changes them again (refused after)."""

    def __init__(self, learner: ShardedLearner) -> None:
        self._learner, self._epoch = learner, learner.epoch
        self._whole: dict[str, Any] | None = None

    def write_into(self, name: str, layout) -> None:
        self._current()
        self._learner._call(("write", name, layout), "while writing its rows of the weights into the channel")

    def _gathered(self) -> dict[str, Any]:
        if self._whole is None:
            self._current()
            self._whole = self._learner._call(("export",), "while gathering its weights for a publication")
        return self._whole

    def _current(self) -> None:
        if self._learner.epoch != self._epoch:
            raise LearnerError("these weights were exported before the learner last changed them; "
                               "export them again")

    def __getitem__(self, name: str) -> Any:
        return self._gathered()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._gathered())

    def __len__(self) -> int:
        return len(self._gathered())


class ShardedLearner:
    """N learner ranks behind the single-learner interface."""

    def __init__(self, model_path: str | Path, settings: LearnerSettings, *, world_size: int,
                 threads: int = 1) -> None:
        import torch.multiprocessing as mp

        self.world = world_size
        self.epoch = 0  # counts changes to the weights (updates, loads): an export is of one epoch
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="tether-ranks-")
        init_file = os.path.join(self._dir.name, "init")
        lifeline_r, self._lifeline = ctx.Pipe(duplex=False)
        self._procs, self._conns = [], []
        try:
            for rank in range(world_size):
                ours, theirs = ctx.Pipe()
                spec = RankSpec(rank, world_size, init_file, str(model_path), settings, threads)
                proc = ctx.Process(target=rank_main, args=(spec, theirs, lifeline_r), daemon=True,
                                   name=f"tether-learner-{rank}")
                proc.start()
                theirs.close()
                self._procs.append(proc)
                self._conns.append(ours)
            lifeline_r.close()
            self.pids = [a[1] for a in self._answers("while starting", START_TIMEOUT_S)]
        except BaseException:
            self.close()
            raise

    # -- the learner interface ------------------------------------------------------------------

    def train(self, batch: RolloutBatch, *, train_version: int) -> TrainResult:
        self.epoch += 1
        return self._call(("train", batch, train_version), f"while training batch {batch.index}")

    def export_weights(self) -> RankWeights:
        """The weights as they are now, gathered or written into a channel on first use, which
        must come before the next ``train`` or ``load`` (refused after): take ``dict(...)`` of
        them to keep a copy."""
        return RankWeights(self)

    def save(self, path: str | Path) -> None:
        self._call(("save", str(path)), f"while saving {path}")

    def load(self, path: str | Path) -> None:
        self.epoch += 1
        self._call(("load", str(path)), f"while loading {path}")

    def close(self, *, grace_s: float = 10.0) -> None:
        """Stop every rank (they exit on "stop", or when the lifeline closes), then reap them;
        any still running after ``grace_s`` (one blocked in a collective with a dead peer) is
        killed."""
        for conn in getattr(self, "_conns", []):
            with contextlib.suppress(OSError, ValueError):
                conn.send(("stop",))
        lifeline = getattr(self, "_lifeline", None)
        if lifeline is not None:
            lifeline.close()
            self._lifeline = None
        deadline = time.monotonic() + grace_s
        for proc in getattr(self, "_procs", []):
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in getattr(self, "_conns", []):
            conn.close()
        self._conns, self._procs = [], []
        if getattr(self, "_dir", None) is not None:
            self._dir.cleanup()
            self._dir = None

    # -- internals ------------------------------------------------------------------------------

    def _call(self, msg: tuple, doing: str) -> Any:
        if not self._conns:
            raise LearnerLostError("the learner's ranks were stopped")
        for rank, conn in enumerate(self._conns):
            try:
                conn.send(msg)
            except (OSError, ValueError):
                self._lost(rank, doing)
        return self._answers(doing, None)[0][1]

    def _answers(self, doing: str, timeout: float | None) -> list[tuple]:
        """One answer from every rank, in rank order; a rank's error or death raises."""
        answers: dict[int, tuple] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(answers) < self.world:
            waiting = [r for r in range(self.world) if r not in answers]
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self.close(grace_s=0.0)
                raise LearnerLostError(f"learner rank(s) {waiting} did not answer within {timeout:.0f}s "
                                       f"{doing}")
            ready = wait([self._conns[r] for r in waiting] + [self._procs[r].sentinel for r in waiting], left)
            for rank in waiting:
                conn = self._conns[rank]
                if conn in ready or (self._procs[rank].sentinel in ready and conn.poll()):
                    try:
                        answer = conn.recv()
                    except (EOFError, OSError):
                        self._lost(rank, doing)
                    if answer[0] == "error":
                        # a rank whose peer died fails in its collective: name the dead one
                        dead = self._first_dead(exclude=rank)
                        if dead is not None:
                            self._lost(dead, doing)
                        self.close(grace_s=1.0)  # the others may wait in a collective for it
                        raise LearnerError(f"learner rank {rank} failed {doing}: {answer[1]}",
                                           remote_traceback=answer[2])
                    answers[rank] = answer
                elif self._procs[rank].sentinel in ready:
                    self._lost(rank, doing)
        return [answers[r] for r in range(self.world)]

    def _first_dead(self, *, exclude: int, wait_s: float = 2.0) -> int | None:
        """A rank other than ``exclude`` whose process has died (given ``wait_s`` to be seen)."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self._procs):
                if rank != exclude and proc.exitcode is not None:
                    return rank
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def _lost(self, rank: int, doing: str):
        proc = self._procs[rank]
        proc.join(1)
        code = proc.exitcode
        how = (f"died from signal {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with status {code}" if code is not None else "stopped answering")
        self.close(grace_s=0.0)  # the others wait in a collective for it
        raise LearnerLostError(f"learner rank {rank} (pid {proc.pid}) {how} {doing}; the run's last "
                               "checkpoint is intact: `tether train --resume` continues from it")

