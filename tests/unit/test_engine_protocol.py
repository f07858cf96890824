"""The engine protocol declares every member Tether calls: what the rollout worker and the token
families use of an engine or a sampler is in ``tether.vocabulary``'s ``TokenEngine`` / ``Sampler``,
the built-in engines have all of it, and nothing probes a plug-in for a member (``hasattr``)."""

import ast
import inspect
from pathlib import Path

import pytest

from tether.vocabulary import Engine, Sampler, TokenEngine

SRC = Path(__file__).resolve().parents[2] / "src" / "tether"
# where the engine of a token family and the family's sampler are driven (a step family's own
# engine is its own type: flow's FlowEngine)
CALLERS = ("rollout/worker.py", "families/text/sampler.py", "families/agent/sampler.py",
           "families/agent/episodes.py")
PROBES = ("rollout", "families/text", "families/agent", "runtime/assemble.py")


def declared(protocol: type) -> set[str]:
    return {name for cls in protocol.__mro__ if cls not in (object,)
            for name in [*vars(cls), *getattr(cls, "__annotations__", {})] if not name.startswith("_")}


def used(path: Path, holder: str) -> dict[str, int]:
    """``member → line`` of each ``<x>.<holder>.<member>`` or ``<holder>.<member>`` in ``path``."""
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            v = node.value
            if (v.attr if isinstance(v, ast.Attribute) else getattr(v, "id", None)) == holder:
                out.setdefault(node.attr, node.lineno)
    return out


@pytest.mark.parametrize("caller", CALLERS)
def test_what_the_worker_and_the_token_families_call_is_declared(caller):
    path = SRC / caller
    pairs = (("engine", TokenEngine), ("sampler", Sampler))
    missing = {f"{holder}.{m} (line {n})" for holder, protocol in pairs
               for m, n in used(path, holder).items() if m not in declared(protocol)}
    assert not missing, f"{caller} calls members the protocol does not declare: {sorted(missing)}"


def test_the_engine_protocol_covers_in_flight_switches_and_adapters():
    assert {"watch", "take_up", "holding", "use_adapter", "bind", "load_weights", "close"} <= declared(Engine)
    assert {"generate", "take_counts", "report"} <= declared(TokenEngine)
    assert "close" in declared(Sampler)


def test_the_built_in_engines_have_every_member_declared():
    from tether.families.flow.rollout import FlowEngine
    from tether.rollout.engines.torch.engine import TorchEngine
    from tether.rollout.engines.vllm.engine import VLLMEngine  # imports vLLM only when one is built

    for engine, protocol in ((TorchEngine, TokenEngine), (VLLMEngine, TokenEngine), (FlowEngine, Engine)):
        absent = sorted(m for m in declared(protocol) if not hasattr(engine, m) and m not in
                        inspect.signature(engine.__init__).parameters)
        assert absent == [], f"{engine.__name__} lacks {absent}"


def test_nothing_probes_an_engine_or_sampler_for_a_member():
    probes = []
    for target in PROBES:
        for path in ([SRC / target] if target.endswith(".py") else sorted((SRC / target).rglob("*.py"))):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id in ("hasattr", "getattr") and node.args):
                    text = ast.unparse(node.args[0])
                    if text in ("self.engine", "self.sampler", "sampler.engine"):  # a plug-in's
                        probes.append(f"{path.relative_to(SRC)}:{node.lineno}: {ast.unparse(node)}")
    assert probes == []
