"""Publishing LoRA adapters against publishing every weight, side by side, and what it predicts
for a 7B model.

One version's cost on each side of the shared-memory weight channel (``benchmarks/
weight_channel.py`` measures the channel itself against a memory copy):

- whole weights: the learner's ``publish`` of every parameter (copy + checksum into the block),
  a worker's ``load`` (verify version and checksum; a CPU worker binds to the block, so it copies
  nothing);
- adapters (``train.lora_rank``, every linear layer adapted): the ``publish`` of the A and B
  matrices only, the worker's ``load`` of them, and the engine's merge of every adapted layer,
  W = W₀ + (α/r)·B·A (``tether.adapters``): a rank-r product and a copy per layer.

Then a prediction for Llama-2-7B's shapes (32 layers, hidden 4096, MLP 11008, vocabulary 32000)
with a rank-16 adapter on every linear layer: bytes published per version both ways, and times
at the rates measured here (publish and load per byte, merge per multiply-add).

    python benchmarks/lora_channel.py [--size small|base] [--rank 16] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

LLAMA_7B = dict(hidden=4096, inter=11008, layers=32, vocab=32000)


def _version_cost(params: dict[str, torch.Tensor], repeats: int, after_load=None) -> dict[str, float]:
    from tether.rollout.channel import WeightChannel, WeightReader

    channel = WeightChannel.for_tensors(params)
    reader = WeightReader(channel.name, channel.layout)
    publish, load, apply = [], [], []
    try:
        for version in range(1, repeats + 2):
            publish.append(channel.publish(params, version)["sync/publish_s"])
            load.append(reader.verify(version))
            t0 = time.perf_counter()
            if after_load is not None:
                after_load(reader.views())
            apply.append(time.perf_counter() - t0)
    finally:
        reader.close()
        channel.close()
    keep = slice(1, None)  # the first version faults the shared pages in
    return {"bytes": channel.layout.payload_bytes, "publish_s": statistics.median(publish[keep]),
            "load_s": statistics.median(load[keep]), "apply_s": statistics.median(apply[keep])}


def measure(size: str, rank: int, repeats: int) -> dict:
    from tether.adapters import MergedAdapter
    from tether.data.tiny_model import build_model
    from tether.modeling import unique_parameters
    from tether.train import lora

    torch.set_num_threads(1)
    model = build_model(87, size=size)
    whole = _version_cost(unique_parameters(model), repeats)
    settings = argparse.Namespace(lora_rank=rank, lora_alpha=2.0 * rank, lora_dropout=0.0,
                                  lora_targets=["all-linear"])
    adapted = lora.attach(build_model(87, size=size), settings)
    with torch.no_grad():  # B off zero, as after training
        for name, p in adapted.named_parameters():
            if ".lora_B" in name:
                p.normal_(0, 0.01)
    engine_model = build_model(87, size=size)
    merger = MergedAdapter(engine_model, 2.0)
    adapters = lora.adapters(adapted)
    merger.apply(adapters)  # the first application keeps the base weights
    small = _version_cost(adapters, repeats, after_load=merger.apply)
    multiply_adds = sum(t.shape[0] * t.shape[1] * rank for n, t in engine_model.named_parameters()
                        if n.removesuffix(".weight") in merger.base)
    return {"size": size, "rank": rank, "parameters": sum(p.numel() for p in model.parameters()),
            "whole": whole, "adapters": small, "merge_multiply_adds": multiply_adds}


def predict_7b(r: dict, rank: int = 16) -> dict:
    """Bytes per version and times for Llama-2-7B shapes at the rates of ``r`` (float32 here;
    bf16 halves the whole-weight bytes)."""
    h, m, n, v = (LLAMA_7B[k] for k in ("hidden", "inter", "layers", "vocab"))
    linears = [(h, h)] * 4 + [(m, h)] * 2 + [(h, m)]  # q, k, v, o (no GQA in 7B), gate, up, down: (out, in)
    weights = n * (sum(o * i for o, i in linears) + 2 * h) + 2 * v * h + h
    adapter = n * sum(rank * (o + i) for o, i in linears)
    whole, small = r["whole"], r["adapters"]
    per_byte_whole = (whole["publish_s"] + whole["load_s"]) / whole["bytes"]
    per_byte_adapter = (small["publish_s"] + small["load_s"]) / small["bytes"]
    per_multiply_add = small["apply_s"] / r["merge_multiply_adds"]
    merge_ops = n * sum(o * i * rank for o, i in linears)
    return {"weights": weights, "adapter_parameters": adapter, "whole_bytes_fp32": 4 * weights,
            "whole_bytes_bf16": 2 * weights, "adapter_bytes_fp32": 4 * adapter,
            "whole_s_fp32": 4 * weights * per_byte_whole,
            "adapter_s": 4 * adapter * per_byte_adapter + merge_ops * per_multiply_add,
            "adapter_merge_s": merge_ops * per_multiply_add}


def arguments(argv: list[str] | None, description: str) -> argparse.Namespace:
    """The LoRA benchmarks' command line: the model size, the adapters' rank, repeats, --json."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--size", default="small", choices=["tiny", "small", "base"])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = arguments(argv, __doc__.splitlines()[0])
    r = measure(a.size, a.rank, a.repeats)
    r["llama_7b_rank_16"] = predict_7b(r)
    if a.json:
        print(json.dumps(r))
        return 0
    w, s, p = r["whole"], r["adapters"], r["llama_7b_rank_16"]
    w_total = w["publish_s"] + w["load_s"]
    s_total = s["publish_s"] + s["load_s"] + s["apply_s"]
    print(f"{a.size}: {r['parameters']:,} parameters, rank {a.rank} on every linear layer, 1 thread, "
          f"median of {a.repeats}")
    print(f"  whole weights: {w['bytes'] / 1e6:8.2f} MB  publish {w['publish_s'] * 1e3:7.2f} ms  load "
          f"{w['load_s'] * 1e3:6.2f} ms  = {w_total * 1e3:7.2f} ms")
    print(f"  adapters:      {s['bytes'] / 1e6:8.2f} MB  publish {s['publish_s'] * 1e3:7.2f} ms  load "
          f"{s['load_s'] * 1e3:6.2f} ms  merge {s['apply_s'] * 1e3:6.2f} ms  = {s_total * 1e3:7.2f} ms")
    print(f"  bytes {w['bytes'] / s['bytes']:.1f}x fewer; a version {w_total / s_total:.2f}x as fast "
          "(the merge included)")
    print(f"Llama-2-7B shapes, rank 16: {p['whole_bytes_fp32'] / 1e9:.1f} GB float32 "
          f"({p['whole_bytes_bf16'] / 1e9:.1f} GB bf16) against {p['adapter_bytes_fp32'] / 1e6:.0f} MB of "
          f"adapters; at these rates a version takes {p['whole_s_fp32']:.1f} s whole against "
          f"{p['adapter_s']:.2f} s as adapters ({p['adapter_merge_s']:.2f} s of it the merge, on one CPU "
          "thread)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
