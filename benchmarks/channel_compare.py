"""The three weight channels side by side: shared memory, Ray's object store and the collective
broadcast (gloo), each publishing the same weights to one worker process that verifies them.

One round per channel and version: the driver publishes (``sync/publish_s``: the copy into the
channel's block and checksum, plus the put or the broadcast) and the worker verifies version and
checksum (shared memory: in place; object store: ``ray.get`` of the snapshot in a Ray actor, then
``open_snapshot``; collective: receiving every bucket into its private block, then the same
check). Timed: the wall time from the start of the publication to the worker's answer, so every
channel pays one hop to another process. The first round of each channel is dropped (it faults
pages in and connects). All at 1 thread, on this machine's loopback: no network is crossed, so
the collective's figure is gloo's copying through TCP sockets, not a NIC's.

    python benchmarks/weight_channel.py --channels [--size base] [--repeats 9]
    python benchmarks/weight_channel.py --channels --model PATH  # a Hugging Face model folder
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import statistics
import sys
import time

import torch

CHANNELS = ("shm", "object_store", "collective")


def _worker(kind: str, conn, where) -> None:
    """A worker process: attach to the channel, then verify each version it is told to."""
    torch.set_num_threads(1)
    if kind == "shm":
        from tether.rollout.channel import WeightReader

        reader = WeightReader(*where)
        load = reader.verify
    else:
        from tether.rollout.collective import CollectiveReceiver

        address, layout = where
        load = CollectiveReceiver(address, 1, layout).receive
    conn.send("ready")
    while True:
        version = conn.recv()
        if version is None:
            return
        conn.send(load(version))


def _rounds(publish, ask, repeats: int) -> dict:
    """Time ``repeats + 1`` versions (the first dropped): ``ask(v)`` tells the worker, ``publish(v)``
    publishes and returns its seconds; ``ask`` returns a function that waits for the answer."""
    walls, publishes, loads = [], [], []
    for version in range(1, repeats + 2):
        t0 = time.perf_counter()
        answer = ask(version)
        publishes.append(publish(version))
        loads.append(answer())
        walls.append(time.perf_counter() - t0)
    return {"wall_s": statistics.median(walls[1:]), "publish_s": statistics.median(publishes[1:]),
            "load_s": statistics.median(loads[1:]), "rounds": repeats}


def _process_channel(kind: str, params, repeats: int) -> dict:
    from tether.rollout.channel import Layout, WeightChannel
    from tether.rollout.collective import CollectivePublisher

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    layout = Layout.of(params)
    if kind == "shm":
        channel = WeightChannel(layout)
        where = (channel.name, layout)
    else:
        channel = CollectivePublisher(layout, ["worker"], timeout_s=600)
        where = (channel.address, layout)
    proc = ctx.Process(target=_worker, args=(kind, there, where), daemon=True)
    proc.start()
    if kind == "collective":
        channel.join()  # the worker joins the group before it answers
    assert here.recv() == "ready"

    def ask(version):
        if kind == "collective":  # it must be receiving while the broadcast runs
            here.send(version)
            return here.recv
        return lambda: (here.send(version), here.recv())[1]

    extra = {}

    def publish(version):
        metrics = channel.publish(params, version)
        if "sync/buckets" in metrics:
            extra["buckets"] = int(metrics["sync/buckets"])
        return metrics["sync/publish_s"]

    try:
        return {**_rounds(publish, ask, repeats), **extra}
    finally:
        here.send(None)
        proc.join(60)
        channel.close()


def _object_store(params, repeats: int) -> dict:
    import os

    import ray

    from tether.rollout.backends.ray.cluster import put_snapshot
    from tether.rollout.channel import Snapshot, open_snapshot

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    snapshot = Snapshot.for_tensors(params)
    nbytes = snapshot.layout.total_bytes
    ray.init(address="local", num_cpus=1, include_dashboard=False, configure_logging=False,
             log_to_driver=False, object_store_memory=max(2 * nbytes + (256 << 20), 512 << 20))
    layout = snapshot.layout

    @ray.remote(num_cpus=1)
    class Worker:
        def __init__(self):
            torch.set_num_threads(1)

        def load(self, refs, version):
            t0 = time.perf_counter()
            views, _ = open_snapshot(ray.get(refs[0]), layout, version)
            del views
            return time.perf_counter() - t0

    try:
        worker = Worker.remote()
        refs: dict[int, object] = {}

        def publish(version):
            ref, metrics = put_snapshot(ray, snapshot, params, version)
            refs.clear()
            refs[version] = ref
            return metrics["sync/publish_s"]

        def ask(version):
            return lambda: ray.get(worker.load.remote([refs[version]], version))

        return _rounds(publish, ask, repeats)
    finally:
        ray.shutdown()


def measure(params: dict, repeats: int, channels=CHANNELS) -> dict:
    torch.set_num_threads(1)
    nbytes = sum(t.numel() * t.element_size() for t in params.values())
    out = {"parameters": sum(t.numel() for t in params.values()), "bytes": nbytes}
    for kind in channels:
        out[kind] = _object_store(params, repeats) if kind == "object_store" else \
            _process_channel(kind, params, repeats)
        out[kind]["gbps"] = nbytes / out[kind]["wall_s"] / 1e9
        gc.collect()
    return out


def _params(size: str, model: str | None) -> dict:
    from tether.modeling import unique_parameters

    if model:
        from tether.modeling import load_causal_lm

        return unique_parameters(load_causal_lm(model)[0])
    from tether.data.tiny_model import build_model

    return unique_parameters(build_model(87, size=size))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="base", choices=["tiny", "small", "base"])
    ap.add_argument("--model", default=None, help="a Hugging Face model folder instead of --size")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", default=",".join(CHANNELS), help="channels to run, comma-separated")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    with torch.no_grad():
        params = {k: v.detach() for k, v in _params(a.size, a.model).items()}
    r = measure(params, a.repeats, [c for c in a.only.split(",") if c])
    if a.json:
        print(json.dumps(r))
        return 0
    print(f"{r['parameters']:,} parameters, {r['bytes'] / 1e6:.1f} MB, 1 thread, one worker process, "
          f"median of {a.repeats} versions per channel (the first dropped)")
    base = r.get("shm")
    print(f"  {'channel':<13}{'publish':>11}{'load':>11}{'wall':>11}{'GB/s':>8}{'wall / shm':>12}")
    for kind in CHANNELS:
        if kind not in r:
            continue
        f = r[kind]
        ratio = f"{f['wall_s'] / base['wall_s']:.2f}×" if base else "-"
        print(f"  {kind:<13}{f['publish_s'] * 1e3:>8.1f} ms{f['load_s'] * 1e3:>8.1f} ms"
              f"{f['wall_s'] * 1e3:>8.1f} ms{f['gbps']:>8.2f}{ratio:>12}"
              + (f"   ({f['buckets']} buckets)" if "buckets" in f else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
