"""Where a learner rank's host memory goes, phase by phase: the whole model read, sharding, a
training forward and backward, the optimizer step, a second update. What ``benchmarks/scale.py``'s
"rest" on ranks is made of (docs/benchmarks.md, "Scale").

    python benchmarks/rank_memory.py [--model /tmp/tether-scale/qwen2-0.5b] [--world-size 2]

Each rank is a process of its own (gloo, one thread), shards the model as the learner does
(``tether.train.fsdp.shard`` per decoder layer and the root) and runs the learner's shared-prompt
forward (``SharedPrefixForward``) over 2 prompts × 4 samples of 8 + 32 tokens. After each phase it
reads its resident memory and the peak since the phase before (``VmHWM``, reset between phases
through ``/proc/self/clear_refs``), and sets them beside what the phase should hold: the whole
float32 model (4 B a parameter), then per rank a float32 shard, its gradient and AdamW's two
moments (4 + 4 + 8 B a parameter over the ranks).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PROMPTS, GROUP, PROMPT_TOKENS, NEW_TOKENS = 2, 4, 8, 32


def _status() -> tuple[float, float]:
    """(resident, peak resident since the last reset) in MB."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                     "usmblks", "fsmblks", "uordblks", "fordblks",
                                                     "keepcost")]


def _heap() -> tuple[float, float]:
    """glibc's view, in MB: (bytes in live allocations, freed bytes it keeps for reuse)."""
    fn = ctypes.CDLL(None).mallinfo2
    fn.restype = _MallInfo2
    info = fn()
    return (info.uordblks + info.hblkhd) / 2**20, info.fordblks / 2**20


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rank(rank: int, world: int, model_path: str, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    marks: list[dict] = []

    def mark(name: str) -> None:
        gc.collect()
        rss, peak = _status()
        live, kept = _heap()
        marks.append({"phase": name, "rss_mb": rss, "peak_mb": peak, "live_mb": live, "kept_free_mb": kept})
        _reset_peak()

    _reset_peak()
    mark("start (torch imported, group formed)")
    from tether.decoding.prefix_forward import SharedPrefixForward
    from tether.modeling import load_causal_lm
    from tether.train import fsdp

    model, _ = load_causal_lm(model_path)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    mark("whole model read")
    fsdp.shard(model, list(model.model.layers))
    mark("sharded")
    forward = SharedPrefixForward(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (PROMPTS, PROMPT_TOKENS), generator=g)
    completions = torch.randint(0, model.config.vocab_size, (PROMPTS * GROUP, NEW_TOKENS), generator=g)
    ids = torch.cat([prompts.repeat_interleave(GROUP, 0), completions], 1)
    attention = torch.ones_like(ids)
    mask = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    mask[:, PROMPT_TOKENS - 1:] = 1
    for update in (1, 2):
        logp, _ = forward(ids, attention, mask, 1.0, with_entropy=True)
        loss = -(logp * mask).sum() / mask.sum()
        mark(f"update {update}: forward")
        loss.backward()
        del loss, logp
        mark(f"update {update}: backward")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mark(f"update {update}: optimizer step")
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"rank": rank, "parameters": params, "marks": marks}, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/tether-scale/qwen2-0.5b")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = f"/tmp/tether-rank-memory-{os.getpid()}"
    mp.start_processes(_rank, args=(a.world_size, a.model, port, out), nprocs=a.world_size,
                       start_method="spawn")
    ranks = []
    for r in range(a.world_size):
        with open(f"{out}.{r}") as f:
            ranks.append(json.load(f))
        os.unlink(f"{out}.{r}")
    if a.json:
        print(json.dumps(ranks))
        return 0
    p, w = ranks[0]["parameters"], a.world_size
    theory = {"whole model read": 4 * p, "sharded": 4 * p / w, "update 1: backward": 8 * p / w,
              "update 1: optimizer step": 16 * p / w}
    print(f"{p / 1e6:.0f}M parameters, {w} ranks, MB per rank: resident after the phase / its peak "
          "during it; of the resident, live allocations + freed memory the allocator keeps "
          "(glibc's mallinfo2); the state the phase should hold")
    for i, m in enumerate(ranks[0]["marks"]):
        cells = "  ".join(f"r{r['rank']} {r['marks'][i]['rss_mb']:6.0f}/{r['marks'][i]['peak_mb']:6.0f} "
                          f"({r['marks'][i]['live_mb']:6.0f} + {r['marks'][i]['kept_free_mb']:5.0f})"
                          for r in ranks)
        expect = theory.get(m["phase"])
        note = f"  state {expect / 2**20:.0f}" if expect else ""
        print(f"{m['phase']:>36}  {cells}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
