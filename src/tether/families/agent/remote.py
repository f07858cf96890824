"""An environment served over HTTP: ``RemoteEnv`` is the client the agent family builds per episode
(``env.env_class: tether.families.agent.remote:RemoteEnv``, ``env.kwargs: {url: ...}``);
``tether.families.agent.serve`` serves any environment class this way (``tether env serve``).

The protocol is JSON over HTTP/1.1, one connection per episode, modelled on OpenEnv's
``/reset``, ``/step``, ``/state``, ``/health`` with an episode id added, so that one server plays
many episodes at once, each on a fresh environment instance of its own::

    POST /reset {"episode_id": "9f2c...", "task": {...row...}, "seed": 3}
         200    {"episode_id": "9f2c...", "observation": <JSON>}
    POST /step  {"episode_id": "9f2c...", "action": "the model's turn"}
         200    {"observation": <JSON>, "reward": 0.25, "done": false, "truncated": false,
                 "info": {...}, "new_context": false}
    POST /close {"episode_id": "9f2c..."}
         200    {"closed": true}
    GET  /state?episode_id=9f2c...   200 {"episode_id": "9f2c...", "step_count": 2}
    GET  /health                     200 {"status": "healthy", "environment": "Echo", "episodes": 3}

    anything else: 4xx/5xx {"error": {"type": "action_error" | "environment_error" |
                                       "unknown_episode" | "bad_request", "message": "..."}}

The client picks the episode id (a random UUID), so it can close an episode whose reset it gave up
on. Observations and ``info`` travel as the JSON they are (text, a message dict, a list of them),
unchanged; a missing or null ``reward`` is 0 (OpenEnv's ``reward`` may be null). An
``action_error`` comes back as ``ActionError`` (the episode goes on); every other failure, a server
that cannot be reached, that answers what is not this protocol, or whose environment raised, is a
``RemoteError`` naming the URL, which ends the episode as ``error``. Nothing is retried: a step is
not idempotent, and a server that restarted has lost the episode anyway. A server that does not
answer within ``timeout_s`` frees the call's thread; the episode's deadline is the runtime's
(``env.step_timeout_s``), so keep ``timeout_s`` at or above it for a hung server to end the episode
as ``timeout``.
"""

from __future__ import annotations

import http.client
import json
import math
import uuid
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from tether.families.agent.env import ActionError, Step

PROTOCOL_ERRORS = ("action_error", "environment_error", "unknown_episode", "bad_request")
"""The ``error.type`` values a server answers with."""


class RemoteError(Exception):
    """The environment server could not be reached, answered outside the protocol, or its
    environment raised; ends the episode as ``error``."""


def plain(value: Any) -> Any:
    """``json.dumps``' ``default``: NumPy scalars and arrays as the numbers and lists they hold, any
    other mapping as a dict; anything else is not JSON (``TypeError``)."""
    if hasattr(value, "tolist") and type(value).__module__ == "numpy":
        return value.tolist()
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, (tuple, set, frozenset)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def shown(raw: bytes | str, limit: int = 120) -> str:
    """The start of an answer, for an error message."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text):,} characters)"


def check_url(url: Any) -> tuple[str, str, int, str]:
    """(scheme, host, port, path prefix) of ``url``, or ``ValueError`` saying what is wrong."""
    if not isinstance(url, str) or not url:
        raise ValueError("url is missing: set env.kwargs.url to the environment server's address, e.g. "
                         "http://127.0.0.1:8000 (tether env serve prints it)")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url {url!r} is not an http:// or https:// address with a host, e.g. "
                         "http://127.0.0.1:8000")
    if parts.query or parts.fragment or parts.username:
        raise ValueError(f"url {url!r} may hold a host, a port and a path, not a query, fragment or user")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:  # a port out of range or not a number
        raise ValueError(f"url {url!r} has a bad port ({exc})") from None
    return parts.scheme, parts.hostname, port, parts.path.rstrip("/")


class RemoteEnv:
    """One episode of an environment on a server (the module docstring has the protocol).

    ``url``: the server, e.g. ``http://127.0.0.1:8000``; ``timeout_s``: how long one request may
    wait for its answer (connecting included); ``headers``: sent with every request (a token)."""

    def __init__(self, url: str = "", timeout_s: float = 60.0,
                 headers: Mapping[str, str] | None = None) -> None:
        self.check_kwargs({"url": url, "timeout_s": timeout_s, "headers": headers or {}})
        self.scheme, self.host, self.port, self.prefix = check_url(url)
        self.url = url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.headers = {"Content-Type": "application/json", **dict(headers or {})}
        self.episode_id: str | None = None
        self._conn: http.client.HTTPConnection | None = None

    @staticmethod
    def check_kwargs(kwargs: Mapping[str, Any]) -> None:
        """Refuse (``ValueError``) ``env.kwargs`` this client cannot use, when the recipe loads."""
        unknown = sorted(set(kwargs) - {"url", "timeout_s", "headers"})
        if unknown:
            raise ValueError(f"unknown key {', '.join(map(repr, unknown))}; valid: url, timeout_s, headers")
        check_url(kwargs.get("url", ""))
        timeout = kwargs.get("timeout_s", 60.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
                math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"timeout_s={timeout!r} must be a number of seconds above 0")
        headers = kwargs.get("headers", {})
        if not isinstance(headers, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
            raise ValueError(f"headers={headers!r} must map header names to text")

    def reset(self, task: Mapping[str, Any], seed: int) -> Any:
        self.episode_id = uuid.uuid4().hex
        out = self._post("/reset", {"episode_id": self.episode_id, "task": dict(task), "seed": seed})
        return self._field(out, "/reset", "observation")

    def step(self, action: str) -> Step:
        out = self._post("/step", {"episode_id": self.episode_id, "action": action})
        reward = out.get("reward")
        return Step(self._field(out, "/step", "observation"), 0.0 if reward is None else reward,
                    out.get("done", False), out.get("truncated", False), out.get("info") or {},
                    out.get("new_context", False))

    def close(self) -> None:
        """End the episode on the server (its environment closed there); the connection goes."""
        episode, self.episode_id = self.episode_id, None
        try:
            if episode is not None:
                self._post("/close", {"episode_id": episode})
        finally:
            self._drop()

    # -- requests --------------------------------------------------------------------------------

    def _post(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        try:
            data = json.dumps(body, default=plain).encode()
        except (TypeError, ValueError) as exc:
            raise RemoteError(f"{path} to {self.url}: the request is not JSON ({exc})") from None
        if self._conn is None:
            kind = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
            self._conn = kind(self.host, self.port, timeout=self.timeout_s)
        try:
            self._conn.request("POST", self.prefix + path, body=data, headers=self.headers)
            response = self._conn.getresponse()
            raw = response.read()
        except TimeoutError:
            self._drop()
            raise RemoteError(f"{self.url}{path} did not answer within "
                              f"timeout_s={self.timeout_s:g}") from None
        except (OSError, http.client.HTTPException) as exc:
            self._drop()
            raise RemoteError(f"cannot reach the environment server at {self.url} ({path}): "
                              f"{type(exc).__name__}: {exc}") from None
        return self._answer(path, response.status, raw)

    def _answer(self, path: str, status: int, raw: bytes) -> dict[str, Any]:
        """The JSON object a 2xx answer holds; an error answer raised as ``ActionError`` (the
        server's ``action_error``) or ``RemoteError``."""
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = None
        if 200 <= status < 300:
            if not isinstance(payload, dict):
                raise RemoteError(f"{self.url}{path} answered HTTP {status} with what is not a JSON object: "
                                  f"{shown(raw)}; is it an environment server (tether env serve)?")
            return payload
        error = payload.get("error") if isinstance(payload, dict) else None
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            if error.get("type") == "action_error":
                raise ActionError(error["message"])
            raise RemoteError(f"{self.url}{path}: {error['message']}")
        if isinstance(payload, dict) and isinstance(payload.get("detail"), str):  # FastAPI (OpenEnv) errors
            raise RemoteError(f"{self.url}{path} answered HTTP {status}: {payload['detail']}")
        raise RemoteError(f"{self.url}{path} answered HTTP {status}: {shown(raw)}")

    def _field(self, out: dict[str, Any], path: str, name: str) -> Any:
        if name not in out:
            raise RemoteError(f"{self.url}{path} answered without {name!r}: {shown(json.dumps(out))}; is it "
                              "an environment server (tether env serve)?")
        return out[name]

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


__all__ = ["RemoteEnv", "RemoteError", "check_url"]
