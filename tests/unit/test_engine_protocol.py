"""The engine protocol declares every member Tether calls: what the rollout worker and the token
families use of an engine or a sampler is in ``tether.vocabulary``'s ``TokenEngine`` / ``Sampler``,
the built-in engines have all of it, and nothing in Tether probes a plug-in for a member
(``hasattr``, ``getattr``): optional members are declared with a default."""

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


# Where Tether may ask whether an object has a member: only of objects it cannot declare anything
# on, read the way their own library defines them. A plug-in's members (an engine, a sampler, a
# payload, a training batch, a policy, a family, a task, a scorer) are declared instead: a protocol
# member, with a default in its base class where it is optional (``FamilyBase``, ``PolicyBase``).
# path → (member names, why)
TRANSFORMERS = "transformers' models, configs, tokenizers and outputs differ by architecture and version"
ALLOWED_PROBES: dict[str, tuple[frozenset[str], str]] = {
    "decoding/fast_decoder.py": (frozenset({"config", "model", "rope_parameters", "rope_scaling",
                                            "rotary_emb", "layers", "q_norm", "model_type",
                                            "use_sliding_window", "mlp_bias", "hidden_act", "head_dim"}),
                                 TRANSFORMERS),
    "decoding/native/__init__.py": (frozenset({"q_norm"}), TRANSFORMERS),
    "decoding/sampling.py": (frozenset({"cache"}), TRANSFORMERS),
    "data/datasets.py": (frozenset({"chat_template", "unk_token_id"}), TRANSFORMERS),
    "data/gguf_import.py": (frozenset({"quantization_config"}), TRANSFORMERS + " (a config read from GGUF)"),
    "families/agent/chat.py": (frozenset({"chat_template"}), TRANSFORMERS),
    "families/text/policy.py": (frozenset({"model_type"}), TRANSFORMERS),
    "rollout/engines/torch/engine.py": (frozenset({"max_position_embeddings"}), TRANSFORMERS),
    "adapters.py": (frozenset({"get_output_embeddings"}), TRANSFORMERS),
    "modeling.py": (frozenset({"key"}), TRANSFORMERS + " (the dropout settings a config has)"),
    "decoding/linear.py": (frozenset({"base_layer"}), "PEFT wraps a LoRA layer's base layer"),
    "families/flow/pipeline.py": (frozenset({"encode_prompt"}), "a diffusers pipeline class"),
    "rollout/engines/vllm/engine.py": (frozenset({"llm_engine", "engine_core", "shutdown"}),
                                       "vLLM's internals differ by version"),
    "train/attribution.py": (frozenset({"to_local"}), "an FSDP2 parameter is a DTensor, else a tensor"),
    "train/learner.py": (frozenset({"full_tensor"}), "an FSDP2 gradient norm is a DTensor"),
    "runtime/checkpoint.py": (frozenset({"errno"}), "an OSError has one, other write failures not"),
    "cli/main.py": (frozenset({"func", "args", "__notes__"}),
                    "argparse sets a subcommand's own attributes; an exception's notes (PEP 678)"),
    # a user's function, class or module, read as Python defines them
    "api.py": (frozenset({"__file__", "__module__", "__qualname__"}), "where a user's object is defined"),
    "registry.py": (frozenset({"__file__"}), "the script that runs (``__main__``) may have no file"),
    "families/agent/tools.py": (frozenset({"__name__"}), "a tool is any callable; a partial or an "
                                "instance with __call__ has no name (refused, naming it)"),
    "config/keys.py": (frozenset({"RESUME"}), "a section is a plain dataclass of knobs its plug-in writes; "
                       "its optional ``RESUME`` class variable has no base class to default it"),
    "train/losses.py": (frozenset({"__code__"}), "a user's loss may be any callable"),
    "data/rewards.py": (frozenset({"tether_batched", "shape", "item"}),
                        "``tether.batched`` marks a user's function (a function has no declared "
                        "defaults); a reward may be a NumPy or torch scalar"),
    "families/agent/env.py": (frozenset({"init", "step", "reset", "close", "__qualname__", "shape", "item",
                                         "check_kwargs"}),
                              "the adapters that turn a user's environment class (Tether's protocol, "
                              "gymnasium's or skyrl-gym's, close optional, check_kwargs optional) into the "
                              "declared Environment; a step reward may be a NumPy or torch scalar"),
    "families/agent/remote.py": (frozenset({"tolist"}), "what an environment returns may hold NumPy "
                                 "values, sent as the JSON of their lists"),
}


def probes(root: Path = SRC) -> list[str]:
    """Every ``hasattr(x, name)``, and ``getattr(x, "member", ...)`` with a literal name, under ``root``
    and outside ``ALLOWED_PROBES`` (by the literal name, or a computed name's expression). A
    ``getattr`` with a computed name is a lookup by a name read from data (a registry, a recipe's
    ``file.py:function``, a method named in a message), not a probe."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        allowed = ALLOWED_PROBES.get(rel, (frozenset(), ""))[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("hasattr", "getattr") and len(node.args) >= 2):
                continue
            arg = node.args[1]
            literal = isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            member = arg.value if literal else ast.unparse(arg)
            if (node.func.id == "hasattr" or literal) and member not in allowed:
                out.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_nothing_probes_a_plug_in_for_a_member():
    found = probes()
    assert found == [], ("declare the member (a protocol member with a default in the base class, or a "
                         f"flag) instead of probing for it, or allow it in ALLOWED_PROBES with why: {found}")


def test_the_probe_check_sees_a_probe(tmp_path):
    (tmp_path / "recorder.py").write_text(
        "def lines(payload, batch, score, name):\n"
        "    of = getattr(payload, 'sample_lines', None)\n"
        "    return hasattr(score, name) and getattr(batch, 'episode') and getattr(batch, name)\n")
    assert probes(tmp_path) == ["recorder.py:2: getattr(payload, 'sample_lines', None)",
                                "recorder.py:3: hasattr(score, name)",
                                "recorder.py:3: getattr(batch, 'episode')"]


def test_a_policy_base_writes_and_reads_a_transformers_model_folder(tiny_model_dir, tmp_path):
    """``PolicyBase``'s checkpoint folder, which every policy has unless it declares its own layout
    (the learner asks the policy, never whether it has one)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tether.families.base import PolicyBase
    from tether.families.text.policy import TextPolicy

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    weights = {name: p.detach() for name, p in model.named_parameters()}
    policy = TextPolicy(temperature=1.0)
    assert isinstance(policy, PolicyBase)
    policy.write_folder(model, tmp_path / "whole", weights)
    back = policy.read_weights(tmp_path / "whole")
    assert back.keys() == weights.keys() and all(torch.equal(back[n], weights[n]) for n in weights)
    policy.write_folder(model, tmp_path / "sharded", None)  # the shards are elsewhere: the config alone
    assert sorted(p.name for p in (tmp_path / "sharded").iterdir()) == ["config.json"]


def test_every_scorer_reports_its_parts():
    from tether.data.rewards import Scorer, WeightedScorer
    from tether.vocabulary import Example

    one, two = Scorer(lambda p, c, a, f: 1.0, "one"), Scorer(lambda p, c, a, f: 0.0, "two")
    both = WeightedScorer([one, two], [0.5, 0.5])
    ex = Example("p", "a")
    assert one(ex, "c") == 1.0 and one.take_parts() == {}  # a single function has no parts
    assert both(ex, "c") == 0.5
    assert both.take_parts() == {"reward/part_0_mean": 1.0, "reward/part_1_mean": 0.0}
