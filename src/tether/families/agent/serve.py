"""Serve any environment class over HTTP, the protocol ``remote.RemoteEnv`` speaks (its docstring
has it; ``tether env serve`` is the command).

Each episode is a fresh environment instance (built by ``env.factory``, so skyrl-gym and gymnasium
environments are adapted as they are locally), kept on the server from its ``/reset`` to its
``/close``. Its calls run the way the runtime runs them in a rollout worker: on one ``Lane`` of its
own (one thread, and one event loop for an async environment, for the episode's whole life), at
most ``workers`` calls at once. An episode no request has touched for ``idle_timeout_s`` is closed
and dropped, so a client that died leaks nothing. The server keeps no deadline of its own: the
client's (``env.step_timeout_s``) is the one that ends an episode."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tether.families.agent.env import ActionError, EnvFactory, as_step
from tether.families.agent.envthreads import EnvThreads, Lane
from tether.families.agent.remote import plain

MAX_BODY = 64 << 20
"""The largest request body read (64 MiB: a task row with its files)."""


class Refused(Exception):
    """A request the server answers with an error payload: ``status`` and ``kind``
    (``remote.PROTOCOL_ERRORS``)."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


@dataclass
class Served:
    """One episode on the server."""

    lane: Lane
    env: Any
    last: float = field(default_factory=time.monotonic)
    """When a request of the episode last began or ended."""
    steps: int = 0


def said(exc: BaseException) -> str:
    try:
        message = str(exc)
    except Exception:
        message = ""
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


class EnvServer:
    """An HTTP server playing episodes of ``make_env``'s environment; ``start`` serves on a thread
    of its own (``serve_forever`` in the caller's), ``shutdown`` stops it and closes every episode."""

    CLOSE_WAIT_S = 5.0
    """How long ``shutdown`` waits for the episodes' closes (one behind a hung call never comes)."""

    def __init__(self, make_env: EnvFactory, host: str = "127.0.0.1", port: int = 0, *, workers: int = 32,
                 idle_timeout_s: float = 600.0, log: bool = False) -> None:
        self.make_env = make_env
        self.name = make_env.name
        self.threads = EnvThreads(max(1, workers))
        self.idle_timeout_s = idle_timeout_s
        self.log = log
        self.opened = 0
        """Episodes reset since the start."""
        self.expired = 0
        """Episodes closed for having been idle past ``idle_timeout_s``."""
        self._episodes: dict[str, Served] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._serving: threading.Thread | None = None
        self.httpd = ThreadingHTTPServer((host, port), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.env_server = self  # type: ignore[attr-defined]
        self._reaper = threading.Thread(target=self._reap, name="tether-env-reaper", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def episodes(self) -> int:
        with self._lock:
            return len(self._episodes)

    def start(self) -> EnvServer:
        """Serve on a daemon thread; returns at once."""
        self._reaper.start()
        self._serving = threading.Thread(target=self.httpd.serve_forever, name="tether-env-server",
                                         daemon=True)
        self._serving.start()
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until ``KeyboardInterrupt`` (the caller then calls ``shutdown``)."""
        self._reaper.start()
        self.httpd.serve_forever()

    def shutdown(self) -> None:
        """Stop serving, close every episode's environment (waiting up to ``CLOSE_WAIT_S`` for
        them) and the socket."""
        self._stop.set()
        if self._serving is not None:
            self.httpd.shutdown()
            self._serving.join()
        self.httpd.server_close()
        with self._lock:
            episodes, self._episodes = list(self._episodes.values()), {}
        closing = [self._close(ep) for ep in episodes]
        deadline = time.monotonic() + self.CLOSE_WAIT_S
        for call in closing:
            with contextlib.suppress(BaseException):  # a close that fails or hangs is the environment's
                call.result(timeout=max(0.0, deadline - time.monotonic()))
        self.threads.close()

    def __enter__(self) -> EnvServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # -- the endpoints -----------------------------------------------------------------------------

    def reset(self, body: Mapping[str, Any]) -> dict[str, Any]:
        episode = _text(body, "episode_id")
        task, seed = body.get("task", {}), body.get("seed", 0)
        if not isinstance(task, dict) or isinstance(seed, bool) or not isinstance(seed, int):
            raise Refused(400, "bad_request", "/reset needs task (a JSON object) and seed (an integer)")
        with self._lock:
            if episode in self._episodes:
                raise Refused(409, "bad_request", f"episode {episode!r} is already running; reset it under "
                              "a new id")
        lane = self.threads.lane()
        try:
            env, obs = self._wait(lane.submit(lambda: self._open(task, seed)), "reset")
        except BaseException:
            lane.close()
            raise
        served = Served(lane, env)
        try:
            answer = _encoded({"episode_id": episode, "observation": obs}, f"{self.name}.reset")
        except Refused:
            self._close(served)
            raise
        with self._lock:
            self._episodes[episode] = served
            self.opened += 1
        return answer

    def step(self, body: Mapping[str, Any]) -> dict[str, Any]:
        served = self._episode(body)
        action = body.get("action")
        if not isinstance(action, str):
            raise Refused(400, "bad_request", f"/step needs action (text), not {type(action).__name__}")
        env = served.env
        try:
            step = self._wait(served.lane.submit(lambda: as_step(env.step(action))), "step")
        finally:
            served.steps += 1
            served.last = time.monotonic()
        answer = {"observation": step.observation, "reward": step.reward, "done": step.done,
                  "truncated": step.truncated, "info": dict(step.info), "new_context": step.new_context}
        return _encoded(answer, f"{self.name}.step")

    def close(self, body: Mapping[str, Any]) -> dict[str, Any]:
        episode = _text(body, "episode_id")
        with self._lock:
            served = self._episodes.pop(episode, None)
        if served is None:
            return {"closed": False}
        self._wait(self._close(served), "close")
        return {"closed": True}

    def state(self, query: Mapping[str, Any]) -> dict[str, Any]:
        served = self._episode(query)
        return {"episode_id": query["episode_id"], "step_count": served.steps}

    def health(self) -> dict[str, Any]:
        return {"status": "healthy", "environment": self.name, "episodes": self.episodes}

    # -- episodes --------------------------------------------------------------------------------

    def _open(self, task: dict, seed: int) -> tuple[Any, Any]:
        """A fresh environment and its first observation (on the episode's lane); an environment
        whose reset raised is closed."""
        env = self.make_env()
        try:
            return env, env.reset(task, seed)
        except BaseException:
            with contextlib.suppress(Exception):  # the reset's error is the one to report
                env.close()
            raise

    def _episode(self, body: Mapping[str, Any]) -> Served:
        episode = _text(body, "episode_id")
        with self._lock:
            served = self._episodes.get(episode)
        if served is None:
            raise Refused(404, "unknown_episode", f"no episode {episode!r} on this server: never reset, "
                          f"closed, or idle past idle_timeout_s={self.idle_timeout_s:g} and closed")
        served.last = time.monotonic()
        return served

    def _wait(self, call: Any, kind: str) -> Any:
        """The call's result; what the environment raised as an error payload (an ``ActionError`` as
        ``action_error``, so the client raises it again and the episode goes on)."""
        try:
            return call.result()
        except ActionError as exc:
            if kind == "reset":
                raise Refused(500, "environment_error", f"{self.name}.reset raised {said(exc)}") from None
            raise Refused(422, "action_error", str(exc)) from None
        except BaseException as exc:
            raise Refused(500, "environment_error", f"{self.name}.{kind} raised {said(exc)}") from None

    def _close(self, served: Served) -> Any:
        """Close ``served``'s environment on its lane, then the lane (the call's future)."""
        call = served.lane.submit(served.env.close)
        served.lane.close()
        return call

    def _reap(self) -> None:
        """Close episodes idle past ``idle_timeout_s`` (a client that died without closing them)."""
        every = min(5.0, max(0.05, self.idle_timeout_s / 4))
        while not self._stop.wait(every):
            now = time.monotonic()
            with self._lock:
                idle = [k for k, s in self._episodes.items() if now - s.last > self.idle_timeout_s]
                dropped = [self._episodes.pop(k) for k in idle]
            for served in dropped:
                self._close(served)
                self.expired += 1
                if self.log:
                    print(f"tether env serve: closed an episode idle for more than {self.idle_timeout_s:g} s",
                          file=sys.stderr, flush=True)


def _text(body: Mapping[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise Refused(400, "bad_request", f"the request needs {key} (non-empty text)")
    return value


def _encoded(payload: dict[str, Any], what: str) -> dict[str, Any]:
    """``payload`` when JSON can carry it, else an ``environment_error`` naming ``what``."""
    try:
        json.dumps(payload, default=plain)
    except (TypeError, ValueError) as exc:
        raise Refused(500, "environment_error", f"{what} returned what JSON cannot carry ({exc})") from None
    return payload


class _Handler(BaseHTTPRequestHandler):
    """One connection (keep-alive: a client's episode uses one) of ``EnvServer``."""

    protocol_version = "HTTP/1.1"
    server_version = "tether-env"
    disable_nagle_algorithm = True
    """Headers and body go out in two writes: with Nagle's algorithm the body would wait for the
    client's delayed ACK (40 ms a call on Linux)."""

    def setup(self) -> None:
        self.timeout = self.server.env_server.idle_timeout_s  # a dead client's connection is dropped
        super().setup()

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        env_server = self.server.env_server
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        routes = {"/health": lambda: env_server.health(), "/state": lambda: env_server.state(query)}
        self._answer(routes.get(parts.path.rstrip("/") or "/"), "GET /health, GET /state")

    def do_POST(self) -> None:
        env_server = self.server.env_server
        routes = {"/reset": env_server.reset, "/step": env_server.step, "/close": env_server.close}
        route = routes.get(urlsplit(self.path).path.rstrip("/"))
        try:
            body = self._body()
        except Refused as exc:
            self._send(exc.status, {"error": {"type": exc.kind, "message": str(exc)}})
            return
        self._answer(None if route is None else lambda: route(body), "POST /reset, /step, /close")

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self.close_connection = True
            raise Refused(413, "bad_request", f"a request body of {length:,} bytes; at most {MAX_BODY:,}")
        raw = self.rfile.read(length) if length else b"{}"
        try:
            body = json.loads(raw)
        except ValueError:
            raise Refused(400, "bad_request", "the request body is not JSON") from None
        if not isinstance(body, dict):
            raise Refused(400, "bad_request", "the request body is not a JSON object")
        return body

    def _answer(self, route: Any, valid: str) -> None:
        if route is None:
            self._send(404, {"error": {"type": "bad_request", "message": f"no endpoint {self.command} "
                                       f"{self.path}; valid: {valid}"}})
            return
        try:
            self._send(200, route())
        except Refused as exc:
            self._send(exc.status, {"error": {"type": exc.kind, "message": str(exc)}})

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload, default=plain).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.env_server.log:
            super().log_message(format, *args)


def serve(make_env: EnvFactory | type, host: str = "127.0.0.1", port: int = 0, *,
          kwargs: Mapping[str, Any] | None = None, env_config: Mapping[str, Any] | None = None,
          workers: int = 32, idle_timeout_s: float = 600.0, log: bool = False) -> EnvServer:
    """A started ``EnvServer`` for an environment class (built with ``kwargs``, or skyrl-gym's
    ``env_config``) or a ready ``EnvFactory``; ``port=0`` picks a free port (``server.url``).
    Stop it with ``shutdown()`` (or use it as a context manager)."""
    if not isinstance(make_env, EnvFactory):
        from tether.families.agent.env import factory

        make_env = factory(make_env, kwargs or {}, env_config=env_config)
    return EnvServer(make_env, host, port, workers=workers, idle_timeout_s=idle_timeout_s, log=log).start()


__all__ = ["EnvServer", "serve"]
