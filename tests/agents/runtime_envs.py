"""Environments for tests/agents/test_env_runtime.py: state opened in reset and used in step
(an asyncio queue, lock and task; a sqlite connection), calls that count how many run at once, and
environments that read their configuration (env.kwargs, skyrl-gym's env_config and extras)."""

import asyncio
import sqlite3
import threading
import time

from tether.families.agent.env import Step

CLOSED: list[str] = []
"""How each environment's close found its state ('same' when on reset's thread and loop)."""


class AsyncClient:
    """A client as remote-tool environments hold one: reset starts a server task that answers on an
    asyncio queue under an asyncio lock; each step asks it and awaits the answer (all bound to the
    loop reset ran on)."""

    async def reset(self, task, seed):
        self.loop, self.thread = asyncio.get_running_loop(), threading.get_ident()
        self.lock = asyncio.Lock()
        self.requests: asyncio.Queue = asyncio.Queue()
        self.replies: asyncio.Queue = asyncio.Queue()
        self.server = asyncio.get_running_loop().create_task(self._serve())
        self.n = 0
        return "go\n"

    async def _serve(self):
        while True:
            action = await self.requests.get()
            async with self.lock:
                await asyncio.sleep(0)
                await self.replies.put(f"heard {len(action)}\n")

    async def step(self, action):
        if asyncio.get_running_loop() is not self.loop or threading.get_ident() != self.thread:
            raise RuntimeError("step runs on another event loop or thread than reset")
        async with self.lock:
            await self.requests.put(action)
        reply = await asyncio.wait_for(self.replies.get(), timeout=5)
        self.n += 1
        return Step(reply, reward=1.0, done=self.n == 2)

    async def close(self):
        same = asyncio.get_running_loop() is self.loop and threading.get_ident() == self.thread
        self.server.cancel()
        CLOSED.append("same" if same else "other")


class SqliteTable:
    """A sync environment holding a sqlite connection (usable only on the thread that opened it)."""

    def reset(self, task, seed):
        self.db = sqlite3.connect(":memory:")
        self.db.execute("create table turns (n integer)")
        return "go\n"

    def step(self, action):
        self.db.execute("insert into turns values (1)")
        (n,) = self.db.execute("select count(*) from turns").fetchone()
        return Step(f"row {n}\n", reward=1.0, done=n == 2)

    def close(self):
        self.db.close()
        CLOSED.append("sqlite")


RUNNING = 0
PEAK = 0
_lock = threading.Lock()


def _counted(seconds):
    """Sleep ``seconds`` as one environment call, counting the calls that run at once."""
    global RUNNING, PEAK
    with _lock:
        RUNNING += 1
        PEAK = max(PEAK, RUNNING)
    try:
        time.sleep(seconds)
    finally:
        with _lock:
            RUNNING -= 1


class SlowReset:
    """A 0.3 s reset and instant steps: with few workers, resets wait for one."""

    def reset(self, task, seed):
        _counted(0.3)
        return "go\n"

    def step(self, action):
        return Step("ok\n", reward=1.0, done=True)


class SomeHang:
    """Calls of 0.1 s, but the steps of the environments of seeds 0 and 4 take 2 s (past the step
    timeout, holding their workers)."""

    def reset(self, task, seed):
        self.seed, self.n = seed, 0
        _counted(0.05)
        return "go\n"

    def step(self, action):
        self.n += 1
        _counted(2.0 if self.seed % 4 == 0 else 0.1)
        return Step("ok\n", reward=1.0, done=self.n == 3)


class Tabled:
    """A native environment built with keyword arguments (env.kwargs)."""

    def __init__(self, table, *, difficulty=1):
        self.table, self.difficulty = table, difficulty

    def reset(self, task, seed):
        return f"{self.table} at {self.difficulty}\n"

    def step(self, action):
        return Step("", reward=float(self.difficulty), done=True)


class FakeSearch:
    """skyrl-gym's BaseTextEnv as its SearchEnv is written: settings from env_config's attributes,
    the turn limit from extras['max_turns']."""

    def __init__(self, env_config, extras={}):  # noqa: B006 - skyrl-gym's own signature
        self.search_url, self.topk = env_config.search_url, env_config.topk
        self.max_turns = extras["max_turns"] if "max_turns" in extras else 2  # noqa: SIM401 - SearchEnv's
        self.turns = 0

    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        self.turns += 1
        done = self.turns >= self.max_turns
        observation = [{"role": "user", "content": f"asked {self.search_url} for {self.topk}\n"}]
        return {"observations": observation, "reward": 1.0 if done else 0.0, "done": done, "metadata": {}}
