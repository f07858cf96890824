"""Publish + load throughput of the shared-memory weight channel against a plain memory copy.

The trainer's ``publish`` copies every parameter into the shared block and checksums it; a
worker's ``load`` verifies version and checksum (CPU workers bind their parameters to the block,
so loading copies nothing). The baseline copies the same number of bytes once, contiguous, into
a pre-faulted buffer. All at 1 thread, interleaved repeats, medians.

Target (issue 3): publish + load throughput ≥ 50% of the plain copy, for a ≥25M-parameter model.
Also reported (issue 20): the fraction of the machine's copy limit, the best of short timed copies
of the same size in the same run (``benchmarks/limits.py``), which the median copy above is not.

    python benchmarks/weight_channel.py [--size base] [--repeats 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def measure(size: str, repeats: int) -> dict:
    from tether.data.tiny_model import build_model
    from tether.modeling import unique_parameters
    from tether.rollout.channel import WeightChannel, WeightReader

    torch.set_num_threads(1)
    model = build_model(87, size=size)
    params = unique_parameters(model)
    channel = WeightChannel.for_tensors(params)
    reader = WeightReader(channel.name, channel.layout)
    nbytes = channel.layout.payload_bytes
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)  # fault the pages in
    publish, load, copy = [], [], []
    try:
        for version in range(1, repeats + 2):
            met = channel.publish(params, version)
            t_load = reader.verify(version)
            t0 = time.perf_counter()
            dst.copy_(src)
            t_copy = time.perf_counter() - t0
            if version > 1:  # the first publish faults the shared pages in
                publish.append(met["sync/publish_s"])
                load.append(t_load)
                copy.append(t_copy)
    finally:
        reader.close()
        channel.close()
    p, ld, c = statistics.median(publish), statistics.median(load), statistics.median(copy)
    from limits import copy_bandwidth

    limit = copy_bandwidth(nbytes)["gbps"]  # the best copy this run saw: the machine's limit
    return {
        "copy_limit_gbps": limit,
        "fraction_of_limit": nbytes / (p + ld) / 1e9 / limit,
        "parameters": sum(t.numel() for t in params.values()),
        "bytes": nbytes,
        "publish_s": p,
        "load_s": ld,
        "memcpy_s": c,
        "publish_load_gbps": nbytes / (p + ld) / 1e9,
        "memcpy_gbps": nbytes / c / 1e9,
        "fraction_of_memcpy": c / (p + ld),
        "target": 0.5,
        "meets_target": c / (p + ld) >= 0.5,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="base", choices=["tiny", "small", "base"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    r = measure(a.size, a.repeats)
    if a.json:
        print(json.dumps(r))
        return 0
    print(f"{r['parameters']:,} parameters, {r['bytes'] / 1e6:.1f} MB, median of {a.repeats}, 1 thread")
    print(f"  publish {r['publish_s'] * 1e3:7.2f} ms   load (verify) {r['load_s'] * 1e3:7.2f} ms   "
          f"→ {r['publish_load_gbps']:.2f} GB/s")
    print(f"  memcpy  {r['memcpy_s'] * 1e3:7.2f} ms                            → {r['memcpy_gbps']:.2f} GB/s")
    print(f"fraction of memcpy: {r['fraction_of_memcpy']:.2f} (target 0.5: "
          f"{'met' if r['meets_target'] else 'MISSED'})")
    print(f"fraction of this machine's copy limit ({r['copy_limit_gbps']:.2f} GB/s, the best copy measured): "
          f"{r['fraction_of_limit']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
