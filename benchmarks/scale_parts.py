"""The parts of a learner update at a real size, timed apart in one process: the model's forward
and backward with the output head's log-softmax, gather and entropy (as the learner computes
them), the head alone, gradient clipping, and the fused AdamW step. What ``benchmarks/scale.py``'s
whole update is compared with (docs/benchmarks.md, "Scale").

    python benchmarks/scale_parts.py [--model /tmp/tether-scale/qwen2-0.5b] [--rows 8] [--tokens 40]

The model folder is ``benchmarks/scale.py``'s (``tether init-model --arch qwen2 --size 0.5b``).
One thread; the best of two timings of each part.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/tether-scale/qwen2-0.5b")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=40)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from tether.modeling import load_causal_lm

    model, _ = load_causal_lm(a.model)
    model.train()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (a.rows, a.tokens))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    head = model.get_output_embeddings().weight

    def logprobs_and_entropy(logits: torch.Tensor) -> torch.Tensor:
        logp_all = torch.log_softmax(logits.float(), -1)
        logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
        with torch.no_grad():
            (-(logp_all.exp() * logp_all).sum(-1)).mean()
        return -logp.mean()

    def forward_backward() -> None:
        logprobs_and_entropy(model(input_ids=ids, use_cache=False).logits[:, :-1]).backward()

    def head_only() -> None:
        hidden = torch.randn(a.rows, a.tokens - 1, head.shape[1], requires_grad=True)
        logprobs_and_entropy(hidden @ head.T).backward()

    parts = [("forward + backward (head included)", forward_backward), ("the output head alone", head_only),
             ("gradient clipping", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)),
             ("fused AdamW step", optimizer.step)]
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    from limits import matmul_parameters

    flops = 6 * matmul_parameters(model) * a.rows * a.tokens
    for name, fn in parts:
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        extra = f"  ({flops / best / 1e9:.0f} GFLOP/s of 6·matmul parameters·tokens)" if name.startswith(
            "forward") else ""
        print(f"{name:36s} {best:7.2f} s{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
