"""What a remote environment costs per call: the same environment stepped in process against
through ``RemoteEnv`` and ``tether env serve``'s server on the loopback address, one episode at a
time and ``--concurrent`` episodes at once (each on a thread of its own, as the runtime runs them).

    python benchmarks/remote_env.py [--episodes 64] [--steps 16] [--concurrent 8] [--repeats 3]
                                    [--observation-chars 200] [--nagle] [--json]

The environment does no work (it answers a fixed observation), so what is measured is the
protocol: JSON, HTTP and the server's per-episode threads. The server runs in this process, on
the same cores and interpreter as the client (a separate process or machine only adds the
network), so the figures are an upper bound for loopback. ``--nagle`` leaves Nagle's algorithm on
in the server's sockets (the standard library's default), to show why the server turns it off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from tether.families.agent.env import Step, as_step, factory
from tether.families.agent.remote import RemoteEnv
from tether.families.agent.serve import serve


class Answers:
    """Answers every action with ``chars`` characters; the episode is ``steps`` steps long."""

    chars = 200
    steps = 16

    def reset(self, task, seed):
        self.n = 0
        return "go\n"

    def step(self, action):
        self.n += 1
        return Step("x" * self.chars, reward=0.5, done=self.n == self.steps)


def episodes(make_env, n: int, steps: int) -> int:
    """Play ``n`` episodes of ``steps`` steps one after another; returns the calls made."""
    calls = 0
    for i in range(n):
        env = make_env()
        env.reset({"prompt": "p", "answer": "a"}, i)
        for _ in range(steps):
            as_step(env.step("an action of some length"))
        env.close()
        calls += steps + 2
    return calls


def timed(make_env, n: int, steps: int, concurrent: int) -> float:
    """Microseconds per call, ``n`` episodes split over ``concurrent`` threads."""
    threads = [threading.Thread(target=episodes, args=(make_env, n // concurrent, steps))
               for _ in range(concurrent)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (time.perf_counter() - start) / ((n // concurrent) * concurrent * (steps + 2)) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--concurrent", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--observation-chars", type=int, default=200)
    p.add_argument("--nagle", action="store_true", help="leave Nagle's algorithm on in the server")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.nagle:
        from tether.families.agent import serve as serving

        serving._Handler.disable_nagle_algorithm = False
    Answers.chars, Answers.steps = args.observation_chars, args.steps
    local = factory(Answers, {})
    out: dict[str, float] = {}
    with serve(Answers, workers=max(8, args.concurrent)) as server:
        def remote():
            return RemoteEnv(server.url, timeout_s=30)

        for label, concurrent in (("sequential", 1), ("concurrent", args.concurrent)):
            here = [timed(local, args.episodes, args.steps, concurrent) for _ in range(args.repeats)]
            there = [timed(remote, args.episodes, args.steps, concurrent) for _ in range(args.repeats)]
            out[f"{label}_local_us_per_call"] = statistics.median(here)
            out[f"{label}_remote_us_per_call"] = statistics.median(there)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{args.episodes} episodes x {args.steps} steps, {args.observation_chars}-character observations, "
          f"median of {args.repeats}")
    for label in ("sequential", "concurrent"):
        here, there = out[f"{label}_local_us_per_call"], out[f"{label}_remote_us_per_call"]
        print(f"  {label:<10}  in process {here:8.1f} us/call   remote {there:8.1f} us/call   "
              f"({there - here:.0f} us more a call)")


if __name__ == "__main__":
    main()
