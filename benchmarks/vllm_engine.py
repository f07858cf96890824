"""The vLLM engine against the built-in one, side by side, as a run uses them.

Each engine runs in a real rollout worker process (``ProcessPool``, weights through the shared
weight channel), on the same model, prompts and seeds, one thread each. Per engine: sampled
tokens/s over whole rollout batches (the demo's shape: 8 prompts × 16 samples, 32 new tokens; the
``throughput/gen_tokens_per_s`` a run logs), and publish + load time (``sync/publish_s`` +
``sync/load_s``: the channel write and the worker's verify-and-load) over repeated publications of
changed weights. The two pools alternate, batch by batch and publication by publication, so
drift on a noisy machine falls on both. Start-up time is reported too (vLLM's includes its own
initialisation).

Needs vLLM (``make vllm``; run with ``.venv-vllm/bin/python``). On a GPU, scripts/device_check.sh
runs the vLLM engine on CUDA where vLLM's CUDA build is installed.

    .venv-vllm/bin/python benchmarks/vllm_engine.py [--sizes small,base] [--batches 8]
        [--publishes 5] [--new-tokens 32] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time


def pools(size: str, new_tokens: int):
    import torch

    from tether.data.stream import PromptStream
    from tether.data.tasks import get_task
    from tether.data.tiny_model import init_model
    from tether.decoding.sampling import SamplingParams
    from tether.modeling import load_causal_lm, unique_parameters
    from tether.rollout.pool import PoolSettings, ProcessPool
    from tether.rollout.vllm_engine import VllmOptions

    path = tempfile.mkdtemp() + "/model"
    init_model(path, size=size, seed=0)
    model, _ = load_causal_lm(path)
    stream = PromptStream(get_task("arithmetic").examples("train", 2000, seed=0), batch_size=8)
    out = {}
    for engine in ("torch", "vllm"):
        settings = PoolSettings(model_path=path, task="arithmetic", group_size=16,
                                params=SamplingParams(max_new_tokens=new_tokens), engine=engine,
                                vllm=VllmOptions(dtype="float32") if engine == "vllm" else None)
        t0 = time.perf_counter()
        pool = ProcessPool(settings, stream.batch, unique_parameters(model))
        out[engine] = (pool, time.perf_counter() - t0)
    torch.set_num_threads(1)
    return model, out


def measure(size: str, batches: int, publishes: int, new_tokens: int) -> dict:
    import torch

    from tether.loop.protocols import GenerationRequest
    from tether.modeling import unique_parameters

    model, started = pools(size, new_tokens)
    result = {"size": size, "parameters": sum(p.numel() for p in unique_parameters(model).values()),
              "batch": "8 prompts × 16 samples", "new_tokens": new_tokens, "engines": {}}
    rates = {e: [] for e in started}
    syncs = {e: [] for e in started}
    try:
        version = 0
        for i in range(batches + 1):  # the first batch of each warms up and is not counted
            for engine, (pool, _) in started.items():
                pool.launch(GenerationRequest(index=i, version=version))
                got = []
                while not got:
                    got = pool.wait(300)
                if i:
                    rates[engine].append(got[0].metrics["throughput/gen_tokens_per_s"])
        for _ in range(publishes):
            version += 1
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 1e-3)
            weights = unique_parameters(model)
            for engine, (pool, _) in started.items():
                m = pool.publish(weights, version)
                syncs[engine].append(m["sync/publish_s"] + m["sync/load_s"])
        sync_bytes = m["sync/bytes"]
    finally:
        for pool, _ in started.values():
            pool.close()
    for engine, (_, start_s) in started.items():
        result["engines"][engine] = {"tokens_per_s": statistics.median(rates[engine]),
                                     "publish_load_s": statistics.median(syncs[engine]),
                                     "start_s": start_s}
    e = result["engines"]
    result["sync_bytes"] = sync_bytes
    result["vllm_vs_torch_tokens_per_s"] = e["vllm"]["tokens_per_s"] / e["torch"]["tokens_per_s"]
    result["vllm_vs_torch_publish_load"] = e["vllm"]["publish_load_s"] / e["torch"]["publish_load_s"]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="small,base", help="model presets, comma-separated")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--publishes", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    results = [measure(size, a.batches, a.publishes, a.new_tokens) for size in a.sizes.split(",")]
    if a.json:
        print(json.dumps(results))
        return 0
    print(f"rollout batches of 8 prompts × 16 samples, {a.new_tokens} new tokens, one thread per engine, "
          f"median of {a.batches} batches and {a.publishes} publications")
    print(f"{'model':>16}{'engine':>8}{'tokens/s':>11}{'publish+load':>14}{'start':>8}")
    for r in results:
        for engine, row in r["engines"].items():
            name = f"{r['size']} {r['parameters'] / 1e6:.1f}M"
            print(f"{name:>16}{engine:>8}{row['tokens_per_s']:>11.0f}"
                  f"{row['publish_load_s'] * 1e3:>11.1f} ms{row['start_s']:>7.1f}s")
        print(f"{'':>16}{'vllm/torch':>10}: tokens/s {r['vllm_vs_torch_tokens_per_s']:.2f}×, publish+load "
              f"{r['vllm_vs_torch_publish_load']:.2f}× ({r['sync_bytes'] / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
