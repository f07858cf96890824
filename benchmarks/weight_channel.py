"""Publish + load throughput of the shared-memory weight channel against a plain memory copy.

The trainer's ``publish`` copies every parameter into the shared block and checksums it (in one
pass over the bytes with the native library, else a copy then a sum); a worker's ``load``
verifies version and checksum (CPU workers bind their parameters to the block, so loading copies
nothing). The baseline copies the same number of bytes once, contiguous, into a pre-faulted
buffer. All at 1 thread.

Each round times a publish and a load both ways (one pass, and a copy then a sum, as without the
native library), the plain copy, then measures the machine's copy limit for
that size (the best of short timed copies, ``benchmarks/limits.py``): each round's fractions are
taken against what the machine did in that round. Reported: the median and spread (min, max) over
the rounds kept; the first round is dropped (it faults the shared pages in), and so is any round
whose limit measured below 80% of the run's best (the machine was busy then), each named.

Target (issue 3): publish + load throughput ≥ 50% of the plain copy, for a ≥25M-parameter model.

    python benchmarks/weight_channel.py [--size base] [--repeats 9] [--json]
    python benchmarks/weight_channel.py --adapters [--size small|base] [--rank 16]

``--channels``: the shared-memory channel, Ray's object store and the collective broadcast side by
side, each to one worker process (``benchmarks/channel_compare.py``; ``--model PATH`` for a Hugging
Face model folder instead of ``--size``).

    python benchmarks/weight_channel.py --channels [--size base] [--model PATH] [--repeats 9]

``--adapters``: LoRA adapters against whole weights through the same channel, the engine's merge
included, and the prediction for a 7B model with rank-16 adapters (``benchmarks/lora_channel.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

import torch

FIGURES = ("fraction_of_memcpy", "fraction_of_limit", "publish_s", "load_s", "memcpy_s", "limit_gbps",
           "two_pass_fraction_of_memcpy", "two_pass_publish_s")


@contextlib.contextmanager
def two_pass():
    """Publish as without the native library: a copy, then a sum."""
    from tether.decoding import native

    helpers = native.helpers
    native.helpers = lambda: None
    try:
        yield
    finally:
        native.helpers = helpers


def measure(size: str, repeats: int) -> dict:
    from limits import Rounds, copy_bandwidth
    from tether.data.tiny_model import build_model
    from tether.decoding.native import helpers
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
    rounds = Rounds(warmup=1)
    try:
        for round_ in range(1, repeats + 2):
            with two_pass():
                two_publish = channel.publish(params, 2 * round_ - 1)["sync/publish_s"]
            two_load = reader.verify(2 * round_ - 1)
            version = 2 * round_
            publish = channel.publish(params, version)["sync/publish_s"]
            load = reader.verify(version)
            t0 = time.perf_counter()
            dst.copy_(src)
            copy = time.perf_counter() - t0
            limit = copy_bandwidth(nbytes)["gbps"]
            rounds.add(limit, fraction_of_memcpy=copy / (publish + load),
                       fraction_of_limit=nbytes / (publish + load) / 1e9 / limit,
                       publish_s=publish, load_s=load, memcpy_s=copy, limit_gbps=limit,
                       two_pass_fraction_of_memcpy=copy / (two_publish + two_load),
                       two_pass_publish_s=two_publish)
    finally:
        reader.close()
        channel.close()
    summary = rounds.summary(*FIGURES)
    median = summary["fraction_of_memcpy"]["median"]
    return {"parameters": sum(t.numel() for t in params.values()), "bytes": nbytes,
            "one_pass_publish": helpers() is not None, **summary,
            "target": 0.5, "meets_target": median >= 0.5}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="base", choices=["tiny", "small", "base"])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--adapters", action="store_true", help="LoRA adapters against whole weights")
    ap.add_argument("--rank", type=int, default=16, help="the adapters' rank (with --adapters)")
    ap.add_argument("--channels", action="store_true", help="shm, object store and collective side by side")
    ap.add_argument("--model", default=None, help="a Hugging Face model folder (with --channels)")
    a = ap.parse_args(argv)
    if a.channels:
        import channel_compare

        return channel_compare.main(["--size", a.size, "--repeats", str(a.repeats),
                                     *(["--model", a.model] if a.model else []),
                                     *(["--json"] if a.json else [])])
    if a.adapters:
        import lora_channel

        return lora_channel.main(["--size", a.size, "--rank", str(a.rank), *(["--json"] if a.json else [])])
    r = measure(a.size, a.repeats)
    if a.json:
        print(json.dumps(r))
        return 0

    def ms(name: str) -> str:
        return f"{r[name]['median'] * 1e3:7.2f} ms"

    def fraction(name: str) -> str:
        f = r[name]
        return f"{f['median']:.2f} (min {f['min']:.2f}, max {f['max']:.2f})"

    print(f"{r['parameters']:,} parameters, {r['bytes'] / 1e6:.1f} MB, 1 thread, median over {r['kept']} of "
          f"{r['rounds']} rounds; publish in one pass: {'yes' if r['one_pass_publish'] else 'no'}")
    print(f"  publish {ms('publish_s')}   load (verify) {ms('load_s')}   memcpy {ms('memcpy_s')}   "
          f"copy limit {r['limit_gbps']['median']:.2f} GB/s")
    print(f"fraction of memcpy: {fraction('fraction_of_memcpy')} (target 0.5: "
          f"{'met' if r['meets_target'] else 'MISSED'})")
    print(f"fraction of the copy limit measured in the same round: {fraction('fraction_of_limit')}")
    print(f"publishing with a copy then a sum instead (as without the native library), same rounds: "
          f"publish {ms('two_pass_publish_s')}, fraction of memcpy {fraction('two_pass_fraction_of_memcpy')}")
    for reason in r["dropped"]:
        print(f"dropped {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
