"""A rollout worker: a separate OS process hosting one engine and the reward function.

``Rollout`` (engine + reward: generate and score one batch) is shared with the Ray backend's
actors (``tether.rollout.backends.ray.pool``); this module adds the process's message loop and its
weight readers (the shared-memory channel's, or the collective group's).

It receives whole rollout batches (prompts, group size, sampling parameters, behavior version),
generates, scores every sample, and sends back one complete payload (the family's scored batch)
— or an error with
the original traceback, never a partial batch. It loads weights only when told to, between
batches, after verifying the version and checksum of the shared snapshot.

Messages, each a tuple whose first item names it:

    driver → worker   ("generate", WorkItem) | ("load", version) | ("stop",)
    worker → driver   ("ready", pid) | ("batch", index, payload) | ("loaded", version, seconds)
                      | ("error", index | None, message, traceback_text)
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from tether.errors import RolloutError
from tether.procinfo import Sealed, exit_when_closed, failure_traceback
from tether.vocabulary import Payload, WorkItem

if TYPE_CHECKING:
    from tether.rollout.settings import WorkerSpec


def worker_main(sealed: Sealed, requests: Connection, results: Connection,
                lifeline: Connection | None = None) -> None:
    """Process entry point; ``sealed`` holds the ``WorkerSpec``, opened here so that a failure to
    rebuild it (a plug-in of the recipe that fails to import in this process) is reported as the
    worker's failure to start. Stop signals are the driver's to handle: workers ignore SIGINT and
    SIGTERM, and exit when the driver's ``lifeline`` closes (the driver stopped or died)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if lifeline is not None:  # exit when the driver is gone, even mid-batch; at once if it already is
        exit_when_closed(lifeline.fileno())
    try:
        spec = sealed.open()
        worker = _CollectiveWorker(spec) if spec.group is not None else _ChannelWorker(spec)
    except BaseException as exc:
        results.send(("error", None, f"failed to start: {type(exc).__name__}: {exc}", failure_traceback(exc)))
        return
    results.send(("ready", os.getpid()))
    if isinstance(worker, _CollectiveWorker):  # the driver forms the group once every worker is ready
        try:
            results.send(("loaded", spec.initial_version, worker.join()))
        except BaseException as exc:
            results.send(("error", None, f"{type(exc).__name__}: {exc}", failure_traceback(exc)))
            return
    worker.on_switch = lambda version: results.send(("took", version))
    while True:
        try:
            msg = requests.recv()
        except (EOFError, OSError):
            return  # the driver is gone: exit rather than linger as an orphan
        kind = msg[0]
        if kind == "stop":
            worker.close()
            return
        index = msg[1].batch_index if kind == "generate" else None
        try:
            if kind == "generate":
                results.send(("batch", index, worker.generate(msg[1])))
            elif kind == "load":
                results.send(("loaded", msg[1], worker.load(msg[1])))
            else:
                raise AssertionError(f"unknown message {kind!r}")
        except BaseException as exc:
            results.send(("error", index, f"{type(exc).__name__}: {exc}", traceback.format_exc()))


class Rollout:
    """One engine and the reward function: generates and scores whole rollout batches. What it
    samples is the policy family's (``Family.sampler``: token sequences for text, image
    trajectories for flow); the weight handling here is the same for every family."""

    def __init__(self, spec: WorkerSpec) -> None:
        import torch

        settings = spec.settings
        torch.set_num_threads(settings.threads_per_worker)
        from tether.modeling import torch_device

        self.spec = spec
        device = torch_device(spec.device, who=f"worker {spec.worker_id} is to sample on {spec.device}",
                              fix="give its Ray actor a GPU and a CUDA build of torch, or set "
                              "ray.gpus_per_worker=0")
        cfg = settings.cfg
        self.sampler = cfg.family().sampler(cfg, settings.model_path, settings.stop_text, device=device,
                                            threads=settings.threads_per_worker, seed=cfg.run.seed)
        self.engine = self.sampler.engine
        if cfg.train.lora_rank:  # the learner publishes adapters; the engine merges them, or adds their terms
            terms = cfg.train if cfg.rollout.lora_apply == "terms" else None
            self.engine.use_adapter(cfg.train.lora_alpha / cfg.train.lora_rank, terms)

    def use_weights(self, weights, version: int | None = None) -> None:
        """Make ``weights`` (name → tensor: shared-memory views or an object-store snapshot) the
        engine's, as ``version`` when given: the built-in engines sample from them in place (on
        CPU), vLLM copies them into its own layout."""
        self.engine.bind(weights, version)

    def close(self) -> None:
        self.sampler.close()  # what it holds besides its engine
        self.engine.close()

    def watch(self, poll) -> None:
        """Without draining: have the engine call ``poll`` before every decode step (it binds
        newer weights when it has them and returns their version, else None)."""
        self._poll = poll
        self.engine.watch(poll, self.spec.inflight)

    def start_at(self, version: int, wait_s: float = 60.0) -> None:
        """Without draining, before a batch launched at ``version``: publications reach a worker
        while it generates, so wait until the engine holds at least that version, then take
        anything newer already complete."""
        deadline = time.monotonic() + wait_s
        while self.engine.version < version:
            if self._poll() is None:
                if time.monotonic() > deadline:
                    raise RolloutError(f"version {version} did not reach this worker within {wait_s:.0f}s")
                time.sleep(0.001)
        self._poll()

    def generate(self, item: WorkItem) -> Payload:
        """The scored batch of ``item``: the family's payload."""
        return self.sampler.generate(item)


class _ChannelWorker(Rollout):
    """A process worker. Draining, its parameters are bound to the shared-memory channel's views
    and it loads a version when told, between batches. Otherwise (``spec.inflight``) the
    channel is written while it generates, so it samples from a private copy instead: before
    every decode step it looks at the channel's header, and when a newer version is complete it
    copies the block into its spare buffer, verifies the copy (version and checksum: a copy torn
    by a publication in progress is refused and tried again at the next step) and binds to it."""

    WAIT_S = 60.0  # for the version a batch was launched at to be readable

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec)
        from tether.rollout.channel import WeightReader

        assert spec.channel_name is not None and spec.channel_layout is not None
        self.reader = WeightReader(spec.channel_name, spec.channel_layout)
        if spec.inflight.drains:
            self.use_weights(self.reader.views())
            self.load(spec.initial_version)
            return
        import torch

        self.buffers = [torch.empty(spec.channel_layout.total_bytes, dtype=torch.uint8) for _ in range(2)]
        self.current = 1
        self.reader.verify(spec.initial_version)
        if self._switch(spec.initial_version) is None:
            raise RolloutError(f"the weight channel changed while version {spec.initial_version} was read")
        self.watch(self._newest)

    def load(self, version: int) -> float:
        seconds = self.reader.verify(version)
        self.engine.load_weights(self.reader.views(), version)
        return seconds

    def _switch(self, version: int) -> int | None:
        spare = 1 - self.current
        views = self.reader.copy(version, self.buffers[spare])
        if views is None:
            return None
        self.engine.bind(views, version)
        self.current = spare
        return version

    on_switch: Callable[[int], None] | None = None
    """Told each version taken up while generating (the pool waits on it when draining at turns)."""

    def _newest(self) -> int | None:
        newest = self.reader.newest()
        if newest is None or newest <= self.engine.version:
            return None
        taken = self._switch(newest)
        if taken is not None and self.on_switch is not None:
            self.on_switch(taken)
        return taken

    def generate(self, item: WorkItem) -> Payload:
        if not self.spec.inflight.drains:
            self.start_at(item.version, self.WAIT_S)
        return super().generate(item)


class _CollectiveWorker(Rollout):
    """A process worker of ``rollout.weight_sync=collective``: it joins the learner's broadcast
    group (``tether.rollout.collective``) and, told to load a version, receives it into its private
    block, verifies version and checksum, and loads it. Its parameters are bound to that block
    (on CPU), so each version lands in them as it is received and verified."""

    def join(self) -> float:
        """Join the group and take the first version; returns the seconds it took to receive."""
        from tether.rollout.collective import CollectiveReceiver

        spec = self.spec
        assert spec.group is not None and spec.channel_layout is not None
        self.receiver = CollectiveReceiver(spec.group, spec.worker_id + 1, spec.channel_layout,
                                           device="cuda" if spec.group.nccl else "cpu")
        seconds = self.receiver.receive(spec.initial_version)
        self.use_weights(self.receiver.views(), spec.initial_version)
        return seconds

    def load(self, version: int) -> float:
        seconds = self.receiver.receive(version)
        self.engine.load_weights(self.receiver.views(), version)
        return seconds
