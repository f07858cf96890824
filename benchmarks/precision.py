"""Engine dtype × learner dtype: the train–inference mismatch each combination adds, and the
learner's step time.

For each engine precision (``rollout.dtype``: the built-in engine's weights and activations) a
fresh rollout batch is sampled (8 arithmetic prompts × 4 samples, 16 new tokens, the `small`
preset, random weights); for each learner precision (``train.dtype``) the learner recomputes the
sampled tokens' log-probs with the very weights the engine sampled with (π_old, its shared-prompt
forward, as in training). Reported per combination, over every completion token:

- ``mismatch_mean`` / ``mismatch_max``: |log π_learner − log μ| (``mismatch/numeric_*``);
- ``ratio_std``: the standard deviation of π_learner/μ (1 ± this is the spread the clip range
  and the corrections see before any update);
- ``step_s``: the median time of one learner update (``TorchLearner.train``, U = 1) on that
  batch, interleaved with the other learner precision's; ``step_vs_fp32``: against the float32
  learner on the same batch.

A float32 engine samples through the native decoder, a bfloat16 one through the lean decoder's
Python path (the native decoder is float32 only): ``engine_s`` is the time of one batch's
generation. Threads are pinned (``--threads``).

    python benchmarks/precision.py [--threads 1] [--repeats 7] [--size small] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

DTYPES = ("float32", "bfloat16")


def sample(path: str, dtype: str, n_prompts: int = 8, group: int = 4):
    """(rollout batch, engine seconds) from the built-in engine in ``dtype``."""
    from tether.data.tasks import get_task
    from tether.families.text.payload import ScoredBatch
    from tether.modeling import cast_parameters, load_causal_lm
    from tether.rollout.engines.torch.engine import TorchEngine
    from tether.vocabulary import RolloutBatch, SamplingParams

    model, tok = load_causal_lm(path)
    engine = TorchEngine(cast_parameters(model, dtype), pad_id=tok.pad_token_id, stop_ids=[tok.eos_token_id])
    examples = get_task("arithmetic").examples("train", n_prompts, seed=0)
    prompts = [tok(e.prompt, add_special_tokens=False).input_ids for e in examples]
    params = SamplingParams(max_new_tokens=16)
    engine.generate(prompts, samples_per_prompt=group, params=params, seed=1)  # warm: weights read, library
    t0 = time.perf_counter()
    groups = engine.generate(prompts, samples_per_prompt=group, params=params, seed=0)
    seconds = time.perf_counter() - t0
    flat = [c for g in groups for c in g]
    n = len(flat)
    scored = ScoredBatch(positions=list(range(n_prompts)), prompt_ids=prompts,
                         completion_ids=[c.token_ids for c in flat], logprobs=[c.logprobs for c in flat],
                         versions=[c.versions for c in flat], rewards=[float(i % 3 == 0) for i in range(n)],
                         finish_reasons=[c.finish_reason for c in flat], completions=[""] * n,
                         group_size=group)
    batch = RolloutBatch(index=0, behavior_version=0, num_groups=n_prompts, group_size=group, payload=scored)
    return batch, seconds, engine.decoder_path


def agreement(learner, batch) -> dict[str, float]:
    """|log π_learner − log μ| and the spread of π_learner/μ over the batch's completion tokens."""
    tb = learner.policy.batch(batch.payload)
    with torch.no_grad():
        logp = learner.policy.forward(learner.model, tb, forward=learner.forward)[0]
    m = tb.mask.bool()
    diff = (logp - tb.behavior_logp)[m]
    return {"mismatch_mean": float(diff.abs().mean()), "mismatch_max": float(diff.abs().max()),
            "ratio_std": float(diff.exp().std(unbiased=False)), "tokens": int(m.sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--size", default="small")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    from tether.config import load_config
    from tether.data.tiny_model import init_model
    from tether.train.learner import TorchLearner

    hf_logging.disable_progress_bar()
    path = tempfile.mkdtemp() + "/model"
    init_model(path, size=args.size, seed=0)
    rows = []
    for engine_dtype in DTYPES:
        batch, engine_s, path_used = sample(path, engine_dtype)
        learners = {d: TorchLearner(path, load_config(None, [f"train.dtype={d}", "train.lr=1e-6"]))
                    for d in DTYPES}
        found = {d: agreement(learner, batch) for d, learner in learners.items()}
        times: dict[str, list[float]] = {d: [] for d in DTYPES}
        for _ in range(args.repeats + 1):  # interleaved; the first of each is a warm-up
            for d, learner in learners.items():
                t0 = time.perf_counter()
                learner.train(batch, train_version=0)
                times[d].append(time.perf_counter() - t0)
        base = statistics.median(times["float32"][1:])
        for d in DTYPES:
            step = statistics.median(times[d][1:])
            rows.append({"engine": engine_dtype, "learner": d, **found[d], "step_s": step,
                         "step_vs_fp32": step / base, "engine_s": engine_s, "decoder": path_used})
    if args.json:
        print(json.dumps({"threads": args.threads, "size": args.size, "rows": rows}, indent=1))
        return
    print(f"{args.size} model, {args.threads} thread(s)")
    print(f"{'engine':>9} {'learner':>9} {'tokens':>6} {'|Δlogp| mean':>13} {'max':>9} {'std π/μ':>9} "
          f"{'step s':>8} {'vs fp32':>8} {'engine s':>9}")
    for r in rows:
        print(f"{r['engine']:>9} {r['learner']:>9} {r['tokens']:6d} {r['mismatch_mean']:13.2e} "
              f"{r['mismatch_max']:9.2e} {r['ratio_std']:9.2e} {r['step_s']:8.3f} {r['step_vs_fp32']:8.2f} "
              f"{r['engine_s']:9.3f} ({r['decoder']})")


if __name__ == "__main__":
    main()
