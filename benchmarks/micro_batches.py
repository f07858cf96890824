"""Micro-batches by a fixed count of sequences against micro-batches packed by a token budget
(``train.micro_batch_size`` against ``train.max_tokens_per_micro_batch``), on a long tail of lengths.

One rollout batch of 8 prompts × 8 samples: prompts of 16 tokens; completions of geometric length
(mean ``--mean-length``, 16) but a ``--long-frac`` share (10%) of 120 to 240 tokens, so the longest
row can be 256 tokens, the model's context; random tokens; the model's own log-probs as the
engine's. Each setting trains it in a process of its own, so that process's peak resident memory
while training is the setting's (the peak is reset once the learner is built, through Linux's
``/proc/self/clear_refs``): one warm-up update, then ``--repeats`` rounds of one timed update of
each setting in turn (U = 1, the DAPO preset's loss with token TIS), medians. Reported per setting:
the time of an update, its micro-batches, the share of padding in what the forwards lay out
(``train/pad_frac``), the peak resident memory while training and how far it is above the resident
memory before the first update (the model, its optimizer, the batch). ``--shared-prefix`` runs the
shared-prompt forward instead of the model's own. Threads pinned (``--threads``, default 1).

    python benchmarks/micro_batches.py [--size small] [--repeats 5] [--threads 1] [--shared-prefix] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
import sys
import tempfile
import time

PROMPTS, GROUP, PROMPT_LEN, MAX_NEW = 8, 8, 16, 240
LONG = (120, 240)  # the tail: completions of uniform length in this range


def settings() -> list[tuple[str, list[str]]]:
    """(label, the recipe's train keys) of each setting compared. A fixed count's largest forward
    is count × the longest row in it; a budget bounds every forward's rows × longest row."""
    longest = PROMPT_LEN + MAX_NEW
    return [("all rows in one forward", ["train.micro_batch_size=0"]),
            ("fixed: 16 sequences", ["train.micro_batch_size=16"]),
            ("fixed: 4 sequences", ["train.micro_batch_size=4"]),
            (f"budget: {4 * longest} tokens", [f"train.max_tokens_per_micro_batch={4 * longest}"]),
            (f"budget: {longest} tokens", [f"train.max_tokens_per_micro_batch={longest}"])]


def rollout_batch(path: str, mean_length: float, long_frac: float, seed: int = 0):
    """A synthetic rollout batch with a long tail of completion lengths (geometric, mean
    ``mean_length``; a ``long_frac`` share of them uniform in ``LONG``), scored with the model's own
    log-probs (ratios of 1, as if sampled by these weights)."""
    import torch

    from tether.families.text.batch import to_train_batch, token_logprobs
    from tether.families.text.payload import ScoredBatch
    from tether.modeling import load_causal_lm
    from tether.vocabulary import RolloutBatch

    rng = random.Random(seed)
    model, tok = load_causal_lm(path)
    vocab = range(3, len(tok))  # past pad, bos, eos
    prompts = [[rng.choice(vocab) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS)]
    lengths = [rng.randint(*LONG) if rng.random() < long_frac
               else min(MAX_NEW, 1 + int(rng.expovariate(1 / (mean_length - 1))))
               for _ in range(PROMPTS * GROUP)]
    completions = [[rng.choice(vocab) for _ in range(n)] for n in lengths]
    n = len(completions)
    scored = ScoredBatch(positions=list(range(PROMPTS)), prompt_ids=prompts, completion_ids=completions,
                         logprobs=[[0.0] * len(c) for c in completions],
                         versions=[[0] * len(c) for c in completions],
                         rewards=[float(rng.random() < 0.5) for _ in range(n)],
                         finish_reasons=["length" if len(c) == MAX_NEW else "stop" for c in completions],
                         completions=[""] * n, group_size=GROUP)
    tb = to_train_batch(scored, tok.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(model.eval(), tb, 1.0)
    for i, c in enumerate(completions):
        start = PROMPT_LEN - 1
        scored.logprobs[i] = logp[i, start:start + len(c)].tolist()
    batch = RolloutBatch(index=0, behavior_version=0, num_groups=PROMPTS, group_size=GROUP, payload=scored)
    return batch, lengths


def memory_mb(field: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak since the last reset) of this process, MiB."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def serve(path: str, batch, keys: list[str], args, orders, out) -> None:
    """One setting in a process of its own: an update per order (its time back), then on ``None``
    its metrics and the process's peak memory."""
    import torch

    from tether.config import load_config
    from tether.train.learner import TorchLearner

    torch.set_num_threads(args.threads)
    cfg = load_config(None, ["train.lr=1e-6", "train.algorithm=dapo", "train.drop_zero_std=false",
                             "correction.tis=token", f"train.shared_prefix={args.shared_prefix}",
                             f"data.max_prompt_tokens={PROMPT_LEN}", f"rollout.max_new_tokens={MAX_NEW}",
                             *keys])
    learner = TorchLearner(path, cfg)
    with open("/proc/self/clear_refs", "w") as refs:  # the peak from here on: training's, not loading's
        refs.write("5")
    before = memory_mb("VmRSS")
    result = learner.train(batch, train_version=0)  # warm-up
    out.put(None)
    while orders.get() is not None:
        t0 = time.perf_counter()
        result = learner.train(batch, train_version=0)
        out.put(time.perf_counter() - t0)
    peak = memory_mb("VmHWM")
    metrics = result.metrics
    out.put({"micro_batches": metrics["train/micro_batches"], "pad_frac": metrics["train/pad_frac"],
             "peak_rss_mb": peak, "training_rss_mb": peak - before, "loss": metrics["loss/total"]})


def measure(path: str, batch, args) -> dict:
    """Every setting's process started and warmed up, then updates timed round by round, one of
    each setting per round (interleaved), medians."""
    ctx = mp.get_context("spawn")
    procs = {}
    for label, keys in settings():
        orders, out = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=serve, args=(path, batch, keys, args, orders, out))
        proc.start()
        procs[label] = (proc, orders, out)
    for _, _, out in procs.values():
        out.get(timeout=1800)  # loaded and warmed up
    times: dict[str, list[float]] = {label: [] for label in procs}
    for _ in range(args.repeats):
        for label, (_, orders, out) in procs.items():
            orders.put(1)
            times[label].append(out.get(timeout=1800))
    results = {}
    for label, (proc, orders, out) in procs.items():
        orders.put(None)
        results[label] = {"update_s": statistics.median(times[label]),
                          "update_s_spread": [min(times[label]), max(times[label])], **out.get(timeout=600)}
        proc.join()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", choices=["tiny", "small", "base"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--mean-length", type=float, default=16.0, help="of the short completions")
    parser.add_argument("--long-frac", type=float, default=0.1, help="share of completions in the tail")
    parser.add_argument("--shared-prefix", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from transformers.utils import logging as hf_logging

    from tether.data.tiny_model import init_model

    hf_logging.disable_progress_bar()
    path = tempfile.mkdtemp() + "/model"
    init_model(path, size=args.size, seed=0)
    batch, lengths = rollout_batch(path, args.mean_length, args.long_frac)
    rows = sorted(PROMPT_LEN + n for n in lengths)
    results = measure(path, batch, args)
    base = results["all rows in one forward"]
    spread = {"mean": sum(rows) / len(rows), "median": rows[len(rows) // 2],
              "p90": rows[int(0.9 * len(rows))], "max": rows[-1]}
    report = {"size": args.size, "threads": args.threads, "shared_prefix": args.shared_prefix,
              "rows": len(rows), "row_tokens": spread, "settings": results}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    forward = "shared-prompt" if args.shared_prefix else "own"
    print(f"{len(rows)} rows of {spread['mean']:.0f} tokens on average (median {spread['median']}, p90 "
          f"{spread['p90']}, longest {spread['max']}); model {args.size}, {args.threads} thread(s), "
          f"the model's {forward} forward")
    print(f"{'setting':<26}{'update s':>10}{'× all':>8}{'micro':>7}{'padding':>9}{'peak MB':>9}"
          f"{'+train MB':>11}")
    for label, r in results.items():
        print(f"{label:<26}{r['update_s']:>10.3f}{r['update_s'] / base['update_s']:>8.2f}"
              f"{r['micro_batches']:>7.0f}{r['pad_frac']:>9.2f}{r['peak_rss_mb']:>9.0f}"
              f"{r['training_rss_mb']:>11.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
