"""One table per key (``tether.config.keys``): every key of every section, plug-in sections
included, has one owner and one resume class; the resume rules, the ownership and feature checks
and the guide's table of what a resume may change are what the table says."""

import dataclasses
import re
from pathlib import Path

import pytest

import tether
from tether import registry
from tether.config import load_config
from tether.config.config import plugin_section_classes
from tether.config.features import FEATURES
from tether.config.fields import OWNER_KINDS, Resume, knob, section_fields
from tether.config.keys import disagreements, resume_of, table
from tether.config.schema import SECTIONS
from tether.errors import ConfigError
from tether.runtime.rundir import resume_changes

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide.md"


@dataclasses.dataclass(frozen=True)
class CoinSection:
    """A test family's own knobs."""

    sides: int = knob(2, "Sides of the coin.", min=2)
    label: str = knob("", "A name for the log only.", resume=Resume.ACCEPTED)


class Coin(tether.FamilyBase):
    name = "coin_keys"
    section = ("coin_keys", CoinSection)
    keys = ("reward.function", "plan.turns")  # shared keys it reads too


@pytest.fixture
def coin():
    registry.register_family(Coin())
    try:
        yield
    finally:
        registry.families.unregister("coin_keys")


def _every_section() -> dict[str, type]:
    return {**SECTIONS, **plugin_section_classes()}


def test_every_key_of_every_section_has_one_owner_and_one_resume_class(coin):
    keys = table()
    expected = {f"{section}.{name}" for section, cls in _every_section().items()
                for name in section_fields(cls)}
    assert set(keys) == expected  # plug-in sections included: flow, env, vllm, ray, coin_keys
    for entry in keys.values():
        assert entry.owner in OWNER_KINDS, entry
        assert isinstance(entry.resume, Resume), entry
        assert entry.help, entry
        assert (entry.owner == "core") == (not entry.readers), entry  # a plug-in's key names who reads it
    assert disagreements(keys) == []
    # a plug-in's own section is its own; a shared key it names is read by it and the others naming it
    assert keys["coin_keys.sides"].readers == ("coin_keys",)
    assert keys["coin_keys.sides"].resume is Resume.TRAINING  # undeclared: refused
    assert keys["coin_keys.label"].resume is Resume.ACCEPTED  # as its knob declares
    assert set(keys["reward.function"].readers) == {"text", "flow", "coin_keys"}
    assert set(keys["plan.turns"].readers) == {"agent", "coin_keys"}


def test_a_key_claimed_against_its_declaration_is_a_disagreement(coin):
    class Greedy(tether.FamilyBase):
        name = "greedy_keys"
        keys = ("train.lr", "rollout.decoder")  # a core key, and the torch engine's

    registry.register_family(Greedy())
    try:
        problems = disagreements()
    finally:
        registry.families.unregister("greedy_keys")
    assert any(p.startswith("train.lr: its knob says owner='core'") for p in problems), problems
    assert any(p.startswith("rollout.decoder is claimed by plug-ins of more than one kind") for p in problems)


# The resume rules as runtime/rundir.py kept them before they were declared per key: the table must
# decide every key as they did.
_SAFE = ("train.num_batches", "train.threads", "train.device", "train.world_size",
         "rollout.threads_per_worker", "rollout.num_workers", "rollout.backend", "rollout.engine",
         "rollout.decoder", "vllm.", "ray.",
         "eval.", "checkpoint.", "plan.", "run.wandb_project", "async.wait_timeout_s",
         "async.max_consecutive_drops", "warmstart.", "metrics.")
_HELD_OUT = ("data.num_eval", "data.eval_dataset")
_DATA_ORDER = ("run.seed", "rollout.batch_size", "data.")
_SCHEDULE = ("async.max_staleness", "async.max_inflight", "async.on_stale", "async.sync_when_idle",
             "async.inflight_update", "train.updates_per_batch")


def _formerly(key: str) -> Resume:
    def matches(prefixes):
        return any(key == p or (p.endswith(".") and key.startswith(p)) for p in prefixes)

    for prefixes, resume in ((_SAFE, Resume.ACCEPTED), (_HELD_OUT, Resume.HELD_OUT),
                             (_DATA_ORDER, Resume.PROMPTS), (_SCHEDULE, Resume.SCHEDULE)):
        if matches(prefixes):
            return resume
    return Resume.TRAINING


# Decided otherwise since the prefix lists: a resume may switch how the built-in engine applies
# adapters (it samples the same distribution), as it may switch the decoder; the lists refused it,
# though they dropped it when a resume moved to vLLM. Micro-batching (a count or a token budget),
# precision and recomputation change memory and time, not the update (to rounding), so a resume may
# change them, e.g. after running out of memory.
_SINCE = {"rollout.lora_apply": Resume.ACCEPTED, "rollout.dtype": Resume.ACCEPTED,
          "train.dtype": Resume.ACCEPTED, "train.reduce_dtype": Resume.ACCEPTED,
          "train.activation_checkpointing": Resume.ACCEPTED,
          "train.max_tokens_per_micro_batch": Resume.ACCEPTED, "train.micro_batch_size": Resume.ACCEPTED,
          "train.cpu_offload": Resume.ACCEPTED, "rollout.on_worker_loss": Resume.ACCEPTED,
          "rollout.max_worker_restarts": Resume.ACCEPTED}
_SINCE["eval.seed"] = Resume.HELD_OUT  # it draws what the evaluations measure, unlike eval.*'s others
_SINCE.update(dict.fromkeys(  # how weights travel, not what they are
    ("rollout.weight_sync", "rollout.weight_sync_timeout_s", "rollout.weight_sync_port"), Resume.ACCEPTED))


def test_the_resume_rules_decide_every_key_as_before():
    keys = table()
    assert {k: e.resume for k, e in keys.items()} == {k: _SINCE.get(k) or _formerly(k) for k in keys}
    assert resume_of("vllm.a_key_of_another_version") is Resume.ACCEPTED  # its section's rule
    assert resume_of("data.a_key_of_another_version") is Resume.PROMPTS
    assert resume_of("nosuch.key") is Resume.TRAINING


def test_resume_changes_follow_the_declarations():
    def cfg(*overrides):
        return load_config(None, ["data.task=arithmetic", *overrides]).to_dict()

    for key, value in (("train.world_size", 2), ("rollout.decoder", "python"), ("plan.turns", 2.0)):
        assert resume_changes(cfg(), {**cfg(), key.split(".")[0]: {**cfg()[key.split(".")[0]],
                                                                    key.split(".")[1]: value}}).refused == []
    changes = resume_changes(cfg(), cfg("rollout.lora_apply=terms", "train.lora_rank=2"))
    assert [c.split(":")[0] for c, _ in changes.refused] == ["train.lora_rank"]
    assert [c.split(":")[0] for c in changes.safe] == ["rollout.lora_apply"]


# docs/guide.md §6, "What a resume may change": the keys each row names, by the class it gives them.
_ROWS = {"accepted, logged": Resume.ACCEPTED, "refused: it changes which prompts": Resume.PROMPTS,
         "refused: it changes the held-out set": Resume.HELD_OUT,
         "refused: it changes the staleness schedule": Resume.SCHEDULE}
NOT_YET_IN_GUIDE: set[str] = set()
"""Accepted keys the guide's first row does not name yet (none: a key added without its row fails)."""


def _guide_rows() -> dict[Resume, list[str]]:
    text = GUIDE.read_text()
    table_text = text[text.index("What a resume may change."):]
    rows: dict[Resume, list[str]] = {}
    for line in table_text.splitlines()[5:]:  # the rows, after the header and its rule
        if not line.startswith("| "):
            break
        change, verdict = line.strip("|").rsplit(" | ", 1)
        for start, resume in _ROWS.items():
            if verdict.strip().startswith(start):  # the keys it names, not those in its asides
                rows[resume] = re.findall(r"`([a-z_]+\.(?:[a-z_]+|\*))`", re.sub(r"\([^)]*\)", "", change))
    return rows


def test_the_guide_s_table_of_what_a_resume_may_change_agrees_with_the_key_table():
    keys = table()
    rows = _guide_rows()
    assert set(rows) == set(_ROWS.values())
    exact = {p for patterns in rows.values() for p in patterns if not p.endswith(".*")}
    named: set[str] = set()
    for resume, patterns in rows.items():
        for pattern in patterns:  # a key named itself in one row is not in another row's section.*
            matched = [k for k in keys if k == pattern
                       or (pattern.endswith(".*") and k.startswith(pattern[:-1]) and k not in exact)]
            assert matched, f"the guide names {pattern}, which no section has"
            wrong = [k for k in matched if keys[k].resume is not resume]
            assert not wrong, f"the guide says {pattern} is {resume.name}; the table disagrees for {wrong}"
            named.update(matched)
    accepted = {k for k, e in keys.items() if e.resume is Resume.ACCEPTED}
    assert accepted - named == NOT_YET_IN_GUIDE  # when the guide names them, empty NOT_YET_IN_GUIDE


class _Recipe:
    """Sections by name, as ``Config.section`` gives them (unchecked: any value away from the default)."""

    def __init__(self, sections):
        self.sections = sections

    def section(self, name):
        return self.sections[name]


def test_the_feature_checks_are_the_keys_that_declare_a_feature():
    keys = table()
    sections = _every_section()
    default = load_config(None, ["data.task=arithmetic"])
    for feature in FEATURES:
        declaring = [k for k, e in keys.items() if e.feature == feature.name]
        assert declaring, feature.name
        assert feature.asked(default) is None
        for key in declaring:  # each one set away from its default asks for the feature, by name
            section, name = key.split(".")
            value = getattr(sections[section](), name)
            other = (not value if isinstance(value, bool) else value / 2 if isinstance(value, float)
                     else value + 1 if isinstance(value, int) else value + "x")
            changed = {n: cls() for n, cls in sections.items()}
            changed[section] = dataclasses.replace(changed[section], **{name: other})
            asked = feature.asked(_Recipe(changed))
            assert asked is not None and asked.startswith(f"{key}="), (key, asked)


def test_a_key_of_a_feature_the_family_lacks_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"rollout\.dynamic_sampling=true asks for DAPO's dynamic sampling, "
                                          r"which model\.family=flow does not have"):
        load_config(None, ["model.family=flow", "data.task=shapes", "rollout.dynamic_sampling=true"])


@pytest.mark.parametrize(("recorded", "resume"), [
    (("rollout.engine=vllm", "vllm.dtype=bfloat16", "rollout.backend=ray", "ray.learner=actor",
      "ray.learner_placement=SPREAD", "ray.address=auto", "train.world_size=2", "checkpoint.sharded=true"),
     ("train.world_size=1", "rollout.backend=local", "rollout.engine=torch")),
    (("rollout.decoder=python", "rollout.lora_apply=terms", "train.lora_rank=2"), ("rollout.engine=vllm",)),
])
def test_what_a_resume_drops_moving_smaller_is_what_the_keys_declare(tmp_path, recorded, resume):
    from tether.config.config import load_resumed

    path = tmp_path / "config.yaml"
    path.write_text(load_config(None, ["data.task=arithmetic", *recorded]).to_yaml())
    _, dropped = load_resumed(path, resume)
    keys = table()
    names = [d.split("=")[0] for d in dropped]
    assert names and all(keys[n].dropped for n in names), dropped
    assert set(names) == {o.split("=")[0] for o in recorded if keys[o.split("=")[0]].dropped}


@dataclasses.dataclass(frozen=True)
class EchoSection:
    """A test engine's own knobs."""

    beams: int = knob(1, "Beams.", min=1)
    seed_offset: int = knob(0, "Changes what is sampled.", resume=Resume.TRAINING)


def test_an_engine_and_a_backend_registered_from_outside_own_their_sections_in_the_table():
    tether.register_engine(tether.EnginePlugin("echo_keys", section=("echo_keys", EchoSection)))
    tether.register_backend(tether.BackendPlugin("threads_keys", section=("threads_keys", CoinSection)))
    try:
        keys = table()
        assert disagreements(keys) == []
        beams, offset = keys["echo_keys.beams"], keys["echo_keys.seed_offset"]
        sides = keys["threads_keys.sides"]
        assert (beams.owner, beams.readers, beams.resume) == ("engine", ("echo_keys",), Resume.ACCEPTED)
        assert offset.resume is Resume.TRAINING  # as its knob declares
        assert (sides.owner, sides.readers, sides.resume) == ("backend", ("threads_keys",), Resume.ACCEPTED)
        assert beams.dropped == "when the resume sets another rollout.engine"
        recipe = {"rollout": {"engine": "torch"}}
        assert beams.drop(recipe) == ("read only with rollout.engine=echo_keys, and the resume sets "
                                      "rollout.engine=torch")
        assert beams.drop({"rollout": {"engine": "echo_keys"}}) is None
    finally:
        registry.engines.unregister("echo_keys")
        registry.backends.unregister("threads_keys")
