"""The weight channel: the trainer publishes a version's weights into shared memory allocated
once; rollout workers verify the version and a checksum before using them.

The same block format travels as one object per version through Ray's object store
(``Snapshot``/``open_snapshot``, used by ``tether.rollout.backends.ray``), so both backends verify
weights the same way.

Layout: a 64-byte header, then every tensor at a 64-byte-aligned offset.

    header (int64 × 4): state (0 = being written, 1 = complete), version, checksum, data bytes

The checksum is the wrapping sum of the data region read as int64 words: one read pass at memory
bandwidth, enough to catch a torn or partial write or a stray overwrite (it is an integrity check,
not a cryptographic one). A publication with the native library sums each tensor's words while it
copies them, so publishing reads the weights once, not twice. On CPU a worker *binds* its
parameters to views of the shared snapshot, so loading costs only the verification and every
worker shares one copy of the weights.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Protocol, runtime_checkable

import torch

from tether.errors import TetherError

HEADER_BYTES = 64
ALIGN = 64
_WRITING, _COMPLETE = 0, 1


class ChannelError(TetherError):
    """Published weights failed verification (wrong version, bad checksum, incomplete write)."""


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in the shared block."""

    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """Every tensor's slot, plus the size of the data region (a multiple of 8 bytes)."""

    slots: tuple[Slot, ...]
    data_bytes: int

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> Layout:
        slots, offset = [], HEADER_BYTES
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            slots.append(Slot(name, offset, tuple(t.shape), str(t.dtype).removeprefix("torch."), nbytes))
            offset += -(-nbytes // ALIGN) * ALIGN
        return cls(tuple(slots), offset - HEADER_BYTES)

    @property
    def total_bytes(self) -> int:
        return HEADER_BYTES + self.data_bytes

    @property
    def payload_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots)


class _Block:
    """Typed views of a block's header, data and tensors over ``raw``, its bytes."""

    def __init__(self, raw: torch.Tensor, layout: Layout,
                 shm: shared_memory.SharedMemory | None = None) -> None:
        self.shm = shm
        self.layout = layout
        assert raw.dtype == torch.uint8 and raw.numel() >= layout.total_bytes
        self.header = raw[:HEADER_BYTES].view(torch.int64)  # (8,)
        self.words = raw[HEADER_BYTES:].view(torch.int64)  # (data_bytes / 8,)
        self.views = {
            s.name: raw[s.offset:s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)
            for s in layout.slots
        }

    def checksum(self) -> int:
        return int(self.words.sum())

    def write(self, tensors: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        """Copy ``tensors`` in as ``version``; returns ``sync/publish_s``, ``sync/bytes``.

        With the native library (``tether.decoding.native.helpers``) each CPU tensor is copied
        and checksummed in one pass over its bytes; otherwise, and for a tensor elsewhere (a
        GPU's) or laid out otherwise, copied by torch and its words summed after. The checksum
        is the same either way."""
        names = [s.name for s in self.layout.slots]
        if set(tensors) != set(names):
            extra, missing = set(tensors) - set(names), set(names) - set(tensors)
            raise ChannelError(f"published tensors do not match the channel layout "
                               f"(missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]})")
        from tether.decoding.native import helpers

        lib = helpers()

        def copy_in() -> int | None:
            with torch.no_grad():
                if lib is None:
                    for name in names:
                        self.views[name].copy_(tensors[name])
                    return None
                total = 0
                for slot in self.layout.slots:
                    src, dst = tensors[slot.name], self.views[slot.name]
                    if (src.device.type == "cpu" and src.dtype == dst.dtype and src.is_contiguous()
                            and src.numel() * src.element_size() == slot.nbytes):
                        total += lib.tether_copy_checksum(dst.data_ptr(), src.data_ptr(), slot.nbytes)
                    else:
                        dst.copy_(src)
                        total += int(self.slot_words(slot).sum())
                return _wrap(total)

        return self.write_with(copy_in, version)

    def slot_words(self, slot: Slot) -> torch.Tensor:
        """The data region's int64 words that hold ``slot`` (its last partial word padded with
        the block's zeros)."""
        start = (slot.offset - HEADER_BYTES) // 8
        return self.words[start:start + -(-slot.nbytes // 8)]

    def write_with(self, copy_in: Callable[[], int | None], version: int) -> dict[str, float]:
        """Publish ``version`` with ``copy_in`` filling the tensors' views (whoever does it: this
        process, or learner ranks each writing its own rows): the block reads as being written
        until it returns, and complete, with its checksum, after: the one ``copy_in`` returns
        when it summed the words as it wrote them, else summed here. If ``copy_in`` raises, the
        block stays marked incomplete and no reader takes it."""
        t0 = time.perf_counter()
        self.header[0] = _WRITING
        summed = copy_in()
        self.header[1] = version
        self.header[2] = self.checksum() if summed is None else summed
        self.header[3] = self.layout.data_bytes
        self.header[0] = _COMPLETE
        seconds = time.perf_counter() - t0
        return {"sync/publish_s": seconds, "sync/bytes": float(self.layout.payload_bytes)}

    def verify(self, version: int) -> float:
        """Check the block holds a complete write of ``version``; returns seconds spent."""
        t0 = time.perf_counter()
        state, got, expected_sum, nbytes = (int(x) for x in self.header[:4])
        if state != _COMPLETE:
            raise ChannelError(f"weights for version {version} are incomplete (a publish was interrupted)")
        if got != version:
            raise ChannelError(f"weight channel holds version {got}, expected {version}")
        if nbytes != self.layout.data_bytes:
            raise ChannelError(f"weight channel layout mismatch: {nbytes} bytes, expected "
                               f"{self.layout.data_bytes}")
        actual = self.checksum()
        if actual != expected_sum:
            raise ChannelError(f"weights for version {version} fail their checksum "
                               f"({actual} != {expected_sum}): the shared block was modified or torn")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.header = self.words = None  # type: ignore[assignment]
        self.views = {}
        if self.shm is not None:
            self.shm.close()


def _wrap(total: int) -> int:
    """``total`` as the wrapping int64 sum a tensor's ``sum`` gives."""
    return (total + 2 ** 63) % 2 ** 64 - 2 ** 63


def _map(shm: shared_memory.SharedMemory, layout: Layout) -> _Block:
    return _Block(torch.frombuffer(shm.buf, dtype=torch.uint8, count=layout.total_bytes), layout, shm)


@runtime_checkable
class ChannelWriter(Protocol):
    """Weights that write themselves into a channel's block from elsewhere (learner ranks, each
    its own rows). The channel marks the block as being written before ``write_into`` and
    complete, with its checksum, after it returns."""

    def write_into(self, name: str, layout: Layout) -> None:
        """Copy every tensor of ``layout`` into the shared block called ``name``."""
        ...


class WeightChannel:
    """The publishing side: owns the shared block and unlinks it on ``close``."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        shm = shared_memory.SharedMemory(create=True, size=layout.total_bytes)
        self._block = _map(shm, layout)
        self._block.header.zero_()
        self.name = shm.name

    @classmethod
    def for_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> WeightChannel:
        return cls(Layout.of(tensors))

    def publish(self, tensors: Mapping[str, torch.Tensor] | ChannelWriter, version: int) -> dict[str, float]:
        """Write ``tensors`` in as ``version`` (copied by this process, or by a ``ChannelWriter``
        straight from where they live); returns ``sync/publish_s``, ``sync/bytes``."""
        if isinstance(tensors, ChannelWriter):
            def copy_in() -> None:
                tensors.write_into(self.name, self.layout)

            return self._block.write_with(copy_in, version)
        return self._block.write(tensors, version)

    def views(self) -> dict[str, torch.Tensor]:
        return dict(self._block.views)

    def verify(self, version: int) -> float:
        """Check the block holds a complete write of ``version``."""
        return self._block.verify(version)

    def close(self) -> None:
        if self._block is not None:
            shm = self._block.shm
            self._block.close()
            self._block = None  # type: ignore[assignment]
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()


class WeightReader:
    """The worker side: attaches to the block by name and verifies what it reads."""

    def __init__(self, name: str, layout: Layout) -> None:
        # Worker processes are the publisher's children and share its resource tracker, where
        # registration is idempotent: attaching neither leaks the block nor unlinks it early.
        shm = shared_memory.SharedMemory(name=name)
        self._block = _map(shm, layout)

    def views(self) -> dict[str, torch.Tensor]:
        return dict(self._block.views)

    def verify(self, version: int) -> float:
        """Check the block holds a complete write of ``version``; returns seconds spent."""
        return self._block.verify(version)

    def newest(self) -> int | None:
        """The version of a complete write in the block now, None while one is being written.
        A cheap look at the header: nothing is verified."""
        state, version = (int(x) for x in self._block.header[:2])
        return version if state == _COMPLETE else None

    def copy(self, version: int, into: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Copy the whole block into ``into`` (a private uint8 buffer of ``layout.total_bytes``)
        and verify the copy holds a complete write of ``version``: its views, or None when a
        publication overwrote the block while it was copied (torn; try again later)."""
        layout = self._block.layout
        into.copy_(torch.frombuffer(self._block.shm.buf, dtype=torch.uint8, count=layout.total_bytes))
        copied = _Block(into, self._block.layout)
        try:
            copied.verify(version)
        except ChannelError:
            return None
        return dict(copied.views)

    def close(self) -> None:
        self._block.close()


class Snapshot:
    """The publishing side for an object store: one staging block, allocated once, written per
    version and handed out as a NumPy array (``array``) to put into the store as one object."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._raw = torch.zeros(layout.total_bytes, dtype=torch.uint8)
        self._block = _Block(self._raw, layout)

    @classmethod
    def for_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> Snapshot:
        return cls(Layout.of(tensors))

    def write(self, tensors: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        return self._block.write(tensors, version)

    @property
    def array(self):
        """The block's bytes as a NumPy array (shares memory with the staging block)."""
        return self._raw.numpy()


def open_snapshot(array, layout: Layout, version: int) -> tuple[dict[str, torch.Tensor], float]:
    """Verify a snapshot fetched from an object store; returns its tensor views and the seconds
    spent verifying. The views share the (possibly read-only) fetched memory: bind them, do not
    write them."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        raw = torch.from_numpy(array)
    if raw.dtype != torch.uint8 or raw.numel() != layout.total_bytes:
        raise ChannelError(f"weight snapshot for version {version} has {raw.numel()} bytes of {raw.dtype}, "
                           f"expected {layout.total_bytes} bytes of uint8")
    block = _Block(raw, layout)
    seconds = block.verify(version)
    return dict(block.views), seconds
