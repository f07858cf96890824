"""The in-flight modes (``async.inflight_update``) as one declared policy: what each does at a
publication, at a launch and to the KV cache of a sequence being generated.

This is the one place that says what a mode does. The control rules (``BudgetSettings``), the
pools and workers, the engines, the agent family and the planner read these attributes; none of
them compares the mode's name (``tests/unit/test_architecture.py`` checks). The config key stays a
string, and plug-ins declare the modes they run by name (``EnginePlugin.inflight_updates``).

=========  ===============  =========  ===================================================
mode       on_switch        turn_mode  what follows (properties)
=========  ===============  =========  ===================================================
drain      cannot           keep       drains
keep       keep_cache       keep       bounds_by_oldest, switches, keeps_cache
recompute  recompute_cache  —          bounds_by_oldest, switches, recomputes_prefix, extra_work
abort      restart          —          bounds_by_oldest, switches, restarts (wastes_tokens), extra_work
=========  ===============  =========  ===================================================

A mode is parsed once from the recipe's string (``inflight_mode``) and travels as this object:
through the pools' and workers' settings to the engines' ``watch`` and the sampler.

Pure Python, like the rest of ``tether.control``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from tether.errors import ConfigError

OnSwitch = Literal["cannot", "keep_cache", "recompute_cache", "restart"]


@dataclass(frozen=True)
class InflightMode:
    """What one ``async.inflight_update`` mode does."""

    name: str
    """The value of ``async.inflight_update`` (and of ``EnginePlugin.inflight_updates``)."""
    on_switch: OnSwitch
    """What new weights arriving mid-generation do to a sequence. ``cannot``: it never happens (the
    publication waited); ``keep_cache``: the sequence goes on with its KV cache as it is (the prefix
    was computed under the old weights); ``recompute_cache``: the prefix's KV cache is computed again
    under the new weights before the next token (a prefill of the whole prefix: extra work, no
    tokens lost); ``restart``: the sequence is thrown away and sampled again from its prompt under
    the new weights."""
    turn_mode: str | None
    """With ``env.switch_at=turn`` (an agent takes weights up only between its turns): the mode
    the engines and the control rules then run, or None when turn safe points do not fit the mode
    (it switches inside a sequence by definition). ``drain`` with turn safe points waits only for
    the turns in flight (``BudgetSettings.drain_at_turns``): whole episodes outlive publications,
    so they run as ``keep`` does, each taking new weights up at its next turn; ``keep`` keeps."""

    @property
    def drains(self) -> bool:
        """A publication first waits for every generation in flight to finish (docs/architecture.md
        §2 rule 5 as written), so nothing can switch mid-generation. Why it matters: then every
        outstanding batch was launched at the published version, so the sync rule may publish
        lazily, and the engines load weights only between batches (one thread a worker)."""
        return self.on_switch == "cannot"

    @property
    def bounds_by_oldest(self) -> bool:
        """Admission takes the launch bound from the oldest version still generating, not the
        published one (``AsyncControl.freshness``, docs/architecture.md §2 rule 2). Why: without a
        drain generations outlive publications, so a batch launched now may train alongside one
        launched several versions ago; bounding by the oldest keeps every action within the budget.
        The sync rule then publishes after every step the trainer is ahead (``eager``), since
        publishing waits for nothing."""
        return not self.drains

    @property
    def switches(self) -> bool:
        """The engines watch for weights published while they generate (``Engine.watch``)
        and a worker loads them on a second thread: whenever a publication does not drain."""
        return not self.drains

    @property
    def keeps_cache(self) -> bool:
        """A switch leaves the sequences in flight as they are (their KV cache too)."""
        return self.on_switch == "keep_cache"

    @property
    def recomputes_prefix(self) -> bool:
        """A switch costs a prefill of the prefix so far (``plan.prefill_cost``)."""
        return self.on_switch == "recompute_cache"

    @property
    def restarts(self) -> bool:
        """A switch restarts every unfinished sequence from its prompt."""
        return self.on_switch == "restart"

    @property
    def wastes_tokens(self) -> bool:
        """Tokens sampled may be thrown away (a restarted sequence's): work the planner counts as
        wasted and needs ``plan.mean_length`` to estimate."""
        return self.restarts

    @property
    def extra_work(self) -> bool:
        """A switch costs work beyond the tokens kept (a prefill again, or tokens thrown away):
        the planner needs sequence lengths (``plan.mean_length``) to estimate it."""
        return self.recomputes_prefix or self.wastes_tokens

    def at_turns(self) -> InflightMode:
        """The mode run with turn safe points (``turn_mode``); refuses a mode they do not fit."""
        if self.turn_mode is None:
            raise ConfigError(f"async.inflight_update={self.name} switches inside a sequence; turn safe "
                              f"points need one of {', '.join(TURN_SAFE)}")
        return MODES[self.turn_mode]


DRAIN = InflightMode("drain", on_switch="cannot", turn_mode="keep")
KEEP = InflightMode("keep", on_switch="keep_cache", turn_mode="keep")
RECOMPUTE = InflightMode("recompute", on_switch="recompute_cache", turn_mode=None)
ABORT = InflightMode("abort", on_switch="restart", turn_mode=None)

MODES: dict[str, InflightMode] = {m.name: m for m in (DRAIN, KEEP, RECOMPUTE, ABORT)}
"""Every mode by name, in the order the config lists them."""
INFLIGHT_UPDATE_CHOICES: tuple[str, ...] = tuple(MODES)
TURN_SAFE: tuple[str, ...] = tuple(n for n, m in MODES.items() if m.turn_mode is not None)
"""The modes ``env.switch_at=turn`` runs with."""
SWITCHING: tuple[str, ...] = tuple(n for n, m in MODES.items() if m.switches)
"""The modes an engine's ``watch`` takes."""


def cache_versions(versions: Sequence[int], mode: InflightMode) -> list[int]:
    """Each token's KV version: the oldest weights version among the keys and values it was sampled
    over. Under ``keep_cache`` a switch leaves the prefix's cache as older weights computed it, and
    the oldest entries are the prefill's, so a token's KV version is the version of the first token of
    its run of model tokens (a turn: −1 marks the tokens no model sampled, an observation's, which a
    new turn prefills again). In every other mode nothing is sampled over another version's cache
    (the publication waited, the prefix was computed again, or the sequence started over): a
    token's KV version is its own. −1 stays −1."""
    if not mode.keeps_cache:
        return list(versions)
    out, first = [], -1
    for i, v in enumerate(versions):
        if v >= 0 and (i == 0 or versions[i - 1] < 0):
            first = v
        out.append(first if v >= 0 else -1)
    return out


def cache_metrics(rows: Sequence[Sequence[int]], mode: InflightMode) -> dict[str, float]:
    """``staleness/kv_mixed_token_frac``: the share of model tokens sampled over a KV cache older
    than their own version (a version the prefill wrote, the token's by a later switch: neither
    policy's token); ``staleness/kv_lag_updates_mean``: how many updates older that cache was, on
    those tokens (0 when none). Only ``keep`` has any."""
    tokens = mixed = lag = 0
    for versions in rows:
        for v, kv in zip(versions, cache_versions(versions, mode), strict=True):
            if v < 0:
                continue
            tokens += 1
            if kv != v:
                mixed += 1
                lag += v - kv
    return {"staleness/kv_mixed_token_frac": mixed / tokens if tokens else 0.0,
            "staleness/kv_lag_updates_mean": lag / mixed if mixed else 0.0}


def inflight_mode(name: str | InflightMode) -> InflightMode:
    """The mode called ``name`` (a mode is returned as it is); refuses an unknown name, listing
    the valid ones."""
    if isinstance(name, InflightMode):
        return name
    try:
        return MODES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"async.inflight_update must be one of {', '.join(MODES)}, "
                          f"got {name!r}") from None
