"""The built-in engine with LoRA adapters merged into its weights against applying them as
low-rank terms (``rollout.lora_apply``), side by side in one run.

For the demo's model and batch shape (8 prompts × 16 samples, 6 new tokens), each way is timed on
the same adapters (rank 16 on every linear layer, B off zero as after training), 1 thread:

- a version: what an engine does when a new version of the adapters arrives (the merge of every
  adapted layer, W = W₀ + (α/r)·B·A; or the copy of A and B into the LoRA layers);
- a batch: sampling it (merged: the native decoder, and the model's own forward for a like-for-like
  comparison with the terms, which need it).

    python benchmarks/lora_engine.py [--size small|base] [--rank 16] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def _timed(fn, repeats: int) -> float:
    fn()  # warm: packs, caches, first allocations
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(size: str, rank: int, repeats: int) -> dict:
    from tether.data.tiny_model import build_model
    from tether.decoding.sampling import transformers_stepper
    from tether.rollout.engines.torch.engine import TorchEngine
    from tether.train import lora
    from tether.vocabulary import SamplingParams

    torch.set_num_threads(1)
    train = argparse.Namespace(lora_rank=rank, lora_alpha=2.0 * rank, lora_dropout=0.0,
                                  lora_targets=["all-linear"])
    adapted = lora.attach(build_model(87, size=size), train)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if ".lora_B" in name:
                p.normal_(0, 0.01)
    adapters = lora.adapters(adapted)
    torch.manual_seed(0)
    prompts = [torch.randint(3, 87, (8,)).tolist() for _ in range(8)]
    params = SamplingParams(max_new_tokens=6)
    out = {}
    for how, decoder in (("merge", "native"), ("merge", "transformers"), ("terms", "transformers")):
        engine = TorchEngine(build_model(87, size=size), pad_id=0, stop_ids=[2])
        engine.use_adapter(2.0, train if how == "terms" else None)
        if decoder == "transformers":
            engine.stepper = transformers_stepper(engine.model)
        version = _timed(lambda e=engine: e.load_weights(adapters, 1), repeats)
        batch = _timed(lambda e=engine: e.generate(prompts, samples_per_prompt=16, params=params, seed=0),
                       repeats)
        out[f"{how}/{decoder}"] = {"version_s": version, "batch_s": batch, "path": engine.decoder_path}
    return {"size": size, "rank": rank, **out}


def main(argv: list[str] | None = None) -> int:
    from lora_channel import arguments

    a = arguments(argv, __doc__.splitlines()[0])
    r = measure(a.size, a.rank, a.repeats)
    if a.json:
        print(json.dumps(r))
        return 0
    print(f"{a.size}, rank {a.rank} on every linear layer, 8 prompts x 16 samples x 6 tokens, 1 thread, "
          f"median of {a.repeats}")
    for key in ("merge/native", "merge/transformers", "terms/transformers"):
        f = r[key]
        print(f"  {key:20s} a version {f['version_s'] * 1e3:7.2f} ms   a batch {f['batch_s'] * 1e3:8.1f} ms "
              f"({f['path']})")
    terms, merged = r["terms/transformers"], r["merge/transformers"]
    print(f"terms against merged, the same forward: a batch {terms['batch_s'] / merged['batch_s']:.2f}x the "
          f"time, a version {terms['version_s'] / merged['version_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
