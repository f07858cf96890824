"""The vLLM engine against the built-in one, side by side, as a run uses them.

Each engine runs in a real rollout worker process (``ProcessPool``, weights through the shared
weight channel), on the same model, prompts and seeds, one thread each. Per engine: sampled
tokens/s over whole rollout batches (the demo's shape: 8 prompts × 16 samples, 32 new tokens; the
``throughput/gen_tokens_per_s`` a run logs), and publish + load time (``sync/publish_s`` +
``sync/load_s``: the channel write and the worker's verify-and-load) over repeated publications of
changed weights. The two pools alternate, batch by batch and publication by publication, so
drift on a noisy machine falls on both. Start-up time is reported too (vLLM's includes its own
initialisation).

Needs vLLM (``make vllm``; run with ``.venv-vllm/bin/python``). With ``--device cuda`` (a machine
with a GPU and vLLM's CUDA build: scripts/device_check.sh) both engines run in this process on
the GPU instead — rollout workers on a GPU are Ray actors, which this does not start — and the
log-probs of vLLM's samples are also checked against a transformers forward on the same device.

    .venv-vllm/bin/python benchmarks/vllm_engine.py [--sizes small,base] [--batches 8]
        [--publishes 5] [--new-tokens 32] [--device cpu|cuda] [--json]
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

    from tether.config import load_config
    from tether.data.stream import PromptStream
    from tether.data.tasks import get_task
    from tether.data.tiny_model import init_model
    from tether.modeling import load_causal_lm, unique_parameters
    from tether.rollout.backends.local.pool import ProcessPool
    from tether.rollout.settings import PoolSettings

    path = tempfile.mkdtemp() + "/model"
    init_model(path, size=size, seed=0)
    model, _ = load_causal_lm(path)
    stream = PromptStream(get_task("arithmetic").examples("train", 2000, seed=0), batch_size=8)
    out = {}
    for engine in ("torch", "vllm"):
        cfg = load_config(None, ["rollout.group_size=16", f"rollout.max_new_tokens={new_tokens}",
                                 f"rollout.engine={engine}"])
        settings = PoolSettings(cfg, path)
        t0 = time.perf_counter()
        pool = ProcessPool(settings, stream.batch, unique_parameters(model))
        out[engine] = (pool, time.perf_counter() - t0)
    torch.set_num_threads(1)
    return model, out


def measure(size: str, batches: int, publishes: int, new_tokens: int) -> dict:
    import torch

    from tether.modeling import unique_parameters
    from tether.vocabulary import GenerationRequest

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


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_on_device(size: str, batches: int, publishes: int, new_tokens: int, device: str) -> dict:
    """Both engines in this process on ``device``: tokens/s, weight-load time, vLLM's log-prob Δ."""
    import torch

    from tether.data.stream import PromptStream
    from tether.data.tasks import get_task
    from tether.data.tiny_model import init_model
    from tether.decoding.sampling import SamplingParams, stop_ids_for
    from tether.modeling import load_causal_lm, unique_parameters
    from tether.rollout.engines.torch.engine import TorchEngine
    from tether.rollout.engines.vllm.engine import VLLMEngine
    from tether.rollout.engines.vllm.section import VllmSection

    path = tempfile.mkdtemp() + "/model"
    init_model(path, size=size, seed=0)
    model, tok = load_causal_lm(path)
    model.to(device).eval()
    stop = stop_ids_for(tok, "\n")
    engines = {"torch": TorchEngine(model, pad_id=tok.pad_token_id, stop_ids=stop),
               "vllm": VLLMEngine(path, stop_ids=stop, device=torch.device(device).type,
                                  options=VllmSection(gpu_memory_utilization=0.5))}  # the model shares it
    stream = PromptStream(get_task("arithmetic").examples("train", 2000, seed=0), batch_size=8)
    params = SamplingParams(max_new_tokens=new_tokens)
    rates = {e: [] for e in engines}
    loads = {e: [] for e in engines}
    worst = 0.0
    for i in range(batches + 1):
        prompts = [tok(ex.prompt, add_special_tokens=False).input_ids for _, ex in stream.batch(i)]
        for name, engine in engines.items():
            _sync(device)
            t0 = time.perf_counter()
            groups = engine.generate(prompts, samples_per_prompt=16, params=params, seed=i)
            elapsed = time.perf_counter() - t0
            if i:
                rates[name].append(sum(len(c.token_ids) for g in groups for c in g) / elapsed)
            if name == "vllm":
                for prompt, group in zip(prompts, groups, strict=True):
                    c = group[0]
                    ids = torch.tensor([prompt + c.token_ids], device=device)
                    with torch.no_grad():
                        logp = model(ids).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
                    ref = logp.gather(-1, torch.tensor(c.token_ids, device=device)[:, None])[:, 0]
                    worst = max(worst, (ref.cpu() - torch.tensor(c.logprobs)).abs().max().item())
    for version in range(1, publishes + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 1e-3)
        weights = {k: v.detach().cpu() for k, v in unique_parameters(model).items()}  # as published
        for name, engine in engines.items():
            t0 = time.perf_counter()
            engine.load_weights(weights, version)
            _sync(device)
            loads[name].append(time.perf_counter() - t0)
    engines["vllm"].close()
    rows = {e: {"tokens_per_s": statistics.median(rates[e]), "load_s": statistics.median(loads[e])}
            for e in engines}
    return {"size": size, "device": device, "engines": rows, "vllm_logprob_max_abs_delta": worst,
            "parameters": sum(p.numel() for p in unique_parameters(model).values()),
            "vllm_vs_torch_tokens_per_s": rows["vllm"]["tokens_per_s"] / rows["torch"]["tokens_per_s"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="small,base", help="model presets, comma-separated")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--publishes", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--device", default="cpu", help="cpu (worker processes) or cuda (this process)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.device != "cpu":
        results = [measure_on_device(size, a.batches, a.publishes, a.new_tokens, a.device)
                   for size in a.sizes.split(",")]
        print(json.dumps(results, indent=None if a.json else 2))
        return 0
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
