"""The learner as a group of ranks, seen by the loop as one learner, over one of two transports.

``RankServer`` is what runs in each rank — a process of this machine (``ProcessRanks``, here) or a
Ray actor anywhere in a cluster (``tether.train.ray_ranks.ActorRanks``): its ``TorchLearner``
(sharded with FSDP2 when there are several ranks) and, on rank 0, the held-out evaluation on a
whole copy of the model, given the ranks' weights before each evaluation. ``RankGroup`` lives in
the driver: it calls every rank, returns rank 0's answer, and when a rank dies or fails it names
that rank — the one that died, not a peer that failed waiting for it in a collective — and stops
the others. A transport says how a call reaches a rank and how a rank is seen to have died.

Every rank receives the whole rollout batch; the learner's ``Ranks`` collective splits each
mini-batch by whole prompt groups and makes the update the single-process one
(``tether.train.collective``). Ranks ignore SIGINT and SIGTERM (the driver stops them in order)
and exit when the driver is gone.
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
from typing import Any, Protocol

from tether.config import Config
from tether.errors import LearnerError, LearnerLostError
from tether.procinfo import (
    MARKS_ENV,
    Sealed,
    child_context,
    failure_traceback,
    killed,
    oom_kills,
    start_child,
)
from tether.vocabulary import DataBundle, RolloutBatch, TrainResult

START_TIMEOUT_S = 600.0


class RankServer:
    """One rank of the learner: its ``TorchLearner`` and, on rank 0, the held-out evaluation and
    the whole weights (gathered from every rank's shards, a collective)."""

    def __init__(self, cfg: Config, model_path: str, eval_data: DataBundle | None, *, rank: int = 0,
                 world: int = 1, run_dir: str | None = None) -> None:
        self.cfg, self.model_path, self.eval_data = cfg, model_path, eval_data
        self.rank, self.world = rank, world
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.learner: Any = None
        self.evaluator: Any = None
        self.eval_model: Any = None
        self._blocks: dict[str, Any] = {}  # the weight channel's shared block, attached at its first write

    def build(self, group: Any = None) -> None:
        """The learner (of this rank of ``group``, a ``Ranks`` collective; None: the only one)
        and, on rank 0, its evaluator: on the learner's own model when it is whole, else on a
        whole copy loaded at the first evaluation."""
        import torch

        from tether.train.learner import TorchLearner

        cfg = self.cfg
        torch.set_num_threads(cfg.train.threads)
        self.learner = TorchLearner(self.model_path, cfg, group=group)
        if self.rank == 0 and self.eval_data is not None and self.world == 1:
            self._build_evaluator(self.learner.model, self.learner.tokenizer)

    def _build_evaluator(self, model: Any, tokenizer: Any) -> None:
        family = self.cfg.family()
        evaluator = family.evaluator(self.cfg, model, tokenizer, self.eval_data, family.scorer(self.cfg),
                                     run_dir=self.run_dir)
        self.eval_model = model
        # in the training forward's dtype; one rank's own model on its evaluation weights (the EMA's),
        # ranks' whole copy of them gathered in evaluate
        self.evaluator = (self.learner.evaluating(evaluator) if model is self.learner.model
                          else self.learner.precision.evaluating(evaluator))

    def _whole_copy(self) -> None:
        """Rank 0's whole model for evaluation with ranks, loaded at the first evaluation: a run
        that never evaluates never holds it (the whole model's weights beside rank 0's shards)."""
        from tether.modeling import learner_device

        model, tokenizer = self.cfg.family().policy(self.cfg).load(self.model_path)
        self._build_evaluator(model.to(learner_device(self.cfg.train.device)).eval(), tokenizer)

    def train(self, batch: RolloutBatch, train_version: int) -> TrainResult | None:
        result = self.learner.train(batch, train_version=train_version)
        return result if self.rank == 0 else None

    def export(self) -> dict[str, Any]:
        """Every rank's shards gathered whole onto rank 0's CPU (the others get an empty dict)."""
        return self.learner.export_weights()

    def write(self, name: str, layout: Any) -> None:
        """This rank's rows of every weight, into the shared block ``name`` (no collective)."""
        from tether.rollout.channel import WeightReader
        from tether.train import fsdp

        if name not in self._blocks:  # attached to write: its views are the block's bytes
            self.close()
            self._blocks[name] = WeightReader(name, layout)
        fsdp.write_own_rows(self.learner.model, self.learner.names, self._blocks[name].views(),
                            rank=self.learner.group.rank)

    def evaluate(self, step: int) -> Mapping[str, float] | None:
        if self.world > 1:  # the ranks' weights into rank 0's whole copy: a collective
            from tether.modeling import copy_weights

            with self.learner.evaluation_weights():  # every rank's shards of the EMA's, with one
                weights = self.learner.export_weights()
            if self.rank != 0:
                return None
            if self.evaluator is None:
                self._whole_copy()
            copy_weights(self.eval_model, weights)
        return self.evaluator(step)

    def save(self, path: str) -> None:
        self.learner.save(path)

    def load(self, path: str) -> None:
        self.learner.load(path)

    def close(self) -> None:
        for block in self._blocks.values():
            block.close()
        self._blocks.clear()


@dataclass(frozen=True)
class Outcome:
    """One rank's end of a call: its answer, the error it raised, or how it died."""

    rank: int
    answer: Any = None
    error: BaseException | None = None
    died: str | None = None
    """How the rank (its process or actor) ended, in words."""
    cause: str = ""
    """What is known of why it died, said after what it was doing (a SIGKILL: ``procinfo.killed``)."""


class Transport(Protocol):
    """How the driver reaches the ranks: the mechanics; ``RankGroup`` keeps the policy."""

    world: int
    pids: list[int | None]

    def send(self, rank: int, method: str, args: tuple) -> None:
        """Start ``method(*args)`` on ``rank`` (a rank that cannot take it is seen by ``next``)."""

    def next(self, ranks: list[int], doing: str, timeout: float | None) -> Outcome | None:
        """The next of ``ranks`` to answer, fail or die; None after ``timeout`` seconds."""
        ...

    def dead_among(self, ranks: list[int]) -> Outcome | None:
        """A rank among ``ranks`` that died (given a moment to be seen), or None."""
        ...

    def death(self, outcome: Outcome, doing: str) -> str:
        """What to tell the user of a rank that died."""
        ...

    def weights(self, group: RankGroup) -> RankWeights:
        """The ranks' current weights, in the form this transport publishes them."""
        ...

    def close(self, *, grace_s: float = 10.0) -> None: ...


class RankGroup:
    """N learner ranks behind the one-learner interface (``train``, ``export_weights``,
    ``evaluate``, ``save``, ``load``, ``close``)."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.world = transport.world
        self.epoch = 0  # counts changes to the weights (updates, loads): an export is of one epoch

    @property
    def pids(self) -> list[int | None]:
        return self.transport.pids

    def call(self, method: str, *args: Any, doing: str, ranks: list[int] | None = None,
             timeout: float | None = None) -> Any:
        """``method(*args)`` on every rank (or on ``ranks``); rank 0's answer (the first asked).
        A rank that dies or fails stops every rank, and the error names the rank at fault."""
        ranks = list(range(self.world)) if ranks is None else ranks
        for rank in ranks:
            self.transport.send(rank, method, args)
        return self.collect(ranks, doing, timeout)[ranks[0]]

    def collect(self, ranks: list[int], doing: str, timeout: float | None = None) -> dict[int, Any]:
        """Every one of ``ranks``'s answer to what it was sent."""
        got: dict[int, Any] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(got) < len(ranks):
            waiting = [r for r in ranks if r not in got]
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            outcome = self.transport.next(waiting, doing, left)
            if outcome is None:
                self.transport.close(grace_s=0.0)
                raise LearnerLostError(f"learner rank(s) {waiting} did not answer within {timeout:.0f}s "
                                       f"{doing}")
            if outcome.died is not None:
                self.transport.close(grace_s=0.0)  # the others wait in a collective for it
                raise LearnerLostError(self.transport.death(outcome, doing))
            if outcome.error is not None:
                others = [r for r in waiting if r != outcome.rank]
                # a rank whose peer died fails in its collective: name the one that died
                dead = self.transport.dead_among(others) if self.world > 1 else None
                self.transport.close(grace_s=1.0)
                if dead is not None:
                    raise LearnerLostError(self.transport.death(dead, doing)) from None
                raise outcome.error
            got[outcome.rank] = outcome.answer
        return got

    def train(self, batch: RolloutBatch, *, train_version: int) -> TrainResult:
        self.epoch += 1
        return self.call("train", batch, train_version, doing=f"while training batch {batch.index}")

    def export_weights(self) -> RankWeights:
        """The weights as they are now, gathered (or written into a channel, or put into the
        object store) on first use, which must come before the next ``train`` or ``load``
        (refused after): take ``dict(...)`` of them to keep a copy."""
        return self.transport.weights(self)

    def evaluate(self, step: int) -> Mapping[str, float]:
        return self.call("evaluate", step, doing=f"while evaluating at step {step}")

    def save(self, path: str | Path) -> None:
        self.call("save", str(path), doing=f"while saving {path}")

    def load(self, path: str | Path) -> None:
        self.epoch += 1
        self.call("load", str(path), doing=f"while loading {path}")

    def close(self) -> None:
        self.transport.close()


class RankWeights(Mapping):
    """The ranks' weights as they are at export; used as a mapping (a Ray snapshot from the
    driver, the channel's first write) they are gathered whole once, on first use. A weight
    channel instead has every rank write its own rows straight into the shared block
    (``write_into``: nothing gathered, nothing crosses a pipe). Either must happen before the
    learner changes them again (refused after)."""

    def __init__(self, group: RankGroup) -> None:
        self._group, self._epoch = group, group.epoch
        self._whole: dict[str, Any] | None = None

    def _current(self) -> None:
        if self._group.epoch != self._epoch:
            raise LearnerError("these weights were exported before the learner last changed them; "
                               "export them again")

    def _gathered(self) -> dict[str, Any]:
        if self._whole is None:
            self._current()
            self._whole = self._group.call("export", doing="while gathering its weights for a publication")
        return self._whole

    def __getitem__(self, name: str) -> Any:
        return self._gathered()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._gathered())

    def __len__(self) -> int:
        return len(self._gathered())


class ChannelRankWeights(RankWeights):
    """Local ranks' weights: each rank can write its own rows into this machine's shared block."""

    def write_into(self, name: str, layout: Any) -> None:
        self._current()
        self._group.call("write", name, layout,
                         doing="while writing its rows of the weights into the channel")


# -- ranks as processes of this machine ------------------------------------------------------------


@dataclass(frozen=True)
class RankSpec:
    rank: int
    world: int
    init_file: str
    cfg: Config
    model_path: str
    eval_data: DataBundle | None
    run_dir: str | None
    marks: str | None = None
    """The folder the rank marks its learner phases in (``tether.procinfo.MARKS_ENV``)."""


def rank_main(sealed: Sealed, conn: Connection, lifeline: Connection) -> None:
    """A rank's process: join the group, build the rank, answer the driver's calls. ``sealed``
    holds its ``RankSpec``, opened here so that a failure to rebuild it (a plug-in of the recipe
    that fails to import in this process) is reported as the rank's failure to start."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from tether.procinfo import exit_when_closed

    exit_when_closed(lifeline.fileno())
    import torch
    import torch.distributed as dist

    try:
        spec: RankSpec = sealed.open()
        if spec.marks:
            os.environ[MARKS_ENV] = spec.marks
        server = RankServer(spec.cfg, spec.model_path, spec.eval_data, rank=spec.rank, world=spec.world,
                            run_dir=spec.run_dir)
        from tether.train.collective import Ranks

        backend = "nccl" if spec.cfg.train.device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(spec.rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"file://{spec.init_file}", rank=spec.rank,
                                world_size=spec.world)
        server.build(Ranks())
    except BaseException as exc:  # a recipe's mistake (a plug-in that fails here) says it all
        conn.send(("error", f"{type(exc).__name__}: {exc}",
                   failure_traceback(exc)))
        return
    conn.send(("ok", None))
    try:
        while True:
            try:
                method, args = conn.recv()
            except (EOFError, OSError):
                return
            if method == "stop":
                return
            try:
                answer = getattr(server, method)(*args)
                conn.send(("ok", answer if spec.rank == 0 else None))
            except BaseException as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        server.close()
        if dist.is_initialized():
            dist.destroy_process_group()


class ProcessRanks:
    """N rank processes (forked from ``procinfo.child_context``'s server; gloo on CPU, NCCL on GPUs)
    meeting through a file; each watches a lifeline pipe whose only write end the driver holds."""

    _lifeline: Any = None
    """The lifeline's write end; None before ``__init__`` opens it (``close`` after a failed start)
    and once closed."""

    def __init__(self, cfg: Config, model_path: str | Path, eval_data: DataBundle | None, *,
                 run_dir: str | Path | None = None) -> None:
        self.world = cfg.train.world_size
        self.pids: list[int | None] = [None] * self.world
        ctx = child_context()
        self._dir: tempfile.TemporaryDirectory | None = tempfile.TemporaryDirectory(prefix="tether-ranks-")
        init_file = os.path.join(self._dir.name, "init")
        self._marks = os.path.join(self._dir.name, "phases")
        os.mkdir(self._marks)
        self._oom_kills = oom_kills()
        lifeline_r, self._lifeline = ctx.Pipe(duplex=False)
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._owing: set[int] = set()
        """Ranks with an answer not yet read (each owes one for starting): busy, or stuck."""
        try:
            for rank in range(self.world):
                ours, theirs = ctx.Pipe()
                spec = RankSpec(rank, self.world, init_file, cfg, str(model_path), eval_data,
                                None if run_dir is None else str(run_dir), self._marks)
                proc = start_child(ctx, rank_main, (Sealed(spec), theirs, lifeline_r),
                                   name=f"tether-rank-{rank}")
                self._owing.add(rank)
                theirs.close()
                self._procs.append(proc)
                self._conns.append(ours)
            lifeline_r.close()
            self.pids = [proc.pid for proc in self._procs]
            # each rank answers once it has joined the group and built its learner
            RankGroup(self).collect(list(range(self.world)), "while starting", START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def send(self, rank: int, method: str, args: tuple) -> None:
        if not self._conns:
            raise LearnerLostError("the learner's ranks were stopped")
        self._owing.add(rank)
        with contextlib.suppress(OSError, ValueError):  # a dead rank is seen by ``next``
            self._conns[rank].send((method, args))

    def next(self, ranks: list[int], doing: str, timeout: float | None) -> Outcome | None:
        outcome = self._next(ranks, doing, timeout)
        if outcome is not None:
            self._owing.discard(outcome.rank)
        return outcome

    def _next(self, ranks: list[int], doing: str, timeout: float | None) -> Outcome | None:
        ready = wait([self._conns[r] for r in ranks] + [self._procs[r].sentinel for r in ranks], timeout)
        if not ready:
            return None
        for rank in ranks:
            conn, proc = self._conns[rank], self._procs[rank]
            if conn in ready or (proc.sentinel in ready and conn.poll()):
                try:
                    answer = conn.recv()
                except (EOFError, OSError):
                    return self._died(rank)
                if answer[0] == "error":
                    error = LearnerError(f"learner rank {rank} failed {doing}: {answer[1]}",
                                         remote_traceback=answer[2])
                    return Outcome(rank, error=error)
                return Outcome(rank, answer=answer[1])
            if proc.sentinel in ready:
                return self._died(rank)
        return None

    def dead_among(self, ranks: list[int], wait_s: float = 2.0) -> Outcome | None:
        deadline = time.monotonic() + wait_s
        while True:
            for rank in ranks:  # status 0: it ended on its own, having reported its failure to start
                if self._procs[rank].exitcode not in (None, 0):
                    return self._died(rank)
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def _died(self, rank: int) -> Outcome:
        how, proc = self._how(rank), self._procs[rank]
        # SIGKILL is how the kernel ends a process out of memory: read the rank's mark while it is there
        cause = killed(proc.pid, self._marks, self._oom_kills) if proc.exitcode == -signal.SIGKILL else ""
        return Outcome(rank, died=how, cause=cause)

    def _how(self, rank: int) -> str:
        proc = self._procs[rank]
        proc.join(1)
        code = proc.exitcode
        return (f"died from signal {signal.Signals(-code).name}" if code is not None and code < 0
                else f"exited with status {code}" if code is not None else "stopped answering")

    def death(self, outcome: Outcome, doing: str) -> str:
        pid = self.pids[outcome.rank]
        return f"learner rank {outcome.rank} (pid {pid}) {outcome.died} {doing}{outcome.cause}"

    def weights(self, group: RankGroup) -> RankWeights:
        return ChannelRankWeights(group)

    def close(self, *, grace_s: float = 10.0) -> None:
        """Stop every rank, then reap them. Idle ranks exit on "stop" through their own exit
        handlers (a library's named semaphores unlinked: ``ProcessPool.close``); closing the
        lifeline then ends the rest at once, and any still running after ``grace_s`` (one blocked
        in a collective with a dead peer) is killed."""
        deadline = time.monotonic() + grace_s
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("stop", ()))
        for rank, proc in enumerate(self._procs):
            if rank not in self._owing:
                proc.join(max(0.0, deadline - time.monotonic()))
        if self._lifeline is not None:
            self._lifeline.close()
            self._lifeline = None
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
