"""The tiny SD3 pipeline's tokenizer (``flow.init_tokens``): one token a character at the recipe's
32 positions against one token a word at 8, side by side in one run.

SD3's transformer carries the prompt's tokens beside the image's through every block (joint
attention), padding included: the shapes task's 16 latent patches sit beside 32 text positions
when each character is a token, beside 8 when each word is. Both pipelines are built untrained
with the ``make flow-sd3`` recipe's geometry (``recipes/flow-sd3.yaml``: width, depth, 16 × 16
pixels; the weights do not change the cost). In interleaved repeats, medians of this process's
CPU seconds (wall in brackets): the rollout worker's generation of the recipe's batch
(``FlowSampler.generate``: the prompts' encoding, the guided trajectories with their SDE window,
decoding and scoring) and one learner update on it (``TorchLearner.train``: the policy's and the
KL reference's guided forwards and the backward over the window's steps).

    python benchmarks/flow_sd3_tokens.py [--repeats 5] [--threads 1] [--json] [KEY=VALUE ...]

KEY=VALUE settings go on top of the recipe for both arms (``flow.init_width=128``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"characters": 32, "words": 8}
"""Each tokenizer with the prompt length the recipe gives it (data.max_prompt_tokens)."""


def measure(repeats: int, threads: int, overrides: list[str]) -> dict:
    from tether.config import load_config
    from tether.families.flow import scenes
    from tether.families.flow.rollout import FlowSampler
    from tether.families.flow.sd3_warmstart import VAE_WIDTH
    from tether.families.flow.task import SHAPES
    from tether.families.flow.tiny_sd3 import build_tiny_sd3
    from tether.train.learner import TorchLearner
    from tether.vocabulary import SamplingParams, WorkItem

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from flow_window import interleaved, median

    torch.set_num_threads(threads)
    folder = Path(tempfile.mkdtemp())
    arms = {}
    for tokens, length in ARMS.items():
        keys = [*overrides, f"flow.init_tokens={tokens}", f"data.max_prompt_tokens={length}",
                f"train.threads={threads}"]
        cfg = load_config(ROOT / "recipes" / "flow-sd3.yaml", [*keys, f"model.path={folder / tokens}"])
        path = build_tiny_sd3(folder / tokens, seed=cfg.run.seed, image_size=scenes.SIZE,
                              width=cfg.flow.init_width, depth=cfg.flow.init_depth, max_prompt_tokens=length,
                              vae_width=VAE_WIDTH, words=scenes.WORDS[1:] if tokens == "words" else ())
        arms[tokens] = (FlowSampler(cfg, str(path), device=torch.device("cpu")), TorchLearner(str(path), cfg))
    b, g = cfg.rollout.batch_size, cfg.rollout.group_size  # the recipe's, the same for both arms
    item = WorkItem(batch_index=0, version=0, examples=list(enumerate(SHAPES.examples("train", b, seed=0))),
                    group_size=g, params=SamplingParams(max_new_tokens=1), seed=0)
    gen, learn = interleaved(arms, item, repeats)

    rows = [{"tokens": t, "max_prompt_tokens": ARMS[t], "gen_s": median(gen[t], 0),
             "gen_cpu_s": median(gen[t], 1), "learner_s": median(learn[t], 0),
             "learner_cpu_s": median(learn[t], 1)} for t in arms]
    first = rows[0]
    for row in rows:
        row["gen_speedup"] = first["gen_cpu_s"] / row["gen_cpu_s"]
        row["learner_speedup"] = first["learner_cpu_s"] / row["learner_cpu_s"]
    return {"threads": threads, "repeats": repeats, "samples_per_batch": b * g, "steps": cfg.flow.steps,
            "width": cfg.flow.init_width, "depth": cfg.flow.init_depth, "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    out = measure(args.repeats, args.threads, args.overrides)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"the SD3 recipe's batch ({out['samples_per_batch']} trajectories × {out['steps']} steps, width "
          f"{out['width']}, depth {out['depth']}), {out['threads']} threads, medians of {out['repeats']}; "
          "CPU seconds (wall in brackets):")
    print("  tokens (prompt length) | generation s | learner s | speed-up: generation / learner")
    for r in out["rows"]:
        print(f"  {r['tokens']:>10} ({r['max_prompt_tokens']:>2}) | "
              f"{r['gen_cpu_s']:6.3f} [{r['gen_s']:6.3f}] | "
              f"{r['learner_cpu_s']:6.3f} [{r['learner_s']:6.3f}] | {r['gen_speedup']:.2f}× / "
              f"{r['learner_speedup']:.2f}×")
    return 0


if __name__ == "__main__":
    sys.exit(main())
