"""The in-flight modes as declared (``tether.control.inflight``): the table every reader of
``async.inflight_update`` relies on, pinned row by row."""

import dataclasses

import pytest

from tether.control import BudgetSettings
from tether.control.inflight import MODES, SWITCHING, TURN_SAFE, InflightMode, inflight_mode
from tether.errors import ConfigError

# name: (on_switch, turn_mode) as declared; then what follows from them:
# (drains, bounds_by_oldest, switches, keeps_cache, recomputes_prefix, restarts, wastes_tokens, extra_work)
TABLE = {
    "drain": ("cannot", "keep"),
    "keep": ("keep_cache", "keep"),
    "recompute": ("recompute_cache", None),
    "abort": ("restart", None),
}
DERIVED = {
    "drain": (True, False, False, False, False, False, False, False),
    "keep": (False, True, True, True, False, False, False, False),
    "recompute": (False, True, True, False, True, False, False, True),
    "abort": (False, True, True, False, False, True, True, True),
}


@pytest.mark.parametrize("name", TABLE)
def test_each_mode_declares_what_it_does(name):
    m = inflight_mode(name)
    assert (m.on_switch, m.turn_mode) == TABLE[name]
    assert m.name == name and inflight_mode(m) is m


@pytest.mark.parametrize("name", TABLE)
def test_what_follows_from_the_declaration(name):
    m = inflight_mode(name)
    assert (m.drains, m.bounds_by_oldest, m.switches, m.keeps_cache, m.recomputes_prefix, m.restarts,
            m.wastes_tokens, m.extra_work) == DERIVED[name]
    assert m.bounds_by_oldest == m.switches == (not m.drains)  # a publication waits, or admission bounds


def test_the_modes_in_order():
    assert list(MODES) == ["drain", "keep", "recompute", "abort"]  # the config's order
    assert SWITCHING == ("keep", "recompute", "abort")
    assert TURN_SAFE == ("drain", "keep")
    assert {f.name for f in dataclasses.fields(InflightMode)} == {"name", "on_switch", "turn_mode"}


def test_turn_safe_points():
    assert inflight_mode("drain").at_turns() is inflight_mode("keep")
    assert inflight_mode("keep").at_turns() is inflight_mode("keep")
    with pytest.raises(ConfigError, match="turn safe points need one of drain, keep"):
        inflight_mode("abort").at_turns()


def test_a_bad_name_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="must be one of drain, keep, recompute, abort, got 'pause'"):
        inflight_mode("pause")


def test_the_budget_runs_the_turn_mode_when_draining_at_turns():
    assert BudgetSettings(inflight_update="drain").mode.name == "drain"
    turns = BudgetSettings(inflight_update="drain", drain_at_turns=True)
    assert turns.mode.name == "keep" and not turns.drains


def test_the_mode_travels_parsed_to_the_workers_and_engines():
    """Parsed once from the recipe (``PoolSettings.inflight``), the same object reaches a worker's
    spec and an engine's ``watch``; an engine refuses a mode that does not switch."""
    import pickle

    from tether.config import load_config
    from tether.rollout.settings import PoolSettings
    from tether.rollout.watch import Watched

    settings = PoolSettings(load_config(None, ["async.inflight_update=recompute"]), "model")
    assert settings.inflight is MODES["recompute"] and settings.inflight is settings.inflight
    spec = pickle.loads(pickle.dumps(settings.worker_spec(0, 0)))  # as a spawned worker gets it
    assert spec.inflight == MODES["recompute"]
    engine = Watched()
    engine.watch(lambda: None, spec.inflight)
    assert engine.inflight.recomputes_prefix
    with pytest.raises(ConfigError, match="inflight_update=drain does not switch weights mid-generation"):
        engine.watch(lambda: None, MODES["drain"])
