"""The collective weight channel (``rollout.weight_sync=collective``): the publisher (the learner's
process, rank 0) broadcasts each version to every engine worker over a ``torch.distributed``
process group of their own, in fixed-size buckets.

The group is dedicated: built from a ``TCPStore`` the publisher opens on a free port (or
``rollout.weight_sync_port``) and a ``ProcessGroupGloo`` (``ProcessGroupNCCL`` when the weights
live on CUDA) made directly, so it neither needs nor touches the default group the learner's
ranks may hold. Joining, and every broadcast, runs under ``rollout.weight_sync_timeout_s``: a
worker that never joins, dies mid-broadcast or stops answering ends the publication with a
``WeightSyncError`` naming the worker and the version, never a hang.

What crosses the group per version:

    header  int64 × 8: version, checksum, data bytes, tensor count, layout digest, bucket bytes
    data    the channel's data region (``tether.rollout.channel.Layout``: every tensor at a 64-byte
            aligned offset), ``BUCKET_BYTES`` at a time

The publisher writes the version into a staging block of the shared-memory channel's format (one
pass that copies and checksums, as ``WeightChannel.publish``); each worker receives into a private
block of the same format and verifies version and checksum exactly as a shared-memory reader
does (``_Block.verify``) before its engine takes the weights.
"""

from __future__ import annotations

import datetime
import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from tether.rollout.channel import _COMPLETE, _WRITING, HEADER_BYTES, ChannelError, Layout, _Block

BUCKET_BYTES = 64 << 20
"""Bytes per broadcast call: big enough that a call's fixed cost (a round trip) is amortised, small
enough that a 7B model's version is ~200 calls each with its own timeout."""
HEADER_WORDS = 8


class WeightSyncError(ChannelError):
    """The collective group could not form, or a broadcast failed: names the worker(s) and version."""


@dataclass(frozen=True)
class GroupAddress:
    """Where a worker joins the publisher's group, and how long anything in it may wait."""

    host: str
    port: int
    world: int
    """Ranks in all: the publisher (0) and one per worker (1 … world-1)."""
    timeout_s: float
    nccl: bool = False
    """NCCL (both ends' blocks on CUDA) instead of gloo."""
    bucket_bytes: int = BUCKET_BYTES


def layout_digest(layout: Layout) -> int:
    """A 63-bit digest of every slot (name, offset, shape, dtype): both ends must agree on it."""
    text = "|".join(f"{s.name}:{s.offset}:{s.shape}:{s.dtype}" for s in layout.slots)
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "little") >> 1


def _group(store, rank: int, world: int, nccl: bool, timeout: datetime.timedelta):
    import torch.distributed as dist

    if nccl:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, options)
    return dist.ProcessGroupGloo(store, rank, world, timeout)


class _Member:
    """One end of the group: its block of the channel's format and the bucketed broadcast."""

    def __init__(self, layout: Layout, address: GroupAddress, device: str) -> None:
        if address.nccl and torch.device(device).type != "cuda":
            raise WeightSyncError(f"the NCCL weight group broadcasts CUDA tensors, and this end's block "
                                  f"is on {device}")
        if address.nccl:  # NCCL binds a rank to the current device
            torch.cuda.set_device(torch.device(device))
        self.layout = layout
        self.address = address
        self.timeout = datetime.timedelta(seconds=address.timeout_s)
        self.raw = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
        self.block = _Block(self.raw, layout)
        self.group = None

    def _broadcast(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.timeout = self.timeout
        self.group.broadcast([t], options).wait(self.timeout)

    def buckets(self) -> list[torch.Tensor]:
        """The data region's slices, ``bucket_bytes`` each (the last one shorter)."""
        data, step = self.raw[HEADER_BYTES:], self.address.bucket_bytes
        return [data[i:i + step] for i in range(0, data.numel(), step)]

    def close(self) -> None:
        self.group = None
        self.block = None  # type: ignore[assignment]
        self.raw = None  # type: ignore[assignment]


class CollectivePublisher(_Member):
    """Rank 0: opens the group's store, waits for the workers to join, broadcasts each version.

    ``workers`` names ranks 1 … N in order; ``gone`` tells which of them are known to be dead (the
    pool's view of its processes), so a failed broadcast names the worker that failed it."""

    def __init__(self, layout: Layout, workers: Sequence[str], *, timeout_s: float, device: str = "cpu",
                 host: str = "127.0.0.1", port: int = 0, bucket_bytes: int = BUCKET_BYTES,
                 gone: Callable[[], list[str]] | None = None, nccl: bool | None = None) -> None:
        import torch.distributed as dist

        self.workers = list(workers)
        self.gone = gone or (lambda: [])
        try:
            self.store = dist.TCPStore(host, port, len(self.workers) + 1, True,
                                       timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        except Exception as exc:  # c10d raises RuntimeError or DistNetworkError
            raise WeightSyncError(f"the collective weight group cannot listen on {host}:{port} "
                                  f"({type(exc).__name__}: {exc}); set rollout.weight_sync_port to a free "
                                  "port, or 0 to pick one") from exc
        address = GroupAddress(host, self.store.port, len(self.workers) + 1, timeout_s,
                               torch.device(device).type == "cuda" if nccl is None else nccl, bucket_bytes)
        super().__init__(layout, address, device)

    def join(self) -> None:
        """Form the group: returns once every worker joined; a ``WeightSyncError`` naming those
        that did not within the timeout."""
        try:
            self.group = _group(self.store, 0, self.address.world, self.address.nccl, self.timeout)
        except Exception as exc:
            missing = [w for i, w in enumerate(self.workers, 1) if not self.store.check([f"joined/{i}"])]
            who = f"worker {', '.join(missing)}" if missing else "a worker"
            raise WeightSyncError(f"{who} did not join the collective weight group at {self.address.host}:"
                                  f"{self.address.port} within rollout.weight_sync_timeout_s="
                                  f"{self.address.timeout_s:g}s ({type(exc).__name__}: "
                                  f"{str(exc)[:200]})") from exc

    def publish(self, tensors: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        """Write ``version`` into the staging block, then broadcast its header and buckets;
        returns ``sync/publish_s`` (both), ``sync/bytes``, ``sync/broadcast_s``, ``sync/buckets``."""
        metrics = dict(self.block.write(tensors, version))
        header = self.block.header[:4]  # state, version, checksum, data bytes
        info = torch.tensor([version, int(header[2]), self.layout.data_bytes, len(self.layout.slots),
                             layout_digest(self.layout), self.address.bucket_bytes, 0, 0],
                            dtype=torch.int64, device=self.raw.device)
        t0 = time.perf_counter()
        parts = self.buckets()
        try:
            self._send(info)
            for part in parts:
                self._send(part)
        except Exception as exc:
            raise self._failed(version, exc) from exc
        metrics["sync/broadcast_s"] = time.perf_counter() - t0
        metrics["sync/publish_s"] += metrics["sync/broadcast_s"]
        metrics["sync/buckets"] = float(len(parts))
        return metrics

    def _send(self, t: torch.Tensor) -> None:
        self._broadcast(t)

    def _failed(self, version: int, exc: BaseException) -> WeightSyncError:
        gone = self.gone()
        who = (f"worker {', '.join(gone)} is gone" if gone else
               f"one of {', '.join(self.workers)} stopped answering")
        return WeightSyncError(f"broadcasting weights version {version} failed: {who} "
                               f"({type(exc).__name__}: {str(exc)[:200]})")


class CollectiveReceiver(_Member):
    """A worker's end: joins the group as ``rank``, receives each version into a private block
    and verifies it as the shared-memory reader does."""

    def __init__(self, address: GroupAddress, rank: int, layout: Layout, *, device: str = "cpu") -> None:
        import torch.distributed as dist

        super().__init__(layout, address, device)
        self.rank = rank
        try:
            store = dist.TCPStore(address.host, address.port, address.world, False, timeout=self.timeout)
            store.set(f"joined/{rank}", "1")
            self.group = _group(store, rank, address.world, address.nccl, self.timeout)
        except Exception as exc:
            raise WeightSyncError(f"rank {rank} could not join the collective weight group at "
                                  f"{address.host}:{address.port} within {address.timeout_s:g}s "
                                  f"({type(exc).__name__}: {str(exc)[:200]})") from exc

    def receive(self, version: int) -> float:
        """Receive the version being broadcast and verify it is ``version``, whole; returns the
        seconds spent (receiving and verifying)."""
        t0 = time.perf_counter()
        info = torch.zeros(HEADER_WORDS, dtype=torch.int64, device=self.raw.device)
        try:
            self._broadcast(info)
            got, checksum, data_bytes, count, digest, bucket = (int(x) for x in info.tolist()[:6])
            if (data_bytes, count, digest, bucket) != (self.layout.data_bytes, len(self.layout.slots),
                                                      layout_digest(self.layout), self.address.bucket_bytes):
                raise ChannelError(f"weights version {got} are broadcast in another layout ({count} tensors, "
                                   f"{data_bytes} bytes) than this worker's ({len(self.layout.slots)} "
                                   f"tensors, {self.layout.data_bytes} bytes)")
            self.block.header[0] = _WRITING
            for part in self.buckets():
                self._broadcast(part)
        except ChannelError:
            raise
        except Exception as exc:
            raise WeightSyncError(f"receiving weights version {version} failed at rank {self.rank}: "
                                  f"{type(exc).__name__}: {str(exc)[:200]}") from exc
        self.block.header[1] = got
        self.block.header[2] = checksum
        self.block.header[3] = data_bytes
        self.block.header[0] = _COMPLETE
        self.block.verify(version)
        return time.perf_counter() - t0

    def views(self) -> dict[str, torch.Tensor]:
        return dict(self.block.views)
