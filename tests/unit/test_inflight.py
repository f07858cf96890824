"""The in-flight modes as declared (``tether.control.inflight``): the table every reader of
``async.inflight_update`` relies on, pinned row by row."""

import pytest

from tether.control import BudgetSettings
from tether.control.inflight import MODES, SWITCHING, TURN_SAFE, inflight_mode
from tether.errors import ConfigError

# name: (drains, bounds_by_oldest, on_switch, spans_versions, wastes_tokens, turn_mode)
TABLE = {
    "drain": (True, False, "cannot", False, False, "keep"),
    "keep": (False, True, "keep_cache", True, False, "keep"),
    "recompute": (False, True, "recompute_cache", True, False, None),
    "abort": (False, True, "restart", False, True, None),
}


@pytest.mark.parametrize("name", TABLE)
def test_each_mode_declares_what_it_does(name):
    m = inflight_mode(name)
    assert (m.drains, m.bounds_by_oldest, m.on_switch, m.spans_versions, m.wastes_tokens,
            m.turn_mode) == TABLE[name]
    assert m.name == name and inflight_mode(m) is m


def test_the_derived_attributes():
    # switches: the engines watch; extra_work: the planner needs plan.mean_length
    assert {n: (m.switches, m.keeps_cache, m.recomputes_prefix, m.restarts, m.extra_work)
            for n, m in MODES.items()} == {
        "drain": (False, False, False, False, False),
        "keep": (True, True, False, False, False),
        "recompute": (True, False, True, False, True),
        "abort": (True, False, False, True, True),
    }
    assert list(MODES) == ["drain", "keep", "recompute", "abort"]  # the config's order
    assert SWITCHING == ("keep", "recompute", "abort")
    assert TURN_SAFE == ("drain", "keep")
    for m in MODES.values():
        assert m.drains != m.bounds_by_oldest  # a publication either waits or admission bounds


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
