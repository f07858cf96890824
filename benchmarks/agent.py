"""A slow environment against the episode player: episodes per second with environment calls run
inline (one after another, in the generating thread: what a loop that steps environments itself
does) against the environment threads, in waves and eager.

    python benchmarks/agent.py [--episodes 64] [--delay 0.05] [--turns 3] [--workers 16]
                               [--repeats 3] [--json]

Each step sleeps a random 0..2×``--delay`` seconds (a tool call, a sandbox, a remote API); the
model is the tiny built-in Qwen3 on one thread, so generation is cheap next to the environment and
the ratio says how much of the environment's latency the threads hide. All three arms run side by
side in one process, on the same model, episodes and delays.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from tether.decoding.sampling import stop_ids_for
from tether.families.agent.env import Step, factory
from tether.families.agent.envthreads import EnvThreads
from tether.families.agent.episode import Limits
from tether.families.agent.episodes import Player
from tether.modeling import load_causal_lm
from tether.rollout.engines.torch.engine import TorchEngine
from tether.vocabulary import SamplingParams


class SlowEnv:
    """``turns`` steps, each sleeping a random 0..2×delay seconds (seeded per episode)."""

    delay = 0.05
    turns = 3

    def reset(self, task, seed):
        self.rng, self.n = random.Random(seed), 0
        return "go\n"

    def step(self, action):
        time.sleep(self.rng.uniform(0.0, 2 * self.delay))
        self.n += 1
        return Step("ok\n", reward=1.0, done=self.n == self.turns)


def run(arm: str, engine, tokenizer, episodes: int, workers: int) -> dict:
    threads = EnvThreads(0 if arm == "inline" else workers)
    limits = Limits(
        max_turns=SlowEnv.turns,
        max_turn_tokens=4,
        max_episode_tokens=128,
        step_timeout_s=60,
        episode_timeout_s=600,
    )
    player = Player(
        engine,
        tokenizer,
        factory(SlowEnv, {}),
        limits,
        threads,
        schedule="eager" if arm == "eager" else "waves",
    )
    tasks = [({}, i) for i in range(episodes)]
    t0 = time.perf_counter()
    played = player.play(tasks, SamplingParams(max_new_tokens=4, temperature=1.0), seed=0)
    wall = time.perf_counter() - t0
    threads.close()
    assert all(ep.status == "done" for ep in played), {ep.status for ep in played}
    return {
        "arm": arm,
        "seconds": wall,
        "episodes_per_s": episodes / wall,
        "env_s": sum(ep.env_s for ep in played),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--delay", type=float, default=0.05)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the three arms, interleaved")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    SlowEnv.delay, SlowEnv.turns = args.delay, args.turns
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    from tether.data.tiny_model import init_model

    with tempfile.TemporaryDirectory() as tmp:
        init_model(Path(tmp) / "m", arch="qwen3", size="tiny", seed=0)
        model, tokenizer = load_causal_lm(Path(tmp) / "m")
    engine = TorchEngine(model, pad_id=tokenizer.pad_token_id, stop_ids=stop_ids_for(tokenizer, "\n"))
    arms = ("inline", "waves", "eager")
    rounds = [[run(arm, engine, tokenizer, args.episodes, args.workers) for arm in arms]
              for _ in range(args.repeats)]  # the arms interleaved, round by round
    rows = []
    for i, arm in enumerate(arms):
        ratios = sorted(r[i]["episodes_per_s"] / r[0]["episodes_per_s"] for r in rounds)
        rates = sorted(r[i]["episodes_per_s"] for r in rounds)
        rows.append({"arm": arm, "episodes_per_s": statistics.median(rates),
                     "seconds": statistics.median(r[i]["seconds"] for r in rounds),
                     "speedup_vs_inline": statistics.median(ratios), "spread": [ratios[0], ratios[-1]]})
    if args.json:
        print(json.dumps({"args": vars(args), "rows": rows}, indent=2))
        return 0
    print(
        f"{args.episodes} episodes of {args.turns} steps, each step 0..{2 * args.delay:g}s; "
        f"{args.workers} environment threads; medians of {args.repeats} rounds"
    )
    for row in rows:
        print(
            f"  {row['arm']:>6}: {row['seconds']:7.2f}s  {row['episodes_per_s']:7.1f} episodes/s  "
            f"{row['speedup_vs_inline']:6.2f}× inline ({row['spread'][0]:.2f}–{row['spread'][1]:.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
