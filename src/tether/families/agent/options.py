"""The agent family's own recipe section (``env``; ``Family.section``): the environment, its
budgets and timeouts, and how failures count. Refused unless ``model.family=agent``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from tether.config.fields import Resume, knob


@dataclass(frozen=True)
class EnvSection:
    """Multi-turn episodes against an environment (used when model.family=agent; docs/agents.md)."""

    env_class: str = knob(
        "",
        "The environment, as path/to/file.py:Class: one instance per episode, reset(task, seed) -> first "
        "observation, step(action) -> Step or a gymnasium 5-tuple, close(); skyrl-gym's BaseTextEnv and "
        "gymnasium text environments are adapted. Each task row (data.dataset or data.task) is passed to "
        "reset. Empty: the built-in environment of data.task (kv_lookup, guess_number, tool_calc).",
    )
    kwargs: dict[str, Any] = knob(
        {},
        "Keyword arguments env.env_class is built with, one instance per episode, e.g. {url: "
        "'http://127.0.0.1:8000', timeout_s: 5} (a gymnasium environment's too). Not for skyrl-gym "
        "environments: they take env.env_config.",
    )
    env_config: dict[str, Any] = knob(
        {},
        "A skyrl-gym environment's env_config (its first constructor argument), as SkyRL's "
        "environment.skyrl_gym.<env> section holds it, e.g. {search_url: 'http://127.0.0.1:8000/retrieve', "
        "topk: 3}; given as an OmegaConf DictConfig (attribute access: env_config.search_url). Its extras "
        "are the task row with max_turns = env.max_turns.",
    )
    tools: list[str] = knob(
        [],
        "Python functions the model may call, each path/to/file.py:name or module:name (a function, or a "
        "list or dict of functions); their schemas (from type hints and docstrings) reach the chat "
        "template as tools. Set without env.env_class: the built-in tool environment plays each task row's "
        "prompt, runs each parsed call and scores the final answer (a turn without calls) with "
        "env.answer_reward; with env.env_class, that class must subclass "
        "tether.families.agent.tools.ToolEnv.",
    )
    tool_parser: str = knob(
        "hermes",
        "How a model turn's tool calls are read: hermes (<tool_call>{\"name\": ..., \"arguments\": "
        "...}</tool_call>, any number a turn: Hermes, Qwen2.5/Qwen3), json (the turn is one JSON call or a "
        "list of them), or path/to/file.py:function returning a tools.ParsedTurn. Read by tool "
        "environments.",
    )
    answer_reward: str = knob(
        "auto",
        "How a tool environment scores the final answer: a name reward.function accepts (task, "
        "exact_match, numeric_match, math, path/to/file.py:function with (prompt, completion, answer, "
        "fields)). auto = the built-in task's verifier with data.task, else exact_match.",
    )
    malformed_call_reward: float = knob(
        0.0,
        "Reward added to a tool environment's step for each malformed tool call (not JSON, no name, not "
        "closed); the call is answered with what was wrong either way, and counted "
        "(agent/malformed_calls). Negative penalises.",
        min=-1e6, max=1e6,
    )
    max_tool_calls: int = knob(
        8, "Tool calls of one turn a tool environment runs; the rest are answered as errors.", min=1)
    max_turns: int = knob(
        4, "Model turns per episode; an episode still going after them ends as max_turns (a skyrl-gym "
        "environment also reads it as extras['max_turns']).", min=1
    )
    max_turn_tokens: int = knob(
        0,
        "Tokens the model may sample in one turn (a turn also ends at env.turn_stop or an end-of-turn "
        "token); 0 = rollout.max_new_tokens. A turn cut off here still goes to the environment, and is "
        "counted.",
        min=0,
    )
    max_episode_tokens: int = knob(
        0,
        "Tokens of an episode's sequence, observations included (after a history rewrite, of each of its "
        "samples); an observation that would not fit ends the episode as token_budget (its first 4,096 "
        "characters stay in the transcript, not in the sequence). 0 = the model's context.",
        min=0,
    )
    turn_stop: str = knob(
        "auto",
        "Text that ends a model turn, besides the end-of-turn tokens (EOS, the chat template's, the "
        "generation config's), of any length (e.g. </call>): the turn ends at the token that completes it, "
        "which stays in the action. auto = a newline, or none with data.chat_template=true (chat turns end "
        "at the end-of-turn tokens); '' = none. Text the tokenizer cannot express is refused.",
    )
    workers: int = knob(
        8,
        "Environment calls (construction, reset, step, close) a rollout worker runs at once, off the "
        "generation path so a slow environment never stalls the engine; a hard bound (a call past "
        "env.step_timeout_s keeps its place until it returns). Each episode's calls run on one thread and "
        "one event loop of its own for its whole life. 0 runs them inline (no timeouts; a baseline).",
        min=0,
    )
    schedule: Literal["waves", "eager"] = knob(
        "waves",
        "When turns are generated: waves = one engine call per turn of all the worker's episodes, once "
        "their environment calls have returned (reproducible: exact resume); eager = as soon as any episode "
        "is ready, so a slow environment holds back only its own episode (faster under uneven environment "
        "latency, but which episodes share an engine call follows timing, so sampling is not reproducible).",
        choices=("waves", "eager"),
    )
    switch_at: Literal["token", "turn"] = knob(
        "token",
        "Where an episode takes up newly published weights. token: with async.inflight_update=drain, only "
        "between rollout batches (a publication waits for whole episodes); otherwise before any decode step "
        "(the mode says what happens to the turn in flight). turn: only between turns, so each turn is "
        "sampled on one version; with drain a publication waits for the turns in flight (not whole "
        "episodes), with keep it waits for nothing.",
        choices=("token", "turn"))
    step_timeout_s: float = knob(
        30.0,
        "Seconds one environment call (set-up, reset, step) may take, from when it starts (not while it "
        "waits for one of env.workers); past it the episode ends as timeout and the call is abandoned.",
        min=0.001,
    )
    episode_timeout_s: float = knob(
        300.0, "Seconds of environment time one episode may use, set-up included.", min=0.001
    )
    failure_reward: float = knob(
        0.0,
        "The return of an episode that failed (an environment exception, a broken step, a timeout); "
        "it stays in its group.",
    )
    on_failure: Literal["score", "mask"] = knob(
        "score",
        "What a failed episode (an environment error or timeout) trains as. score: its return is "
        "env.failure_reward and it stays in its group's baseline; mask: its samples leave the loss and "
        "the advantages (its group's baseline is the other episodes'), counted as agent/masked_failures, "
        "so infrastructure failures never enter the advantages.",
        choices=("score", "mask"), resume=Resume.TRAINING)
    credit: Literal["episode", "turn"] = knob(
        "episode",
        "What an episode's tokens are credited with. episode: every token the episode's advantage (its "
        "return against the group's); turn: each turn's tokens the advantage of the turn's discounted "
        "return R_t = sum over k >= t of gamma^(k-t) r_k (r_k: the reward after turn k), against the "
        "same turn of the group's other episodes (docs/agents.md, Credit per turn). turn needs "
        "train.loss ppo_clip or cispo.",
        choices=("episode", "turn"), resume=Resume.TRAINING)
    gamma: float = knob(
        1.0, "The discount of later turns' rewards in a turn's return (env.credit=turn).", min=0.0, max=1.0,
        resume=Resume.TRAINING)
    max_failed_frac: float = knob(
        0.25,
        "Most failed episodes a rollout batch may hold, as a share; past it the run stops with the "
        "first failure's message.",
        min=0.0,
        max=1.0,
    )
    script_quality: float = knob(
        1.0,
        "How good a player the warm start's scripted transcripts show (kv_lookup, tool_calc: the share that "
        "calls the tools; guess_number: the share of bisection guesses); below 1 leaves room for RL.",
        min=0.0,
        max=1.0,
    )


def turn_stop_of(env: EnvSection, chat: bool) -> str:
    """``env.turn_stop`` with ``auto`` resolved: a newline for plain-text turns, none for chat turns."""
    if env.turn_stop == "auto":
        return "" if chat else "\n"
    return env.turn_stop
