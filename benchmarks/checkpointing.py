"""The learner's peak memory and time per update with and without ``train.activation_checkpointing``.

A Qwen2-architecture model built here from a config with random weights (no download; by default
12 layers × 512 hidden, 8 heads of 64, 2 key-value heads, MLP 1408, a 1024-token vocabulary: about
36M parameters) trains on one rollout batch of long sequences (4 prompts × 4 samples, a 32-token
prompt and a 480-token completion each) with ``TorchLearner.train`` (one update, the whole
mini-batch in one forward, the default shared-prompt forward and AdamW). Each setting runs in a
process of its own, so its peak resident memory (``ru_maxrss``) is its own: the model, the
optimizer state and the largest transient — an update's activations. Settings alternate, each
run ``--repeats`` times; the figures are medians. Also measured in each process, exactly: the
bytes the update's forward keeps for the backward (autograd's saved-tensor hooks, outside any
checkpointed region), the memory checkpointing is for.

    python benchmarks/checkpointing.py [--layers 12] [--hidden 512] [--prompts 4] [--group 4]
        [--completion 480] [--repeats 2] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build(out: Path, layers: int, hidden: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from tether.data.tiny_model import build_char_tokenizer

    tok = build_char_tokenizer()
    config = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=max(1, hidden // 256), intermediate_size=int(hidden * 2.75),
                         vocab_size=1024, max_position_embeddings=1024, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tok.save_pretrained(out)
    model.save_pretrained(out)


def rollout_batch(prompts: int, group: int, prompt_len: int, completion_len: int, vocab: int):
    """A scored batch of random tokens: every completion full length, rewards varying in each group."""
    import torch

    from tether.families.text.payload import ScoredBatch
    from tether.vocabulary import RolloutBatch

    g = torch.Generator().manual_seed(0)
    n = prompts * group
    prompt_ids = [torch.randint(8, vocab, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
    completions = [torch.randint(8, vocab, (completion_len,), generator=g).tolist() for _ in range(n)]
    scored = ScoredBatch(positions=list(range(prompts)), prompt_ids=prompt_ids, completion_ids=completions,
                         logprobs=[[-6.9] * completion_len for _ in range(n)],
                         versions=[[0] * completion_len for _ in range(n)],
                         rewards=[float(i % group) for i in range(n)], finish_reasons=["length"] * n,
                         completions=[""] * n, group_size=group)
    return RolloutBatch(index=0, behavior_version=0, num_groups=prompts, group_size=group, payload=scored)


def child(args: argparse.Namespace) -> None:
    """One setting, one process: build the learner, time one update, report peak memory."""
    import torch

    from tether.config import load_config
    from tether.train.learner import TorchLearner

    torch.set_num_threads(args.threads)
    cfg = load_config(None, [f"model.path={args.model}", f"train.threads={args.threads}",
                             f"train.activation_checkpointing={args.child == 'on'}", "train.lr=1e-5"])
    learner = TorchLearner(args.model, cfg)
    batch = rollout_batch(args.prompts, args.group, 32, args.completion, learner.model.config.vocab_size)
    before_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kept = [0]

    def pack(t):
        kept[0] += t.numel() * t.element_size()
        return t

    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = learner.train(batch, train_version=0)
    seconds = time.perf_counter() - t0
    assert result.committed_updates == 1
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"update_s": seconds, "peak_mb": peak_mb, "before_update_mb": before_mb,
                      "kept_mb": kept[0] / 2**20,
                      "params_m": sum(p.numel() for p in learner.model.parameters()) / 1e6}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--completion", type=int, default=480)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        build(model, args.layers, args.hidden)
        runs: dict[str, list[dict]] = {"off": [], "on": []}
        for _ in range(args.repeats):
            for setting in runs:  # alternating, so drift in the machine's load falls on both
                out = subprocess.run(
                    [sys.executable, __file__, "--child", setting, "--model", str(model),
                     *(f"--{k}={getattr(args, k)}" for k in ("prompts", "group", "completion", "threads"))],
                    capture_output=True, text=True, check=True)
                runs[setting].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {s: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for s, rs in runs.items()}
    off, on = med["off"], med["on"]
    summary = {
        "model": f"qwen2 {args.layers}×{args.hidden}, {off['params_m']:.1f}M parameters",
        "batch": f"{args.prompts}×{args.group} sequences of {32 + args.completion} tokens",
        "threads": args.threads, "repeats": args.repeats, "off": off, "on": on,
        "kept_ratio": on["kept_mb"] / off["kept_mb"],
        "peak_ratio": on["peak_mb"] / off["peak_mb"],
        "update_peak_ratio": ((on["peak_mb"] - on["before_update_mb"])
                              / (off["peak_mb"] - off["before_update_mb"])),
        "time_ratio": on["update_s"] / off["update_s"],
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"{summary['model']}; {summary['batch']}; {args.threads} thread(s); medians of {args.repeats}")
    print(f"{'':24}{'off':>10}{'on':>10}{'on/off':>9}")
    for label, key, ratio in (("kept for backward (MB)", "kept_mb", summary["kept_ratio"]),
                              ("peak resident (MB)", "peak_mb", summary["peak_ratio"]),
                              ("update (s)", "update_s", summary["time_ratio"])):
        print(f"{label:24}{off[key]:>10.1f}{on[key]:>10.1f}{ratio:>9.2f}")
    print(f"{'peak − before update':24}{off['peak_mb'] - off['before_update_mb']:>10.1f}"
          f"{on['peak_mb'] - on['before_update_mb']:>10.1f}{summary['update_peak_ratio']:>9.2f}")


if __name__ == "__main__":
    main()
