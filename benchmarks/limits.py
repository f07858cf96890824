"""The machine's own limits, measured on the spot, for benchmarks to report their fraction of.

A ratio against a peer moves when the peer gets faster or the machine changes; the fraction of
what this machine can do at all, measured in the same run, at the same thread count and dtype,
does not. Three limits:

- ``matmul_peak``: the best float32 GEMM rate (GFLOP/s, 2·M·N·K per product) over square shapes
  and the shapes the benchmark itself multiplies, at the current ``torch`` thread count;
- ``read_bandwidth``: bytes per second of reading a buffer once (what a decode step that streams
  its weights is up against);
- ``copy_bandwidth``: bytes per second of one contiguous copy of a buffer of the given size into
  a pre-faulted one (what a memory-bound step such as publishing weights is up against).

Each takes the best of a few short timed runs (the machine is shared: the best is the limit,
slower runs are interference). A benchmark measures its limit in every round, beside its subject,
so each round's fraction is taken against what the machine could do at that moment, and reports
the rounds' median and spread (``spread``), naming the rounds it dropped and why (``Rounds``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

SQUARES = ((256, 256, 256), (512, 512, 512), (1024, 1024, 1024))


def best_seconds(fn, *, min_time: float = 0.05, rounds: int = 5) -> float:
    """The fastest of ``rounds`` timings of ``fn``, each repeated until ``min_time`` has passed."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_time:
                break
        best = min(best, elapsed / n)
    return best


def matmul_peak(shapes: Iterable[tuple[int, int, int]] = (), dtype: torch.dtype = torch.float32) -> dict:
    """Best GEMM GFLOP/s over the square shapes and ``shapes`` (M, K, N), at the current thread
    count: ``{"gflops": best, "shape": its (M, K, N), "threads": n, "by_shape": {...}}``."""
    by_shape = {}
    for m, k, n in (*SQUARES, *shapes):
        a = torch.randn(m, k, dtype=dtype)
        b = torch.randn(k, n, dtype=dtype)
        out = torch.empty(m, n, dtype=dtype)
        seconds = best_seconds(lambda a=a, b=b, out=out: torch.mm(a, b, out=out))
        by_shape[f"{m}x{k}x{n}"] = 2 * m * k * n / seconds / 1e9
    best = max(by_shape, key=by_shape.get)
    return {"gflops": by_shape[best], "shape": best, "threads": torch.get_num_threads(), "by_shape": by_shape}


def shape_gflops(shape: str, dtype: torch.dtype = torch.float32) -> float:
    """GFLOP/s of one GEMM shape (``matmul_peak``'s ``"MxKxN"``) now: a round's own peak."""
    m, k, n = (int(x) for x in shape.split("x"))
    a, b, out = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype), torch.empty(m, n, dtype=dtype)
    return 2 * m * k * n / best_seconds(lambda: torch.mm(a, b, out=out)) / 1e9


def copy_bandwidth(nbytes: int) -> dict:
    """Best GB/s of one contiguous copy of ``nbytes`` into a pre-faulted buffer."""
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty(nbytes, dtype=torch.uint8)
    seconds = best_seconds(lambda: dst.copy_(src), min_time=0.02, rounds=5)
    return {"gbps": nbytes / seconds / 1e9, "bytes": nbytes, "threads": torch.get_num_threads()}


def read_bandwidth(nbytes: int) -> dict:
    """Best GB/s of reading ``nbytes`` of float32 once (a sum over them): what a decode step that
    streams its weights is up against."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).normal_()
    seconds = best_seconds(lambda: src.sum(), min_time=0.02, rounds=5)
    return {"gbps": nbytes / seconds / 1e9, "bytes": nbytes, "threads": torch.get_num_threads()}


def matmul_parameters(model: torch.nn.Module) -> int:
    """Parameters that take part in a matrix multiply per token: every Linear weight, the output
    head included (also when it shares the embedding, which is then read twice: as a table, and
    as the head's matrix)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def attention_flops(model: torch.nn.Module, context: int) -> int:
    """FLOPs of one token's attention over ``context`` earlier positions (q·kᵀ and p·v, all
    layers): 4 · heads · head_dim · context per layer."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 4 * cfg.num_attention_heads * head_dim * context * cfg.num_hidden_layers


def spread(values: Iterable[float]) -> dict:
    """The median of ``values`` and their spread: ``{"median", "min", "max", "n"}``."""
    values = sorted(values)
    return {"median": statistics.median(values), "min": values[0], "max": values[-1], "n": len(values)}


BUSY = 0.8
"""A round whose own limit measured below this fraction of the run's best is dropped: the machine
was doing something else then, and the subject's time in it says more about that than about the
subject."""


@dataclass
class Rounds:
    """A benchmark's rounds: each with its figures and the limit measured in it; ``keep`` drops
    the warm-up rounds and those the machine was busy in, saying why."""

    warmup: int = 1
    rows: list[dict] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    def add(self, limit: float, **figures: float) -> None:
        self.rows.append({"limit": limit, **figures})

    def keep(self) -> list[dict]:
        """The rounds kept; ``dropped`` names the others, with the reason."""
        self.dropped = [f"round {i + 1}: warm-up (first use: pages faulted in, caches cold)"
                        for i in range(min(self.warmup, len(self.rows)))]
        rest = list(enumerate(self.rows))[self.warmup:]
        if not rest:  # too few rounds to drop any: keep the warm-up rather than report nothing
            self.dropped = []
            return list(self.rows)
        best = max(r["limit"] for _, r in rest)
        kept = []
        for i, r in rest:
            if r["limit"] < BUSY * best:
                self.dropped.append(f"round {i + 1}: busy machine (its limit measured "
                                    f"{r['limit'] / best:.0%} of the run's best)")
            else:
                kept.append(r)
        return kept

    def summary(self, *names: str) -> dict:
        """Median and spread of each named figure over the kept rounds, and what was dropped."""
        kept = self.keep()
        return {**{name: spread(r[name] for r in kept) for name in names}, "rounds": len(self.rows),
                "kept": len(kept), "dropped": self.dropped}
