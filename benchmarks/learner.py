"""The learner's time per update against a bare forward/backward/AdamW step on the same batch.

Bare: the batch already as tensors; forward, log-softmax gather of the sampled tokens, a
policy-gradient loss (−A·log π, token mean), backward, gradient clipping, AdamW step. Learner:
``TorchLearner.train`` on the scored rollout batch with U = 1 — batch assembly, advantages, the
proximal anchor with truncated IS, the DAPO loss, and every metric (ratios, clip fractions, IS
weights, ESS, mismatch, entropy). Same model (the `small` preset), same 8 prompts × 4 samples,
interleaved repeats, medians. The overhead compares like with like: the learner with
``train.shared_prefix`` off (the model's own forward, as the bare step). The learner with its
default shared-prompt forward is reported beside it (``shared_prefix_s``, ``speedup_shared_prefix``).

Target (issue 4): at most 15% overhead. Also reported (issue 20): the update's needed arithmetic
(``step_flops``) per second, as a fraction of the float32 matmul peak measured in the same run at the
same thread count (``benchmarks/limits.py``). ``--device cuda`` runs the learners and the bare step on a
GPU (``train.device=cuda``), timing each with the device synchronised.

``--world-size 1,2`` instead measures the learner as ranks (``train.world_size``, each rank a
process with ``--threads`` threads, FSDP2 over gloo, or NCCL with ``--device cuda``): per world
size, the time of one update as the driver sees it (with the model's own forward, and with the
default shared-prompt forward run as FSDP forward methods, timed after it in a second group of
ranks), each rank's peak resident memory (and peak
GPU memory on CUDA), and a publication into the weight channel timed both ways: the weights
gathered whole on rank 0 and copied in by the driver, and every rank writing its own rows.

    python benchmarks/learner.py [--repeats 15] [--threads 1] [--device cpu|cuda] [--json]
    python benchmarks/learner.py --world-size 1,2 [--repeats 15] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch


def setup():
    from transformers.utils import logging as hf_logging

    from tether.data.tasks import get_task
    from tether.data.tiny_model import init_model
    from tether.families.text.payload import ScoredBatch
    from tether.modeling import load_causal_lm
    from tether.rollout.engines.torch.engine import TorchEngine
    from tether.vocabulary import RolloutBatch, SamplingParams

    hf_logging.disable_progress_bar()
    path = tempfile.mkdtemp() + "/model"
    init_model(path, size="small", seed=0)
    model, tok = load_causal_lm(path)
    engine = TorchEngine(model, pad_id=tok.pad_token_id, stop_ids=[tok.eos_token_id])
    examples = get_task("arithmetic").examples("train", 8, seed=0)
    prompts = [tok(e.prompt, add_special_tokens=False).input_ids for e in examples]
    groups = engine.generate(prompts, samples_per_prompt=4, params=SamplingParams(max_new_tokens=16), seed=0)
    flat = [c for g in groups for c in g]
    scored = ScoredBatch(positions=list(range(8)), prompt_ids=prompts,
                         completion_ids=[c.token_ids for c in flat], logprobs=[c.logprobs for c in flat],
                         versions=[c.versions for c in flat], rewards=[float(i % 3 == 0) for i in range(32)],
                         finish_reasons=[c.finish_reason for c in flat], completions=[""] * 32, group_size=4)
    return path, RolloutBatch(index=0, behavior_version=0, num_groups=8, group_size=4, payload=scored), tok


def synced(device: str) -> None:
    """Wait for the device's queued work, so the clock reads what was done."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bare_step(model, optimizer, tb, adv) -> float:
    synced(str(tb.input_ids.device))
    t0 = time.perf_counter()
    logits = model(input_ids=tb.input_ids, attention_mask=tb.attention_mask).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, tb.targets[..., None]).squeeze(-1)
    loss = -(adv[:, None] * logp * tb.mask).sum() / tb.mask.sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    synced(str(tb.input_ids.device))
    return time.perf_counter() - t0


def step_flops(model, scored) -> int:
    """The arithmetic one update needs: 6 FLOPs per matmul parameter (forward 2, backward 4) for
    each token a step must process — each group's prompt once and every completion token — plus
    three times the attention over the positions before each. Repeated prompts and padding are
    not counted as needed work."""
    from limits import attention_flops, matmul_parameters

    params, g, total = matmul_parameters(model), scored.group_size, 0
    for i, prompt in enumerate(scored.prompt_ids):
        total += sum(6 * params + 3 * attention_flops(model, s + 1) for s in range(len(prompt)))
        for completion in scored.completion_ids[i * g:(i + 1) * g]:
            total += sum(6 * params + 3 * attention_flops(model, len(prompt) + j + 1)
                         for j in range(len(completion)))
    return total


def recipe(*overrides: str):
    """The benchmark's learner: PPO-clip with clip-higher, token mean, the proximal anchor with
    token TIS (the DAPO preset's defaults), at a rate too small to change the step's cost."""
    from tether.config import load_config

    return load_config(None, ["train.lr=1e-6", "train.algorithm=dapo", "train.drop_zero_std=false",
                              "correction.tis=token", *overrides])


def measure(repeats: int, threads: int, device: str = "cpu") -> dict:
    from tether.families.text.batch import to_train_batch
    from tether.modeling import load_causal_lm
    from tether.train.advantages import group_advantages
    from tether.train.learner import TorchLearner

    torch.set_num_threads(threads)
    path, batch, tok = setup()

    def make(shared: bool) -> TorchLearner:
        return TorchLearner(path, recipe(f"train.shared_prefix={shared}", f"train.device={device}"))

    learner, shared = make(False), make(True)
    model, _ = load_causal_lm(path)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)  # as the learner's
    tb = to_train_batch(batch.payload, tok.pad_token_id).to(torch.device(device))
    adv = group_advantages(tb.rewards, 4).values
    for _ in range(3):  # warm up
        bare_step(model, optimizer, tb, adv)
        learner.train(batch, train_version=0)
        shared.train(batch, train_version=0)
    bare, ours, fast = [], [], []
    for _ in range(repeats):
        bare.append(bare_step(model, optimizer, tb, adv))
        for who, out in ((learner, ours), (shared, fast)):
            synced(device)
            t0 = time.perf_counter()
            who.train(batch, train_version=0)
            synced(device)
            out.append(time.perf_counter() - t0)
    b, o, f = statistics.median(bare), statistics.median(ours), statistics.median(fast)
    flops = step_flops(model, batch.payload)
    out = {"device": device, "threads": threads, "repeats": repeats, "sequences": tb.size, "bare_s": b,
           "learner_s": o,
           "overhead": o / b - 1, "target": 0.15, "meets_target": o / b - 1 <= 0.15,
           "shared_prefix_s": f, "speedup_shared_prefix": o / f,
           "flops_per_step": flops, "shared_prefix_gflops": flops / f / 1e9, "bare_gflops": flops / b / 1e9}
    if not device.startswith("cuda"):
        from limits import matmul_peak

        peak = matmul_peak()
        out.update({"matmul_peak_gflops": peak["gflops"], "matmul_peak_shape": peak["shape"],
                    "fraction_of_peak": flops / f / 1e9 / peak["gflops"],
                    "bare_fraction_of_peak": flops / b / 1e9 / peak["gflops"]})
    return out


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def measure_world(sizes: list[int], repeats: int, threads: int, device: str = "cpu") -> dict:
    """Each world size's update time, per-rank peak memory and whole-weights gather time; world
    size 1 also runs as one rank process, so the figures compare like with like."""
    from tether.rollout.channel import WeightChannel
    from tether.train.ranks import ProcessRanks, RankGroup

    path, batch, _tok = setup()
    out = {"device": device, "threads_per_rank": threads, "repeats": repeats, "sequences": 32, "worlds": {}}

    def ranks(world: int, shared: bool) -> RankGroup:
        cfg = recipe(f"train.shared_prefix={shared}", f"train.device={device}", f"train.world_size={world}",
                     f"train.threads={threads}")
        return RankGroup(ProcessRanks(cfg, path, None))

    def shared_prefix_step(world: int) -> float:
        """The update's median time with the default shared-prompt forward instead."""
        learner = ranks(world, True)
        try:
            for _ in range(3):
                learner.train(batch, train_version=0)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                learner.train(batch, train_version=0)
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        finally:
            learner.close()

    for world in sizes:
        learner = ranks(world, False)
        try:
            for _ in range(3):  # warm up
                learner.train(batch, train_version=0)
            steps, gathers, writes = [], [], []
            channel = WeightChannel.for_tensors(learner.export_weights())
            for version in range(1, repeats + 1):
                t0 = time.perf_counter()
                learner.train(batch, train_version=0)
                steps.append(time.perf_counter() - t0)
                t0 = time.perf_counter()  # rank 0 gathers, pipes them to this process, which copies them in
                channel.publish(dict(learner.export_weights()), version)
                gathers.append(time.perf_counter() - t0)
                t0 = time.perf_counter()  # every rank writes its own rows into the shared block
                channel.publish(learner.export_weights(), version)
                writes.append(time.perf_counter() - t0)
            channel.verify(repeats)
            row = {"step_s": statistics.median(steps), "shared_prefix_step_s": shared_prefix_step(world),
                   "gather_publish_s": statistics.median(gathers),
                   "sharded_publish_s": statistics.median(writes),
                   "publish_bytes": channel.layout.payload_bytes,
                   "rank_peak_rss_mb": [_peak_rss_mb(pid) for pid in learner.pids]}
        finally:
            channel.close()
            learner.close()
        out["worlds"][str(world)] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for a GPU")
    ap.add_argument("--world-size", default="", help="e.g. 1,2: the learner as that many ranks")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.world_size:
        r = measure_world([int(w) for w in a.world_size.split(",")], a.repeats, a.threads, a.device)
        if a.json:
            print(json.dumps(r))
            return 0
        print(f"{r['sequences']} sequences per update on {a.device}, {a.threads} thread(s) per rank, "
              f"median of {a.repeats}")
        print(f"{'ranks':>6}{'update':>11}{'shared prefix':>16}{'publish: gathered':>19}"
              f"{'ranks write rows':>18}  peak memory per rank")
        for world, row in r["worlds"].items():
            memory = ", ".join(f"{m:.0f} MB" for m in row["rank_peak_rss_mb"])
            step, shared, gather, write = (row[k] * 1e3 for k in ("step_s", "shared_prefix_step_s",
                                                                  "gather_publish_s", "sharded_publish_s"))
            print(f"{world:>6}{step:>8.1f} ms{shared:>13.1f} ms{gather:>16.1f} ms{write:>15.1f} ms  {memory}")
        print(f"a publication: {row['publish_bytes'] / 1e6:.1f} MB into the weight channel, "
              "checksum included")
        return 0
    r = measure(a.repeats, a.threads, a.device)
    if a.json:
        print(json.dumps(r))
        return 0
    print(f"{r['sequences']} sequences on {a.device}, {a.threads} thread(s), median of {a.repeats}")
    print(f"  bare forward/backward/AdamW  {r['bare_s'] * 1e3:8.2f} ms")
    print(f"  TorchLearner.train (U=1)     {r['learner_s'] * 1e3:8.2f} ms   (train.shared_prefix=false)")
    print(f"  the same, shared prefix      {r['shared_prefix_s'] * 1e3:8.2f} ms   "
          f"({r['speedup_shared_prefix']:.2f}× faster)")
    print(f"overhead: {r['overhead']:.1%} (target ≤ 15%: {'met' if r['meets_target'] else 'MISSED'})")
    if "fraction_of_peak" in r:
        print(f"needed work {r['flops_per_step'] / 1e9:.2f} GFLOP per update: shared prefix "
              f"{r['shared_prefix_gflops']:.1f} GFLOP/s = {r['fraction_of_peak']:.0%} of this machine's "
              f"float32 matmul peak ({r['matmul_peak_gflops']:.1f} GFLOP/s at {a.threads} thread(s), "
              f"{r['matmul_peak_shape']}); the bare step {r['bare_fraction_of_peak']:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
