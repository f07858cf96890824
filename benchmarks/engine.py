"""Sampled tokens/s of Tether's engine against transformers' `generate` with scores.

Same ~3M-parameter model (the `small` preset), same 64 prompts, 32 new tokens each (stop tokens
disabled so both produce exactly 64 × 32 tokens), temperature 1. transformers gets
`output_scores=True` plus `compute_transition_scores`, i.e. it also returns per-token log-probs,
which is what an RL engine needs. Tether's engine is timed as a rollout worker runs it: one
decoder for the run, its weights re-read before every batch (as after each publication; the
re-read is in the time), through its native decoder (``rollout.decoder=auto``) and, beside it,
its Python path (``rollout.decoder=python``). Interleaved rounds, at 1 and 2 threads: each
round times the three, then measures the matmul peak again at the shape that reached it (see
below), so a round's fraction of the peak is taken against what the machine did in that round.
Reported: the median of each figure over the rounds kept, and its spread (min, max); the first
round is dropped (warm-up), and so is any round whose peak measured below 80% of the run's best
(the machine was busy then), each named.

Target (issue 3): at least 1.5× transformers' tokens/s at 1 thread. Beside the ratio, the fraction of
this machine's own limit (issue 20): the useful arithmetic of a run (2 FLOPs per matmul parameter
per token run through the model, plus attention; padding not counted) per second, against the best
float32 GEMM rate measured in the same run at the same thread count, over square shapes and the
decode step's own shapes (``benchmarks/limits.py``). Beside it, the GEMM floor: the fraction of
the peak an engine would reach if it spent no time outside the decode step's weight GEMMs, each
at the rate its shape reaches alone (prefill and attention counted at the peak rate) — an upper
bound on what any engine built on these matrix multiplies can show on this workload.

``--profile`` prints where a decode step spends its time instead, on each path: the native
decoder's own sections (a build of the library that times them) and the Python path's operators
(``torch.profiler``), the rest of its wall time being Python and dispatch.

``--model PATH`` measures a model folder instead of the tiny preset (a real checkpoint, e.g. the
SmolLM2-135M-Instruct that ``make smollm2`` imports): prompts are the ``question`` task's chat
turns in the model's own chat template where it has one. At that size a decode step streams every
weight matrix once, so beside the matmul peak the machine's read bandwidth is measured in each
round too (``limits.read_bandwidth`` over a buffer the size of the weights), and the limit that
binds is reported: the larger of the compute floor (the work at the peak rate) and the memory
floor (each decode step reading the weights at that bandwidth, the prefill at the peak rate).

With ``--device cuda`` both run on the GPU instead (one measurement; thread counts do not
apply; the native decoder is CPU-only, so Tether runs its Python path), for a machine that has
one (scripts/device_check.sh).

    python benchmarks/engine.py [--prompts 64] [--new-tokens 32] [--repeats 7] [--device cpu] [--json]
    python benchmarks/engine.py --model runs/models/smollm2 [--threads 1] [--repeats 3]
    python benchmarks/engine.py --profile [--size small]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import torch


def build(size: str, model_path: str | None = None):
    """(model, tokenizer): the folder ``model_path``, or a tiny model of ``size`` built here."""
    from transformers.utils import logging as hf_logging

    from tether.data.tiny_model import init_model
    from tether.modeling import load_causal_lm

    hf_logging.disable_progress_bar()
    if model_path is not None:
        return load_causal_lm(model_path)
    path = tempfile.mkdtemp() + "/model"
    init_model(path, size=size, seed=0)
    return load_causal_lm(path)


def prompts_of(tok, n: int) -> list[list[int]]:
    """Three-digit arithmetic for a tiny model; chat questions for a model with a chat template."""
    from tether.data.datasets import apply_chat_template
    from tether.data.tasks import get_task

    if getattr(tok, "chat_template", None):
        examples = apply_chat_template(tok, get_task("question").examples("train", n, seed=0, difficulty=2))
    else:
        examples = get_task("arithmetic").examples("train", n, seed=0, difficulty=3)
    return [tok(e.prompt, add_special_tokens=False).input_ids for e in examples]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_tether(model, tok, prompts, new_tokens: int, stepper) -> float:
    """One batch through ``stepper`` (a ``stepper_for`` kept for the run), its weights re-read
    first, as a rollout worker does after every publication."""
    from tether.decoding.sampling import SamplingParams, sample

    device = next(model.parameters()).device
    _sync(device)
    t0 = time.perf_counter()
    stepper.invalidate()
    out = sample(model, prompts, SamplingParams(max_new_tokens=new_tokens), stop_ids=[],
                 pad_id=tok.pad_token_id, generator=torch.Generator(device=device).manual_seed(0),
                 stepper=stepper)
    elapsed = time.perf_counter() - t0  # the tokens come back as lists: already synchronised
    assert sum(len(t) for t in out.tokens) == len(prompts) * new_tokens
    return elapsed


def time_hf(model, tok, prompts, new_tokens: int) -> float:
    device = next(model.parameters()).device
    tok.padding_side = "left"  # generation continues each row from its last column
    batch = tok.pad({"input_ids": prompts}, return_tensors="pt").to(device)
    torch.manual_seed(0)
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             output_scores=True, return_dict_in_generate=True,
                             pad_token_id=tok.pad_token_id, eos_token_id=None)
        scores = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    _sync(device)
    elapsed = time.perf_counter() - t0
    assert scores.shape == (len(prompts), new_tokens)
    return elapsed


def work_flops(model, prompts: list[list[int]], new_tokens: int) -> int:
    """The arithmetic a generation of ``new_tokens`` after each prompt needs, padding excluded:
    2 FLOPs per matmul parameter for every token run through the model (each prompt token, and
    each sampled token but the last), plus attention over the positions before it."""
    from limits import attention_flops, matmul_parameters

    params = matmul_parameters(model)
    total = 0
    for prompt in prompts:
        run = len(prompt) + new_tokens - 1
        total += 2 * params * run + sum(attention_flops(model, s + 1) for s in range(run))
    return total


def decode_shapes(model, rows: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of every distinct matrix multiply of a decode step (q/k/v and gate/up fused)."""
    cfg = model.config
    h, i = cfg.hidden_size, cfg.intermediate_size
    head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * head_dim
    return [(rows, h, qkv), (rows, cfg.num_attention_heads * head_dim, h), (rows, h, 2 * i), (rows, i, h),
            (rows, h, cfg.vocab_size)]


def _rest_seconds(model, prompts: list[list[int]], new_tokens: int, step_flops: int, peak: dict) -> float:
    """The work besides the decode steps' weight GEMMs (``step_flops`` a step): the prefill and
    attention, at the peak rate."""
    rest = work_flops(model, prompts, new_tokens) - step_flops * (new_tokens - 1)
    return rest / (peak["gflops"] * 1e9)


def gemm_floor_seconds(model, prompts: list[list[int]], new_tokens: int, peak: dict) -> float:
    """A lower bound on any engine's time for this generation when it multiplies with these
    GEMMs: every decode-step weight GEMM at the rate its shape reaches alone (``peak``'s
    ``by_shape``, the best of several timed runs), and everything else that counts as work
    (the prefill, attention) at the peak rate; nothing else costs time. ``work_flops`` over
    this is the highest fraction of the peak such an engine can reach on this workload."""
    layers = model.config.num_hidden_layers
    *per_layer, head = decode_shapes(model, len(prompts))
    step_seconds, step_flops = 0.0, 0
    for (m, k, n), count in [*((s, layers) for s in per_layer), (head, 1)]:
        flops = 2 * m * k * n * count
        step_flops += flops
        step_seconds += flops / (peak["by_shape"][f"{m}x{k}x{n}"] * 1e9)
    return step_seconds * (new_tokens - 1) + _rest_seconds(model, prompts, new_tokens, step_flops, peak)


def gemm_chain_seconds(model, prompts: list[list[int]], new_tokens: int, peak: dict) -> float:
    """Like ``gemm_floor_seconds``, but the decode GEMMs are timed where they run: back to back
    in a step's order (every layer's q/k/v, o, gate/up and down, then the head), over the
    engine's own transposed weights, so each streams its weights after the others evicted them,
    as in a real step; nothing runs between them. What an engine that fused every other
    operation of the step into the GEMMs, at no cost, would take."""
    from limits import best_seconds
    from tether.decoding.fast_decoder import FastDecoder

    decoder = FastDecoder(model)
    decoder.refresh()
    rows = len(prompts)
    mats = [w for layer in decoder.layers for w in (layer.qkv_t, layer.o_t, layer.gate_up_t, layer.down_t)]
    mats.append(decoder.head_t)
    ins = [torch.randn(rows, w.shape[0]) for w in mats]
    outs = [torch.empty(rows, w.shape[1]) for w in mats]

    def step() -> None:
        for a, w, out in zip(ins, mats, outs, strict=True):
            torch.mm(a, w, out=out)

    step_flops = sum(2 * rows * w.shape[0] * w.shape[1] for w in mats)
    return best_seconds(step) * (new_tokens - 1) + _rest_seconds(model, prompts, new_tokens, step_flops, peak)


def memory_floor_seconds(model, prompts: list[list[int]], new_tokens: int, gflops: float,
                         bytes_per_s: float) -> float:
    """A lower bound set by memory: each decode step reads every weight matrix once at
    ``bytes_per_s``, and the prefill's work runs at the peak (``gflops``)."""
    from limits import attention_flops, matmul_parameters

    weight_bytes = matmul_parameters(model) * next(model.parameters()).element_size()
    params = matmul_parameters(model)
    prefill = sum(2 * params * len(p) + sum(attention_flops(model, s + 1) for s in range(len(p)))
                  for p in prompts)
    return (new_tokens - 1) * weight_bytes / bytes_per_s + prefill / (gflops * 1e9)


def measure(n_prompts: int, new_tokens: int, repeats: int, size: str = "small", device: str = "cpu",
            model_path: str | None = None, thread_counts: tuple[int, ...] = (1, 2)) -> dict:
    from limits import Rounds, matmul_parameters, matmul_peak, read_bandwidth, shape_gflops

    model, tok = build(size, model_path)
    model.to(device).eval()
    prompts = prompts_of(tok, n_prompts)
    tokens = n_prompts * new_tokens
    flops = work_flops(model, prompts, new_tokens)
    result: dict = {"prompts": n_prompts, "new_tokens": new_tokens, "repeats": repeats, "device": device,
                    "size": model_path or size, "parameters": sum(p.numel() for p in model.parameters()),
                    "flops_per_run": flops, "threads": {}}
    from tether.decoding.sampling import stepper_for

    on_gpu = torch.device(device).type == "cuda"
    engine, python_path = stepper_for(model), stepper_for(model, decoder="python")
    weight_bytes = matmul_parameters(model) * next(model.parameters()).element_size()
    for threads in ((1,) if on_gpu else thread_counts):
        torch.set_num_threads(threads)
        peak = None if on_gpu else matmul_peak(decode_shapes(model, n_prompts))
        rounds = Rounds(warmup=1)  # the first round warms all three up
        for _ in range(repeats + 1):
            t = time_tether(model, tok, prompts, new_tokens, engine)
            py = time_tether(model, tok, prompts, new_tokens, python_path)
            h = time_hf(model, tok, prompts, new_tokens)
            # the peak again, in this round: the fraction is of what the machine did just now
            limit = 1.0 if peak is None else shape_gflops(peak["shape"])
            figures = {"tether_tokens_per_s": tokens / t, "hf_generate_tokens_per_s": tokens / h,
                       "speedup": h / t, "python_path_tokens_per_s": tokens / py,
                       "python_path_speedup": h / py, "native_over_python_path": py / t, "seconds": t}
            if peak is not None and model_path is not None:  # the bandwidth a step's weights stream at
                bandwidth = read_bandwidth(weight_bytes)["gbps"]
                compute = flops / (limit * 1e9)
                memory = memory_floor_seconds(model, prompts, new_tokens, limit, bandwidth * 1e9)
                figures.update({"read_gbps": bandwidth, "compute_floor_s": compute, "memory_floor_s": memory,
                                "fraction_of_binding_limit": max(compute, memory) / t,
                                "hf_generate_fraction_of_binding_limit": max(compute, memory) / h})
            if peak is not None:
                figures.update({"matmul_peak_gflops": limit, "fraction_of_peak": flops / t / 1e9 / limit,
                                "hf_generate_fraction_of_peak": flops / h / 1e9 / limit,
                                "python_path_fraction_of_peak": flops / py / 1e9 / limit})
            rounds.add(limit, **figures)
        result["decoder"] = getattr(engine, "path", "transformers")
        names = [name for name in rounds.rows[0] if name != "limit"]
        summary = rounds.summary(*names)
        row = {name: summary[name]["median"] for name in names}
        row["tether_gflops"] = flops / row["seconds"] / 1e9
        row["hf_generate_gflops"] = row["tether_gflops"] / row["speedup"]
        row.update(spread={name: summary[name] for name in names}, rounds=summary["rounds"],
                   kept=summary["kept"], dropped=summary["dropped"])
        if peak is not None:
            floor = gemm_floor_seconds(model, prompts, new_tokens, peak)
            chain = gemm_chain_seconds(model, prompts, new_tokens, peak)
            limit = row["matmul_peak_gflops"]
            row.update({"matmul_peak_shape": peak["shape"],
                        "gemm_floor_fraction_of_peak": flops / floor / 1e9 / limit,
                        "time_over_gemm_floor": row["seconds"] / floor,
                        "gemm_chain_fraction_of_peak": flops / chain / 1e9 / limit,
                        "time_over_gemm_chain": row["seconds"] / chain})
        result["threads"][str(threads)] = row
    result["weight_bytes"] = weight_bytes
    first = result["threads"][str(thread_counts[0] if not on_gpu else 1)]
    if "memory_floor_s" in first:
        memory_binds = first["memory_floor_s"] > first["compute_floor_s"]
        result["binding_limit"] = "memory" if memory_binds else "compute"
    if "1" not in result["threads"]:
        return result
    result["speedup_vs_hf_generate"] = result["threads"]["1"]["speedup"]
    result["fraction_of_peak"] = result["threads"]["1"].get("fraction_of_peak")
    result["fraction_of_peak_target"] = 0.7
    result["gemm_floor_fraction_of_peak"] = result["threads"]["1"].get("gemm_floor_fraction_of_peak")
    result["gemm_chain_fraction_of_peak"] = result["threads"]["1"].get("gemm_chain_fraction_of_peak")
    result["target"] = 1.5
    result["meets_target"] = result["speedup_vs_hf_generate"] >= 1.5
    return result


GEMMS = {"aten::mm", "aten::addmm"}
ATTENTION = {"aten::bmm", "aten::baddbmm", "aten::_softmax"}
SAMPLER = {"aten::_log_softmax", "aten::uniform_", "aten::log_", "aten::neg_", "aten::argmax", "aten::sub",
           "aten::gather"}


def profile(size: str, n_prompts: int, new_tokens: int, repeats: int = 5) -> dict:
    """Where one step of generation (a decode step and the sampling of the next tokens) spends
    its time (1 thread), on each path as ``sample`` runs it: on the native decoder, the whole
    loop in one ``decode_run`` call (its sections, from a build that times them, the uniforms
    drawn in one ``torch.rand`` inside the time); on the Python path, ``decode`` and the torch
    sampler each step (``torch.profiler``'s operator self times; the rest of the step's wall
    time is Python and dispatch; when the profiler's own cost per call makes the operators add up
    to more than the unprofiled step, they are shown as shares of the step instead). The best of
    ``repeats`` batches of each."""
    import os

    os.environ["TETHER_NATIVE_PROFILE"] = "1"  # before the library is first loaded
    from torch.profiler import profile as torch_profile

    from tether.decoding import native
    from tether.decoding.fast_decoder import FastDecoder
    from tether.decoding.sampling import categorical, left_pad

    torch.set_num_threads(1)
    model, tok = build(size)
    model.eval()
    ids, mask = left_pad(prompts_of(tok, n_prompts), tok.pad_token_id)
    steps, rows = new_tokens - 1, ids.shape[0]
    out: dict = {"size": size, "prompts": n_prompts, "threads": 1}

    dec = FastDecoder(model, decoder="native")
    best = None
    for _ in range(repeats + 1):
        tokens = torch.empty(rows, new_tokens, dtype=torch.long)
        logps = torch.empty(rows, new_tokens)
        tokens[:, 0] = dec.prefill(ids, mask, new_tokens).argmax(-1)
        done, lengths = torch.zeros(rows, dtype=torch.bool), torch.full((rows,), new_tokens)
        native.profile(reset=True)
        t0 = time.perf_counter()
        u = torch.rand(steps, rows, model.config.vocab_size, generator=torch.Generator().manual_seed(0))
        dec.decode_run(steps, tokens, logps, 0, 1.0, u, torch.empty(0, dtype=torch.long), done, lengths)
        wall = (time.perf_counter() - t0) / steps
        sections = {k: v / steps for k, v in native.profile().items()}
        if best is None or wall < best[0]:
            best = (wall, sections)
    wall, sections = best
    outside = "outside the library (Python, ctypes, torch.rand)"
    sections[outside] = max(0.0, wall - sum(sections.values()))
    out["native"] = {"step_ms": wall * 1e3, "parts_ms": {k: v * 1e3 for k, v in sections.items()}}

    dec = FastDecoder(model, decoder="python")
    generator = torch.Generator().manual_seed(0)

    def python_steps() -> float:
        tok_ = dec.prefill(ids, mask, new_tokens).argmax(-1)
        t0 = time.perf_counter()
        for _ in range(steps):
            dist = torch.log_softmax(dec.decode(tok_), dim=-1)
            tok_ = categorical(dist, generator)
            dist.gather(-1, tok_[:, None])
        return (time.perf_counter() - t0) / steps

    wall = min(python_steps() for _ in range(repeats + 1))
    with torch_profile() as prof:
        python_steps()
    ops = {e.key: e.self_cpu_time_total / 1e6 / steps for e in prof.key_averages()}
    prefill_ops = {"aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu"}
    others = {k: v for k, v in ops.items() if k not in GEMMS | ATTENTION | SAMPLER | prefill_ops}
    parts = {"weight GEMMs (mm, addmm)": sum(v for k, v in ops.items() if k in GEMMS),
             "attention (bmm, baddbmm, softmax)": sum(v for k, v in ops.items() if k in ATTENTION),
             "other operators (norms, rotary, KV writes, SiLU, copies)": sum(others.values()),
             "sampling (log_softmax, rand, log, argmax, gather)":
                 sum(v for k, v in ops.items() if k in SAMPLER)}
    profiled = sum(parts.values())
    if profiled > wall:  # the profiler's own cost per operator call: shares of the wall time instead
        parts = {k: v * wall / profiled for k, v in parts.items()}
    dispatch = "Python and dispatch (the step's wall time outside operators)"
    parts[dispatch] = max(0.0, wall - sum(parts.values()))
    top = sorted(others.items(), key=lambda kv: -kv[1])[:8]
    out["python"] = {"step_ms": wall * 1e3, "parts_ms": {k: v * 1e3 for k, v in parts.items()},
                     "top_other_ops_ms": {k: v * 1e3 for k, v in top},
                     "operator_calls_per_step": sum(e.count for e in prof.key_averages()) / steps}
    return out


def print_profile(r: dict) -> None:
    print(f"decode step, {r['size']} model, {r['prompts']} rows, 1 thread")
    for path in ("python", "native"):
        p = r[path]
        print(f"\n{path} path: {p['step_ms']:.3f} ms a step")
        for name, ms in p["parts_ms"].items():
            print(f"  {name:<66}{ms:>8.3f} ms{ms / p['step_ms']:>7.0%}")
        if "top_other_ops_ms" in p:
            largest = ", ".join(f"{k.removeprefix('aten::')} {v:.3f} ms"
                                for k, v in p["top_other_ops_ms"].items())
            print(f"  ({p['operator_calls_per_step']:.0f} operator calls a step, nested ones included; "
                  f"the largest other operators: {largest})")


def print_model(r: dict) -> None:
    """The ``--model`` report: the engine and transformers against the limit that binds."""
    print(f"{r['prompts']} prompts × {r['new_tokens']} new tokens, {r['size']} "
          f"({r['parameters']:,} parameters, "
          f"{r['weight_bytes'] / 1e9:.2f} GB of weight matrices a decode step reads); Tether's decoder: "
          f"{r['decoder']}; medians over the rounds kept")
    print(f"{'threads':>8}{'tether tok/s':>14}{'python path':>13}{'hf generate':>13}{'speedup':>9}"
          f"{'peak GF/s':>11}{'read GB/s':>11}{'compute fl.':>13}{'memory fl.':>12}{'tether':>8}{'hf':>6}")
    for threads, row in r["threads"].items():
        print(f"{threads:>8}{row['tether_tokens_per_s']:>14.1f}{row['python_path_tokens_per_s']:>13.1f}"
              f"{row['hf_generate_tokens_per_s']:>13.1f}{row['speedup']:>8.2f}×{row['matmul_peak_gflops']:>11.1f}"
              f"{row['read_gbps']:>11.1f}{row['compute_floor_s']:>12.2f}s{row['memory_floor_s']:>11.2f}s"
              f"{row['fraction_of_binding_limit']:>8.0%}{row['hf_generate_fraction_of_binding_limit']:>6.0%}")
        print(f"         {row['kept']} of {row['rounds']} rounds kept" +
              "".join(f"; dropped {d}" for d in row["dropped"]))
    print(f"binding limit: {r['binding_limit']} (the larger floor); the last two columns are each engine's "
          "fraction of it (floor time / its time)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=7, help="rounds kept at most (one more warms up)")
    p.add_argument("--size", default="small", choices=["tiny", "small", "base"])
    p.add_argument("--model", help="a model folder to measure instead of a tiny preset "
                   "(e.g. runs/models/smollm2)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts (default 1 2)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--json", action="store_true")
    p.add_argument("--profile", action="store_true", help="where a decode step spends its time, on each path")
    a = p.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: this machine has no CUDA device")
    if a.profile:
        r = profile(a.size, a.prompts, a.new_tokens)
        print(json.dumps(r)) if a.json else print_profile(r)
        return 0
    r = measure(a.prompts, a.new_tokens, a.repeats, a.size, a.device, a.model, tuple(a.threads))
    if a.json:
        print(json.dumps(r))
        return 0
    if a.model is not None:
        print_model(r)
        return 0
    print(f"{a.prompts} prompts × {a.new_tokens} new tokens, {r['parameters']:,}-parameter model, "
          f"on {a.device}; Tether's decoder: {r['decoder']}; medians over the rounds kept")
    print(f"{'threads':>8}{'tether tok/s':>14}{'python path':>13}{'hf generate':>13}{'speedup':>9}"
          f"{'GFLOP/s':>9}{'matmul peak':>13}{'of peak':>9}{'python path':>13}{'GEMM floor':>12}"
          f"{'GEMM chain':>12}")
    for threads, row in r["threads"].items():
        peak = (f"{row['matmul_peak_gflops']:>13.1f}{row['fraction_of_peak']:>8.0%}"
                f"{row['python_path_fraction_of_peak']:>12.0%}"
                f"{row['gemm_floor_fraction_of_peak']:>11.0%}{row['gemm_chain_fraction_of_peak']:>11.0%}"
                if "matmul_peak_gflops" in row else f"{'-':>13}{'-':>9}{'-':>13}{'-':>12}{'-':>12}")
        print(f"{threads:>8}{row['tether_tokens_per_s']:>14.0f}{row['python_path_tokens_per_s']:>13.0f}"
              f"{row['hf_generate_tokens_per_s']:>13.0f}{row['speedup']:>8.2f}×{row['tether_gflops']:>9.1f}{peak}")
    for threads, row in r["threads"].items():
        shown = [name for name in ("speedup", "fraction_of_peak") if name in row["spread"]]
        ranges = ", ".join(f"{name} {row['spread'][name]['min']:.2f}–{row['spread'][name]['max']:.2f}"
                           for name in shown)
        print(f"{threads} thread(s): {row['kept']} of {row['rounds']} rounds kept; spread: {ranges}")
        for reason in row["dropped"]:
            print(f"  dropped {reason}")
    print("GEMM floor: the fraction of the peak an engine would reach that spent no time outside the decode "
          "step's weight GEMMs, each at its shape's own measured rate; GEMM chain: the same with the "
          "GEMMs timed back to back in a step's order over the engine's weights (each streaming its "
          "weights after the others evicted them)")
    print(f"speedup at 1 thread: {r['speedup_vs_hf_generate']:.2f}× (target 1.5×: "
          f"{'met' if r['meets_target'] else 'MISSED'})")
    if r["fraction_of_peak"] is not None:
        print(f"fraction of the matmul peak at 1 thread: {r['fraction_of_peak']:.0%} (target 70%: "
              f"{'met' if r['fraction_of_peak'] >= r['fraction_of_peak_target'] else 'MISSED'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
