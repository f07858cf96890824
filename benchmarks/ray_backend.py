"""The Ray backend against the local-process backend: publish time and per-batch overhead.

Both pools run side by side in one invocation, one worker each, on the same model, and are
measured in interleaved repeats (medians):

- publish: ``pool.publish(weights, v)`` wall time for a ≥25M-parameter model (``--size base``),
  all the way to every worker having verified and loaded the version. Local: copy into shared
  memory + checksum, then each worker verifies. Ray: the same copy into a staging block, one
  ``ray.put`` into the object store, then each actor fetches (zero-copy on its node), verifies
  and binds.
- per-batch overhead: launch → batch back in the driver, minus the worker's own generate and
  score time, for a one-prompt, one-token batch on the tiny model: what the backend adds to
  every rollout batch (messaging, pickling, the collector thread).

    python benchmarks/ray_backend.py [--quick] [--repeats N] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _pools(model_dir: Path, weights, tmp: Path):
    from tether.config import load_config
    from tether.data.stream import PromptStream
    from tether.data.tasks import get_task
    from tether.rollout.backends.local.pool import ProcessPool
    from tether.rollout.backends.ray.cluster import RayOptions
    from tether.rollout.backends.ray.pool import RayPool
    from tether.rollout.settings import PoolSettings

    stream = PromptStream(get_task("arithmetic").examples("train", 100, seed=0), batch_size=1)
    # the smallest batch a recipe allows (one prompt, a group of two, one token): what is timed is
    # the publication
    cfg = load_config(None, ["rollout.batch_size=1", "rollout.group_size=2", "rollout.max_new_tokens=1"])
    settings = PoolSettings(cfg, str(model_dir))
    local = ProcessPool(settings, stream.batch, weights)
    try:
        ray = RayPool(settings, stream.batch, weights, options=RayOptions(local_cpus=2), run_dir=tmp / "run")
    except BaseException:
        local.close()
        raise
    return {"local": local, "ray": ray}


def measure(size: str, repeats: int) -> dict:
    import torch
    from transformers.utils import logging as hf_logging

    from tether.data.tiny_model import init_model
    from tether.modeling import load_causal_lm, unique_parameters
    from tether.vocabulary import GenerationRequest

    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="tether-bench-"))
    out: dict = {"size": size, "repeats": repeats}
    for label, model_size in (("publish", size), ("batch", "tiny")):
        if not (tmp / model_size).exists():
            init_model(tmp / model_size, size=model_size, seed=0)
        model, _ = load_causal_lm(tmp / model_size)
        weights = unique_parameters(model)
        pools = _pools(tmp / model_size, weights, tmp / label)
        try:
            times: dict[str, list[float]] = {name: [] for name in pools}
            for rep in range(repeats + 1):
                version = rep + 1
                for name, pool in pools.items():
                    if label == "publish":
                        t0 = time.perf_counter()
                        pool.publish(weights, version)
                        took = time.perf_counter() - t0
                    else:
                        t0 = time.perf_counter()
                        pool.launch(GenerationRequest(index=rep, version=pool.version))
                        (batch,) = pool.wait(60)
                        took = time.perf_counter() - t0 - batch.metrics["time/generate"] \
                            - batch.metrics["time/score"]
                    if rep > 0:  # the first round faults pages in and warms caches
                        times[name].append(took)
        finally:
            for pool in pools.values():
                pool.close()
        med = {name: statistics.median(v) for name, v in times.items()}
        if label == "publish":
            out["parameters"] = sum(t.numel() for t in weights.values())
            out["bytes"] = sum(t.numel() * t.element_size() for t in weights.values())
            out["publish_s"] = med
            out["publish_ratio_ray_vs_local"] = med["ray"] / med["local"]
        else:
            out["batch_overhead_s"] = med
            out["batch_overhead_ratio_ray_vs_local"] = med["ray"] / med["local"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="base", choices=["tiny", "small", "base"],
                    help="model size for the publish measurement")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="7 repeats")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    r = measure(a.size, 7 if a.quick else a.repeats)
    if a.json:
        print(json.dumps(r))
        return 0
    print(f"publish: {r['parameters']:,} parameters ({r['bytes'] / 1e6:.0f} MB), median of {r['repeats']}")
    for name in ("local", "ray"):
        print(f"  {name:5s} {r['publish_s'][name] * 1e3:8.1f} ms")
    print(f"  ray / local: {r['publish_ratio_ray_vs_local']:.2f}×")
    print("per-batch overhead (round trip minus the worker's generate + score), tiny model, 1×1 batch")
    for name in ("local", "ray"):
        print(f"  {name:5s} {r['batch_overhead_s'][name] * 1e3:8.2f} ms")
    print(f"  ray / local: {r['batch_overhead_ratio_ray_vs_local']:.2f}×")
    return 0


if __name__ == "__main__":
    sys.exit(main())
