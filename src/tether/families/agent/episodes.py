"""Playing episodes: token in, token out, with environment calls off the generation path.

An episode's training sequence is built once, in order, and never re-tokenized:

    [first observation][model turn 1][observation 1][model turn 2] ...

Model turns are the engine's sampled ids with its log-probs and per-token versions (``model`` 1);
each observation is encoded once when it arrives and appended (``model`` 0, log-prob 0, version −1).
Every turn is generated from the ids so far, so what the model conditioned on is exactly what the
learner scores. An environment that rewrites the history (``Step.new_context``) closes the sequence
so far as one sample and starts another from the new context: an episode is then several samples,
each exactly what the model saw, all with the episode's return. A chat template that does not
reproduce the episode so far (one that drops earlier reasoning or trims turns) does the same: the
new sample's context is its rendering of the whole conversation (``tether.families.agent.chat``).

Environment calls (construction and ``reset`` included) run on ``EnvThreads``, side by side, each
episode's on its own thread and event loop for the episode's whole life (``Lane``). Turns
are generated in one batched engine call per wave (``env.schedule=waves``: once every call of the
last turn has returned, so a run is reproducible and resumes exactly), or for whichever episodes are
ready as soon as any are (``eager``: a slow environment holds back only its own episode; the rows
of each engine call then follow timing, so sampling is not reproducible run to run). A call's
deadline counts from when it starts (takes one of ``env.workers`` slots), not from when it was
submitted. A call past its deadline is abandoned: its episode ends as ``timeout`` and the call keeps
its slot until it returns; the threads are daemons, so a hung environment never holds the worker
process open.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import replace
from typing import Any

from tether.families.agent.env import (
    REWARD_LIMIT,
    ActionError,
    EnvContractError,
    EnvFactory,
    Observation,
    as_step,
    observation_of,
    plain_text,
    transcript_text,
)
from tether.families.agent.envthreads import Call, EnvThreads, is_stop
from tether.families.agent.episode import COUNTED, Episode, Limits, clipped
from tether.vocabulary import SamplingParams


def _message(exc: BaseException) -> str:
    """``str(exc)`` of an exception from environment code, or '' when its ``__str__`` fails."""
    try:
        return str(exc)
    except Exception:
        return ""


def _said(exc: BaseException) -> str:
    """``TypeName: message`` of an exception from environment code."""
    message = _message(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


class Player:
    """Plays groups of episodes with one engine and one tokenizer."""

    BOUNDARY_POLL_S = 0.02
    """With ``whole_turns``: how often a worker waiting on environment calls looks for newly
    published weights (no turn is generating then, so it may take them up at once)."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        make_env: EnvFactory,
        limits: Limits,
        threads: EnvThreads,
        *,
        schedule: str = "waves",
        chat: bool = False,
        whole_turns: bool = False,
        end_ids: Sequence[int] = (),
        chat_options: Any = None,
    ) -> None:
        self.engine, self.tokenizer, self.make_env = engine, tokenizer, make_env
        self.end_ids = frozenset(end_ids or (tokenizer.eos_token_id,))
        """End-of-turn ids (``tether.decoding.stops.TurnEnds.end_ids``): a final one is left out of
        the action an environment receives and of a chat turn's content."""
        self.env_name = f"environment {make_env.name}"
        """The environment (its class), as the episodes' error messages name it."""
        self.chat = chat
        """Observations as chat turns of the tokenizer's template (``tether.families.agent.chat``)."""
        self.chat_options = chat_options
        """A system prompt, tool schemas and template arguments for the template (``ChatOptions``)."""
        self.whole_turns = whole_turns
        """Take up new weights only between turns, as soon as no turn is generating
        (``env.switch_at=turn``)."""
        self.limits, self.threads = limits, threads
        self.eager = schedule == "eager"
        """Generate for whichever episodes are ready as soon as any are (``env.schedule``), rather
        than in waves once every environment call of the last turn has returned."""
        self.last_errors: list[str] = []
        self.turn_switches = 0
        """Newer weights taken up between turns (without draining), since the last ``play``."""

    def chat_turns(self) -> Any:
        """A new conversation (``ChatTurns``) with the recipe's template options."""
        from tether.families.agent.chat import ChatOptions, ChatTurns

        return ChatTurns(self.tokenizer, end_ids=self.end_ids, options=self.chat_options or ChatOptions())

    def text_of(self, ep: Episode, obs: Observation, first: bool) -> str:
        """The text an observation appends: its chat turn(s) with a template, else its plain text."""
        if ep.chat is None:
            return plain_text(obs)
        return ep.chat.first(obs) if first else ep.chat.next(obs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def encode_within(self, text: str, limit: int) -> list[int] | None:
        """``text``'s ids when they are fewer than ``limit``, else None. A long text is measured on
        its beginning first: once a prefix encodes to twice the limit and more (a margin for the
        token across the cut), the rest is never encoded, so an oversized observation costs what a
        few times ``limit`` tokens cost, not what its whole text would."""
        enough = 2 * limit + 16
        n = 4 * enough  # characters: most tokens span fewer than 4
        while n < len(text):
            if len(self.encode(text[:n])) >= enough:
                return None
            n *= 4
        ids = self.encode(text)
        return ids if len(ids) < limit else None

    def play(self, tasks: Sequence[tuple[Mapping[str, Any], int]], params: SamplingParams, seed: int
             ) -> list[Episode]:
        """Play one episode per (task row, environment seed), all at once; returns them in the
        order given, each ended (``Episode.status``)."""
        episodes = [Episode(i, task, env_seed, lane=self.threads.lane())
                    for i, (task, env_seed) in enumerate(tasks)]
        if self.chat:
            for ep in episodes:
                ep.chat = self.chat_turns()
        self.turn_switches = 0
        pending: dict[Call, tuple[Episode, str]] = {}
        for ep in episodes:
            self._call(pending, ep, "reset", lambda ep=ep: self._reset(ep))
        try:
            self._run(episodes, pending, params, seed)
        finally:
            self._close(episodes)
        self.last_errors = [ep.error for ep in episodes if ep.error]
        return episodes

    def _run(self, episodes: list[Episode], pending: dict, params: SamplingParams, seed: int) -> None:
        """Turns and environment calls until every episode has ended."""
        ready: list[Episode] = []
        turn = 0
        while pending or ready:
            if ready and (self.eager or not pending):
                ready.sort(key=lambda ep: ep.index)  # the engine's rows in a fixed order
                self._generate(ready, params, seed + 7919 * turn, pending)
                turn, ready = turn + 1, []
                continue
            now = time.monotonic()
            deadline = min(self._deadline(ep, call, now) for call, (ep, _) in pending.items())
            timeout = max(0.0, deadline - now)
            if self.whole_turns:  # no turn is generating: the worker is at a safe point while it waits
                timeout = min(timeout, self.BOUNDARY_POLL_S)
            done, _ = wait(list(pending), timeout=timeout, return_when=FIRST_COMPLETED)
            if self.whole_turns:
                self._boundary()
            now = time.monotonic()
            for call in done:
                ep, kind = pending.pop(call)
                ep.env_s += call.ended - call.started
                if self._received(ep, kind, call):
                    ready.append(ep)
            for call, (ep, kind) in list(pending.items()):
                if now >= self._deadline(ep, call, now):
                    del pending[call]
                    waited = call.started is None
                    call.cancel()  # one still waiting for a slot never runs
                    self.threads.abandon(call)
                    ep.env_s += now - self._started(call, now)
                    ep.env = None  # in use by the abandoned call: never closed from here
                    ep.lane.close()  # ends once the call returns
                    self._end(ep, "timeout", f"{self.env_name}: {kind} " + (
                        f"found every one of the env.workers={self.threads.workers} slots held by calls "
                        "past their timeout" if waited else "ran past its timeout"))

    # -- environment calls -------------------------------------------------------------------

    def _call(self, pending: dict, ep: Episode, kind: str, fn: Callable[[], Any]) -> None:
        pending[ep.lane.submit(fn)] = (ep, kind)

    def _deadline(self, ep: Episode, call: Call, now: float) -> float:
        """When ``call`` times out: its time allowed from when it started. One still waiting for a
        slot has no deadline yet (the earliest it could have, ``now`` + its time, is returned, so the
        wait wakes up to look again), unless every slot is held by calls past their deadlines
        (``EnvThreads.jammed_since``): then it counts from that moment."""
        lim = self.limits
        return self._started(call, now) + min(lim.step_timeout_s, max(0.0, lim.episode_timeout_s - ep.env_s))

    def _started(self, call: Call, now: float) -> float:
        """When ``call``'s time began: when it started, else when every slot came to be held by
        calls past their deadlines, else ``now`` (it is waiting for a slot: its time has not begun)."""
        return call.started or self.threads.jammed_since or now

    def _reset(self, ep: Episode) -> tuple[Any, Observation]:
        """(the environment, its first observation); the episode takes the environment only when
        the call is received in time, so an abandoned set-up is never closed under its thread. An
        environment whose reset fails is closed here (a failing close is not reported over it)."""
        env = self.make_env()
        try:
            obs = observation_of(env.reset(ep.task, ep.seed), "reset")
        except BaseException:
            with contextlib.suppress(Exception):
                env.close()
            raise
        return env, obs

    def _received(self, ep: Episode, kind: str, future: Call) -> bool:
        """Take one finished environment call into ``ep``; True if the model's turn is next. What
        the call raised or returned wrong (anything but a stop of the run, ``is_stop``) ends the
        episode as ``error``, never the batch."""
        name = self.env_name
        try:
            result = future.result()
        except ActionError as exc:
            if kind == "reset":
                self._end(ep, "error", f"{name}: reset raised {_said(exc)}")
                return False
            ep.action_errors += 1
            ep.step_rewards.append(0.0)  # a step all the same: one reward per turn
            return self._observe(ep, _message(exc), done=False, truncated=False)
        except BaseException as exc:  # SystemExit and KeyboardInterrupt from environment code too
            if is_stop(exc):
                raise
            self._end(ep, "error", f"{name}: {kind} raised {_said(exc)}")
            return False
        if kind == "reset":
            ep.env, obs = result
            limit = self.limits.max_episode_tokens
            ids = self.encode_within(self.text_of(ep, obs, first=True), limit)
            if not ids:
                ep.transcript.append(clipped(transcript_text(obs)))
                size = "no" if ids == [] else f"{limit} or more"
                self._end(ep, "error", f"the first observation is {size} tokens; it must be 1 to "
                          f"env.max_episode_tokens={limit} − 1")
                return False
            ep.transcript.append(transcript_text(obs))
            self._append(ep, ids)
            return True
        try:
            step = as_step(result)
        except EnvContractError as exc:
            self._end(ep, "error", f"{name}: {exc}")
            return False
        except Exception as exc:  # a step output that breaks on reading (a mapping that raises)
            self._end(ep, "error", f"{name}: step returned what could not be read: {_said(exc)}")
            return False
        ep.step_rewards.append(step.reward)
        total = math.fsum(ep.step_rewards)
        if abs(total) > REWARD_LIMIT:
            ep.transcript.append(clipped(step.observation))
            self._end(ep, "error", f"{name}: step rewards add up to {total:g} after {len(ep.step_rewards)} "
                      f"steps; an episode's return must lie within ±{REWARD_LIMIT:g} (scale the rewards: "
                      "advantages are computed in float32)")
            return False
        if step.info.get("action_error"):
            ep.action_errors += 1
        for key in COUNTED:
            value = step.info.get(key)
            if isinstance(value, int) and not isinstance(value, bool):  # zeros too: a tool environment's
                ep.counts[key] = ep.counts.get(key, 0) + value          # episodes all carry its counts
        return self._observe(ep, step.observation, done=step.done, truncated=step.truncated,
                             rewrite=step.new_context)

    def _observe(self, ep: Episode, obs: Observation, *, done: bool, truncated: bool, rewrite: bool = False
                 ) -> bool:
        """Append an observation to the episode's sequence, or end it; the transcript keeps the
        observation whole when the sequence holds it, else its beginning (``clipped``)."""
        text = transcript_text(obs)
        if done or truncated or ep.turns >= self.limits.max_turns:
            ep.transcript.append(clipped(text))
            self._end(ep, "done" if done else "truncated" if truncated else "max_turns")
            return False
        if rewrite:  # the history is replaced: the next turn is sampled from ``text`` alone
            ep.rewrite()
            if ep.chat is not None:
                ep.chat = self.chat_turns()
            ids = self.encode_within(self.text_of(ep, obs, first=True), self.limits.max_episode_tokens)
            if ids == []:
                ep.transcript.append(text)
                self._end(ep, "error", "the environment rewrote the history to an empty context "
                          "(Step.new_context with no observation text)")
                return False
        else:
            ids = self._next_ids(ep, obs)
        if ids is None:
            ep.transcript.append(clipped(text))
            self._end(ep, "token_budget")  # the observation is in the transcript, not the sequence
            return False
        ep.transcript.append(text)
        self._append(ep, ids)
        return True

    def _next_ids(self, ep: Episode, obs: Observation) -> list[int] | None:
        """The ids to append for the observation ``obs``, or None when they would not fit. Where
        the chat template does not reproduce the episode so far, the episode starts a new sample
        whose context is the template's rendering of the whole conversation (``ChatTurns.restart``)."""
        from tether.families.agent.chat import NotAppendOnly

        room = self.limits.max_episode_tokens - len(ep.ids)
        if ep.chat is None:
            return self.encode_within(plain_text(obs), room)
        try:
            appended = ep.chat.next(obs)
        except NotAppendOnly:
            ids = self.encode_within(ep.chat.restart(obs), self.limits.max_episode_tokens)
            if ids is not None:  # else the episode ends (token_budget) with the samples it has
                ep.rewrite()
                ep.template_rewrites += 1
            return ids
        return self.encode_within(appended, room)

    @staticmethod
    def _append(ep: Episode, ids: list[int]) -> None:
        ep.ids += ids
        ep.model += [0] * len(ids)
        ep.logprobs += [0.0] * len(ids)
        ep.versions += [-1] * len(ids)

    @staticmethod
    def _end(ep: Episode, status: str, error: str = "") -> None:
        ep.status, ep.error = status, error

    # -- model turns -------------------------------------------------------------------------

    def _generate(self, ready: list[Episode], params: SamplingParams, seed: int, pending: dict) -> None:
        """The next turn of every ready episode: one engine call per distinct token room (the
        room is the per-turn budget, or what the episode budget leaves when that is less)."""
        lim = self.limits
        self._boundary()
        by_room: dict[int, list[Episode]] = {}
        for ep in ready:
            by_room.setdefault(min(lim.max_turn_tokens, lim.max_episode_tokens - len(ep.ids)), []).append(ep)
        for room, eps in sorted(by_room.items()):
            # no switch inside a turn (env.switch_at=turn): the engine takes nothing up while it samples
            with self.engine.holding() if self.whole_turns else contextlib.nullcontext():
                sampled = self.engine.generate(
                    [ep.ids for ep in eps],
                    samples_per_prompt=1,
                    params=replace(params, max_new_tokens=room),
                    seed=seed + room,
                )
            if self.whole_turns:
                self._boundary()  # the turns just sampled are done: take up what was published meanwhile
            for ep, (c,) in zip(eps, sampled, strict=True):
                ep.ids += c.token_ids
                ep.model += [1] * len(c.token_ids)
                ep.turn_tokens.append(len(c.token_ids))
                ep.logprobs += list(c.logprobs)
                ep.versions += list(c.versions)
                ep.turns += 1
                if c.finish_reason == "length":
                    ep.turn_truncations += 1
                if ep.chat is not None:
                    ep.chat.sampled(c.token_ids)
                action = self.action(c.token_ids)
                ep.transcript.append(action)
                env = ep.env
                self._call(pending, ep, "step", lambda env=env, action=action: env.step(action))

    def action(self, token_ids: Sequence[int]) -> str:
        """What the environment receives for a turn: its text as sampled, special tokens included
        (a tool-call marker that is a special token stays), but for a final end-of-turn token."""
        ids = list(token_ids)
        if ids and ids[-1] in self.end_ids:
            ids.pop()
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _boundary(self) -> None:
        """A turn boundary, a safe point: the engine takes up the newest weights the worker holds,
        if newer (``poll`` is set without draining, and when draining at turns)."""
        if self.engine.take_up() is not None:
            self.turn_switches += 1

    def _close(self, episodes: list[Episode]) -> None:
        """Close every environment not held by an abandoned call, each on its episode's lane, then
        the lanes; a close that fails is ignored and one that overruns its deadline (from when it
        starts) is abandoned (counted), never raised."""
        closing = [
            ep.lane.submit(ep.env.close)
            for ep in episodes
            if ep.env is not None  # an adapter (``tether.families.agent.env``): each has close
        ]
        for ep in episodes:
            ep.lane.close()
            ep.env = None
        timeout = self.limits.step_timeout_s
        while closing:
            now = time.monotonic()
            wake = min(self._started(c, now) for c in closing) + timeout
            done, _ = wait(closing, timeout=max(0.0, wake - now), return_when=FIRST_COMPLETED)
            now = time.monotonic()
            closing = [c for c in closing if c not in done]
            for call in [c for c in closing if now >= self._started(c, now) + timeout]:
                call.cancel()
                self.threads.abandon(call)
                closing.remove(call)
