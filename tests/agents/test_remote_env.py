"""Remote environments: RemoteEnv plays episodes against an environment served over HTTP on the
loopback address (``serve`` in this process, ``tether env serve`` in a subprocess), through the real
Player on a tiny model, with the same transcripts as the environment played locally; a server that
refuses connections, answers garbage or hangs fails or times out its episodes, never the batch."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

pytest.importorskip("torch")
import torch

from tether.config.config import load_config
from tether.errors import ConfigError
from tether.families.agent.env import Step
from tether.families.agent.remote import RemoteEnv
from tether.families.agent.serve import serve
from tether.pyload import load_python_object
from tether.vocabulary import Example, SamplingParams, WorkItem

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
HERE = Path(__file__).parent
ROOT = HERE.parents[1]
ENVS, RUNTIME_ENVS = HERE / "envs.py", HERE / "runtime_envs.py"
REMOTE = "tether.families.agent.remote:RemoteEnv"


def env_class(spec: str):
    """A test environment class as ``env.env_class`` loads it (same module, same state)."""
    return load_python_object(spec, what="env.env_class")


def config(model_dir, env_class: str, *extra: str):
    return load_config(None, ["model.family=agent", "data.task=kv_lookup", f"model.path={model_dir}",
                              f"env.env_class={env_class}", "env.max_turns=4", "env.max_turn_tokens=5",
                              "rollout.max_new_tokens=5", "env.step_timeout_s=5", "rollout.group_size=4",
                              "env.max_failed_frac=1", *extra])


def remote(model_dir, url: str, *extra: str, timeout_s: float = 10):
    return config(model_dir, REMOTE, f"env.kwargs={{url: '{url}', timeout_s: {timeout_s}}}", *extra)


def play(cfg, n_tasks: int = 2):
    from tether.families.agent.sampler import AgentSampler

    sampler = AgentSampler(cfg, str(cfg.model.path), cfg.env.turn_stop, device=torch.device("cpu"), threads=1,
                           seed=0)
    examples = [(i, Example(prompt=f"task {i}", answer=str(i))) for i in range(n_tasks)]
    try:
        return sampler.generate(WorkItem(batch_index=0, version=0, examples=examples, group_size=4,
                                         params=SamplingParams(max_new_tokens=5, temperature=1.0), seed=11))
    finally:
        sampler.close()


@pytest.fixture(scope="module")
def servers():
    """Test environments served on 127.0.0.1 (a free port each), by class spec."""
    started = {spec: serve(env_class(spec), idle_timeout_s=30) for spec in (
        f"{ENVS}:Echo", f"{ENVS}:Summarises", f"{RUNTIME_ENVS}:AsyncClient", f"{ENVS}:Malformed",
        f"{ENVS}:ResetRaises", f"{ENVS}:Exits", f"{ENVS}:Hangs")}
    started[f"{ENVS}:Hangs"].CLOSE_WAIT_S = 0.1  # its episodes' closes wait behind steps that never return
    yield {spec: s.url for spec, s in started.items()}
    for s in started.values():
        s.shutdown()


def free_port() -> int:
    """A port nothing listens on: bound (port 0) and closed again."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- episodes through the real Player --------------------------------------------------------------


@pytest.mark.parametrize("spec", [f"{ENVS}:Echo", f"{ENVS}:Summarises", f"{RUNTIME_ENVS}:AsyncClient"])
def test_a_served_environment_plays_the_same_episodes_as_played_locally(tiny_model_dir, servers, spec):
    """Echo (sync), Summarises (history rewrites; returns that depend on the actions) and AsyncClient
    (an async environment whose steps fail unless they run on reset's thread and event loop)."""
    here = play(config(tiny_model_dir, spec))
    there = play(remote(tiny_model_dir, servers[spec]))
    assert there.statuses == here.statuses and set(here.statuses) == {"done"}, there.errors
    assert there.transcripts == here.transcripts
    assert there.rewards == here.rewards and there.step_rewards == here.step_rewards
    assert there.ids == here.ids and there.episode_of == here.episode_of


def test_an_action_error_on_the_server_is_an_action_error_and_the_episode_goes_on(tiny_model_dir, servers):
    batch = play(remote(tiny_model_dir, servers[f"{ENVS}:Malformed"]))
    assert batch.statuses == ["max_turns"] * 8, batch.errors
    assert batch.metrics["agent/action_errors"] == 8 * 4 and batch.metrics["agent/env_errors"] == 0
    assert batch.transcripts[0][2] == "bad\n"  # the server's message is the observation the model sees


@pytest.mark.parametrize(("spec", "says"), [
    ("ResetRaises", r"environment RemoteEnv: reset raised RemoteError: http://127\.0\.0\.1:\d+/reset: "
                    r"ResetRaises\.reset raised RuntimeError: no sandbox today"),
    ("Exits", r"environment RemoteEnv: step raised RemoteError: http://127\.0\.0\.1:\d+/step: "
              r"Exits\.step raised SystemExit: the tool quit"),
])
def test_an_exception_on_the_server_ends_the_episode_as_error_with_the_servers_message(
        tiny_model_dir, servers, spec, says):
    batch = play(remote(tiny_model_dir, servers[f"{ENVS}:{spec}"]))
    assert batch.statuses == ["error"] * 8 and batch.metrics["agent/env_errors"] == 8
    assert all(re.fullmatch(says, e) for e in batch.errors), batch.errors[0]


# -- bad input -------------------------------------------------------------------------------------


def test_a_server_that_refuses_connections_fails_every_episode_naming_the_url(tiny_model_dir):
    url = f"http://127.0.0.1:{free_port()}"
    batch = play(remote(tiny_model_dir, url))
    assert batch.statuses == ["error"] * 8 and batch.metrics["agent/env_errors"] == 8
    assert f"cannot reach the environment server at {url} (/reset): ConnectionRefusedError" in batch.errors[0]


class Garbage(BaseHTTPRequestHandler):
    """A server that answers /reset as the protocol says and /step with ``STEP`` (status, body)."""

    protocol_version = "HTTP/1.1"
    STEP: ClassVar[dict[int, tuple[int, bytes]]] = {}
    """By the server's port."""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        status, body = ((200, json.dumps({"episode_id": "x", "observation": "go\n"}).encode())
                        if self.path == "/reset" else self.STEP[self.server.server_address[1]])
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(("status", "body", "says"), [
    (200, b"<html>hello</html>",
     r"/step answered HTTP 200 with what is not a JSON object: '<html>hello</html>'"),
    (200, b'{"obs": "x"}', r"/step answered without 'observation': '{\"obs\": \"x\"}'"),
    (200, b'{"observation": "x", "done": "yes"}', r"step returned done='yes'; expected True or False"),
    (500, b"Internal Server Error", r"/step answered HTTP 500: 'Internal Server Error'"),
    (500, b'{"detail": "Environment error: boom"}', r"/step answered HTTP 500: Environment error: boom$"),
    (500, b'{"error": {"type": "environment_error", "message": "the sandbox died"}}',
     r"/step: the sandbox died"),
])
def test_a_server_that_answers_garbage_ends_the_episode_as_error_saying_what_came(
        tiny_model_dir, status, body, says):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Garbage)
    httpd.daemon_threads = True
    Garbage.STEP[httpd.server_address[1]] = (status, body)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        batch = play(remote(tiny_model_dir, f"http://127.0.0.1:{httpd.server_address[1]}"))
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert batch.statuses == ["error"] * 8 and batch.metrics["agent/env_errors"] == 8
    assert re.search(says, batch.errors[0]), batch.errors[0]


@pytest.mark.timeout(30)
def test_a_hung_server_times_the_episodes_out_at_the_step_timeout_never_hanging_the_batch(
        tiny_model_dir, servers):
    """Hangs' second step never returns; the client gives up its request at timeout_s (freeing its
    worker) after the episode's own deadline, env.step_timeout_s, has ended it as timeout."""
    batch = play(remote(tiny_model_dir, servers[f"{ENVS}:Hangs"], "env.step_timeout_s=0.5", timeout_s=1))
    assert batch.statuses == ["timeout"] * 8 and batch.metrics["agent/timeouts"] == 8
    assert all(e == "environment RemoteEnv: step ran past its timeout" for e in batch.errors)


@pytest.mark.parametrize(("kwargs", "says"), [
    ("{}", r"env.kwargs for RemoteEnv: url is missing: set env.kwargs.url"),
    ("{url: 'localhost:8000'}", r"env.kwargs for RemoteEnv: url 'localhost:8000' is not an http:// or https://"),
    ("{url: 'http://'}", r"url 'http://' is not an http:// or https:// address with a host"),
    ("{url: 'http://127.0.0.1:99999'}", r"url 'http://127.0.0.1:99999' has a bad port"),
    ("{url: 'http://127.0.0.1:8000/?x=1'}", r"not a query"),
    ("{url: 'http://127.0.0.1:8000', timeout_s: 0}", r"timeout_s=0 must be a number of seconds above 0"),
    ("{url: 'http://127.0.0.1:8000', timeout: 3}",
     r"env.kwargs for RemoteEnv: unknown key 'timeout'; valid: url, timeout_s, headers"),
    ("{url: 'http://127.0.0.1:8000', headers: [a]}", r"headers=\['a'\] must map header names to text"),
])
def test_a_remote_environment_the_recipe_gets_wrong_is_refused_when_it_loads(tiny_model_dir, kwargs, says):
    with pytest.raises(ConfigError, match=says):
        config(tiny_model_dir, REMOTE, f"env.kwargs={kwargs}")


# -- the server ------------------------------------------------------------------------------------


def wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_an_episode_its_client_abandoned_is_closed_on_the_server_once_idle():
    module = sys.modules[env_class(f"{RUNTIME_ENVS}:AsyncClient").__module__]
    module.CLOSED.clear()
    with serve(env_class(f"{RUNTIME_ENVS}:AsyncClient"), idle_timeout_s=0.3) as server:
        client = RemoteEnv(server.url, timeout_s=5)
        assert client.reset({}, 0) == "go\n"
        assert server.episodes == 1  # the client goes away without closing it
        client._drop()
        assert wait_for(lambda: server.episodes == 0)
        assert wait_for(lambda: module.CLOSED == ["same"])  # closed on its own thread and loop
        assert server.expired == 1


def test_shutting_the_server_down_closes_the_episodes_still_open():
    module = sys.modules[env_class(f"{RUNTIME_ENVS}:AsyncClient").__module__]
    module.CLOSED.clear()
    server = serve(env_class(f"{RUNTIME_ENVS}:AsyncClient"))
    try:
        for seed in range(3):
            RemoteEnv(server.url, timeout_s=5).reset({}, seed)
        assert server.episodes == 3
    finally:
        server.shutdown()
    assert module.CLOSED == ["same"] * 3


class Messages:
    """Observations as role-tagged messages, and an info dict, for the protocol to carry unchanged."""

    def reset(self, task, seed):
        return [{"role": "system", "content": "be brief"}, {"role": "user", "content": task["prompt"]}]

    def step(self, action):
        return Step([{"role": "tool", "name": "shout", "content": action.upper()}], reward=1.0, done=True,
                    info={"calls": [1, 2], "tool": {"name": "shout"}})


def test_observations_and_info_travel_as_the_json_they_are():
    with serve(Messages) as server:
        client = RemoteEnv(server.url, timeout_s=5)
        assert client.reset({"prompt": "hi"}, 0) == [{"role": "system", "content": "be brief"},
                                                      {"role": "user", "content": "hi"}]
        step = client.step("ok")
        assert step == Step([{"role": "tool", "name": "shout", "content": "OK"}], 1.0, True, False,
                            {"calls": [1, 2], "tool": {"name": "shout"}})
        client.close()
        assert server.episodes == 0


def test_a_step_for_an_episode_the_server_does_not_hold_is_an_error_naming_it():
    with serve(env_class(f"{ENVS}:Echo")) as server:
        client = RemoteEnv(server.url, timeout_s=5)
        client.episode_id = "nope"
        with pytest.raises(Exception, match=r"/step: no episode 'nope' on this server"):
            client.step("x")
        with urllib.request.urlopen(f"{server.url}/health", timeout=5) as answer:
            assert json.load(answer) == {"status": "healthy", "environment": "Echo", "episodes": 0}


def test_the_server_and_the_client_load_without_torch():
    code = ("import sys, tether.cli.main, tether.families.agent.serve, tether.families.agent.remote\n"
            "print(','.join(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == ""


def test_tether_env_serve_serves_from_a_subprocess_until_sigterm():
    command = [sys.executable, "-m", "tether.cli.main", "env", "serve", f"{ENVS}:Echo", "--port", "0"]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving Echo at http://127.0.0.1:"), line + proc.stderr.read()
        url = line.split(" at ")[1].split()[0]
        client = RemoteEnv(url, timeout_s=10)
        assert client.reset({"answer": "7"}, 0) == "go 7\n"
        steps = [client.step(a) for a in ("ab", "abc", "d")]
        assert [s.observation for s in steps] == ["o1:2\n", "o2:3\n", "o3:1\n"] and steps[-1].done
        with urllib.request.urlopen(f"{url}/state?episode_id={client.episode_id}", timeout=5) as answer:
            assert json.load(answer)["step_count"] == 3
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.poll() == 0
    with pytest.raises(Exception, match="ConnectionRefusedError"):
        RemoteEnv(url, timeout_s=5).reset({}, 0)


@pytest.mark.timeout(180)
def test_tether_train_plays_its_episodes_on_a_served_environment(tiny_model_dir, tmp_path):
    """Summarises (its returns vary with the actions, so updates commit), served here; the run (a
    subprocess) reaches it by env.kwargs.url."""
    with serve(env_class(f"{ENVS}:Summarises")) as server:
        run = tmp_path / "run"
        out = subprocess.run(
            [sys.executable, "-m", "tether.cli.main", "train", "model.family=agent", "data.task=kv_lookup",
             f"model.path={tiny_model_dir}", f"env.env_class={REMOTE}", f"env.kwargs={{url: '{server.url}'}}",
             "train.num_batches=2", "rollout.batch_size=2", "rollout.group_size=4", "eval.interval=0",
             "--run-dir", run, "--plain", "--no-report"],
            cwd=ROOT, capture_output=True, text=True, timeout=150)
        assert out.returncode == 0, out.stderr[-3000:]
        assert server.opened >= 2 * 2 * 4 and server.episodes == 0  # every episode closed again
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    assert all(m["agent/env_errors"] == 0 and m["agent/timeouts"] == 0 and m["agent/env_tokens_mean"] > 0
               for m in metrics)
