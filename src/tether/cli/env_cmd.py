"""``tether env serve``: serve an environment class over HTTP for ``RemoteEnv`` (docs/agents.md,
Remote environments)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any

from tether.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="serve an agent environment over HTTP")
    what = p.add_subparsers(dest="what", metavar="WHAT", required=True)
    serve = what.add_parser(
        "serve", help="serve an environment class over HTTP (one fresh instance per episode) for "
        "env.env_class: tether.families.agent.remote:RemoteEnv",
        description="Serve ENV_CLASS over HTTP until Ctrl-C or SIGTERM: POST /reset, /step, /close, GET "
        "/health, /state, one fresh instance per episode (docs/agents.md, Remote environments). Prints "
        "the address to give as env.kwargs.url.")
    serve.add_argument("env_class", metavar="ENV_CLASS", help="path/to/file.py:Class or package.module:Class")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (0: a free one, printed)")
    serve.add_argument("--kwargs", default="{}", metavar="JSON", help="the constructor's keyword arguments")
    serve.add_argument("--env-config", default="{}", metavar="JSON",
                       help="a skyrl-gym environment's env_config")
    serve.add_argument("--workers", type=int, default=32, help="environment calls run at once")
    serve.add_argument("--idle-timeout-s", type=float, default=600.0,
                       help="close an episode no request has touched for this long (a client that died)")
    serve.add_argument("--log", action="store_true", help="log every request to stderr")
    serve.set_defaults(func=_serve)


def _json_object(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{flag} {text!r} is not JSON ({exc}); give an object, "
                          "e.g. '{\"size\": 3}'") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object (keyword arguments), not {type(value).__name__}")
    return value


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _serve(ns: argparse.Namespace) -> int:
    from tether.families.agent.env import factory
    from tether.families.agent.serve import EnvServer
    from tether.pyload import load_python_object

    if ns.workers < 1 or not 0 <= ns.port <= 65535 or not ns.idle_timeout_s > 0:
        raise ConfigError("--workers must be 1 or more, --port 0 to 65535 and --idle-timeout-s above 0")
    env_class = load_python_object(ns.env_class, what="environment")
    made = factory(env_class, _json_object(ns.kwargs, "--kwargs"),
                   env_config=_json_object(ns.env_config, "--env-config"))
    try:
        server = EnvServer(made, ns.host, ns.port, workers=ns.workers, idle_timeout_s=ns.idle_timeout_s,
                           log=ns.log)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {ns.host}:{ns.port}: {exc}") from None
    signal.signal(signal.SIGTERM, _interrupt)  # a stop from a supervisor closes the episodes as Ctrl-C does
    print(f"serving {made.name} at {server.url} (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
    print("stopped", file=sys.stderr, flush=True)
    return 0
