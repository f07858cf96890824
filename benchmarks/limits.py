"""The machine's own limits, measured on the spot, for benchmarks to report their fraction of.

A ratio against a peer moves when the peer gets faster or the machine changes; the fraction of
what this machine can do at all, measured in the same run, at the same thread count and dtype,
does not. Two limits:

- ``matmul_peak``: the best float32 GEMM rate (GFLOP/s, 2·M·N·K per product) over square shapes
  and the shapes the benchmark itself multiplies, at the current ``torch`` thread count;
- ``copy_bandwidth``: bytes per second of one contiguous copy of a buffer of the given size into
  a pre-faulted one (what a memory-bound step such as publishing weights is up against).

Each takes the best of a few short timed runs (the machine is shared: the best is the limit,
slower runs are interference).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

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


def copy_bandwidth(nbytes: int) -> dict:
    """Best GB/s of one contiguous copy of ``nbytes`` into a pre-faulted buffer."""
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty(nbytes, dtype=torch.uint8)
    seconds = best_seconds(lambda: dst.copy_(src), min_time=0.02, rounds=5)
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
