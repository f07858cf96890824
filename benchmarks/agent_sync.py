"""Where agent episodes take up published weights, measured side by side in one run: draining
whole batches, draining at turn boundaries, and keep at turns or at any decode step.

Each setting runs ``--repeats`` times, the settings taking turns, and reports its median run.

The same untrained `small` model trains on episodes against a tool that sleeps a random
0..2×``DELAY_S`` (0.05) seconds a step (seeded per episode) for 3 turns, at S = 1 with two batches in
flight, one core for training and one for generation. A synthetic reward (an action of odd length
scores 1) varies within every group, so every update commits and weights change at every step.

Reported per setting: episodes/s and its ratio to draining whole batches, the trainer's idle
fraction (time waiting for a rollout batch / step time), the mean staleness of the batches (their
oldest model token) and of their model tokens, the share of episodes that span versions, and how
long a publication waited for the turns in flight (``sync/turn_wait_s``, draining at turns).

    python benchmarks/agent_sync.py [--batches N] [--repeats R] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from tether.families.agent.env import Step

SETTINGS = [("drain", "token"), ("drain", "turn"), ("keep", "turn"), ("keep", "token")]
DELAY_S = 0.05
START_UP = 2  # batches left out of every figure: the first runs' start-up


class SlowTool:
    """Three steps, each sleeping a random 0..2×DELAY_S seconds (seeded per episode); an action of
    odd length scores 1."""

    def reset(self, task, seed):
        self.rng, self.n = random.Random(seed), 0
        return f"go {task.get('answer', '')}\n"

    def step(self, action):
        time.sleep(self.rng.uniform(0.0, 2 * DELAY_S))
        self.n += 1
        return Step(f"o{self.n}\n", reward=float(len(action) % 2), done=self.n == 3)


def run_one(model_dir: Path, mode: str, switch_at: str, batches: int, out: Path) -> dict:
    from tether.config import load_config
    from tether.runtime.run import train

    cfg = load_config(None, [
        "model.family=agent", "data.task=kv_lookup", "data.num_eval=8", f"model.path={model_dir}",
        f"env.env_class={Path(__file__).resolve()}:SlowTool", "env.max_turns=3", "env.max_turn_tokens=8",
        "rollout.max_new_tokens=8", "rollout.batch_size=4", "rollout.group_size=4", "async.max_staleness=1",
        "async.max_inflight=2", f"async.inflight_update={mode}", f"env.switch_at={switch_at}",
        f"train.num_batches={batches}", "train.lr=1e-4", "eval.interval=0", "checkpoint.interval=0",
    ])
    train(cfg, out, progress_plain=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][START_UP:]
    mean = lambda key, default=0.0: statistics.fmean(r.get(key, default) for r in rows)  # noqa: E731
    steps = [r["time/step"] for r in rows]
    waits = [r["sync/turn_wait_s"] for r in rows if "sync/turn_wait_s" in r]
    return {
        "episodes_per_s": 16 * len(rows) / sum(steps),
        "trainer_idle_fraction": sum(r["time/generate_wait"] for r in rows) / sum(steps),
        "staleness_batches": mean("staleness/batches"),
        "token_staleness_updates": mean("staleness/token_mean_updates"),
        "multi_version_episode_frac": mean("staleness/multi_version_seq_frac"),
        "turn_wait_s": statistics.fmean(waits) if waits else None,
        "gen_s": mean("time/generate"), "train_s": mean("time/train"),
    }


def measure(batches: int, repeats: int) -> dict:
    from transformers.utils import logging as hf_logging

    from tether.data.tiny_model import init_model

    hf_logging.disable_progress_bar()
    tries: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        init_model(tmp / "model", size="small", seed=0)
        for round_ in range(repeats):  # the settings take turns: the machine's drift reaches them alike
            for mode, switch_at in SETTINGS:
                key = f"{mode} @{switch_at}"
                tries.setdefault(key, []).append(
                    run_one(tmp / "model", mode, switch_at, batches, tmp / f"{mode}-{switch_at}-{round_}"))
    runs = {key: sorted(t, key=lambda m: m["episodes_per_s"])[len(t) // 2] for key, t in tries.items()}
    base = runs["drain @token"]["episodes_per_s"]
    return {"batches": batches, "delay_s": DELAY_S, "repeats": repeats,
            "settings": {key: m | {"vs_drain": m["episodes_per_s"] / base,
                                   "episodes_per_s_all": [t["episodes_per_s"] for t in tries[key]]}
                         for key, m in runs.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of every setting, interleaved")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.batches <= START_UP:
        ap.error(f"--batches {a.batches}: the first {START_UP} batches (start-up) are not measured; "
                 f"give {START_UP + 1} or more")
    r = measure(a.batches, a.repeats)
    if a.json:
        print(json.dumps(r))
        return 0
    print(f"{r['batches']} batches per setting, median of {r['repeats']} interleaved runs, 4 tasks × 4 "
          f"episodes of 3 turns, a tool of 0..{2 * r['delay_s']:g} s a step, S = 1, 1 thread each side")
    print(f"{'setting':>14}{'episodes/s':>12}{'vs drain':>10}{'T idle':>8}{'stale':>7}{'tok stale':>10}"
          f"{'spanning':>10}{'turn wait':>11}{'gen s':>7}{'train s':>8}")
    for key, m in r["settings"].items():
        wait = "—" if m["turn_wait_s"] is None else f"{1000 * m['turn_wait_s']:.0f} ms"
        print(f"{key:>14}{m['episodes_per_s']:>12.1f}{m['vs_drain']:>9.2f}×{m['trainer_idle_fraction']:>8.0%}"
              f"{m['staleness_batches']:>7.2f}{m['token_staleness_updates']:>10.2f}"
              f"{m['multi_version_episode_frac']:>10.0%}{wait:>11}{m['gen_s']:>7.3f}{m['train_s']:>8.3f}")
    print("drain @token: publications wait for whole batches; drain @turn: for the turns in flight; "
          "keep @turn: for nothing, episodes take them up between turns; keep @token: at any decode "
          "step. tok stale: mean staleness of the model tokens, in updates; spanning: episodes "
          "sampled under more than one version")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
