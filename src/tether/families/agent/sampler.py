"""The agent family's side of a rollout worker: episodes played with the token engine (built-in or
vLLM) and the environment threads, gathered into one ``EpisodeBatch``.

A group is G episodes of one task, each with the environment seed of the task's position (so a
group's episodes face the same environment and differ only by what the model samples).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

from tether.control.inflight import cache_metrics
from tether.decoding.stops import TurnEnds
from tether.errors import RolloutError
from tether.families.agent.envthreads import EnvThreads
from tether.families.agent.episode import BUDGET_ENDINGS, COUNTED, ENDINGS, FAILURES, Episode, Limits
from tether.families.agent.episodes import Player
from tether.families.agent.payload import EpisodeBatch
from tether.procinfo import peak_rss_mb
from tether.vocabulary import WorkItem


def environment_class(cfg: Any) -> type:
    """The recipe's environment class: ``env.env_class``; else the built-in tool environment when
    ``env.tools`` names functions; else the built-in task's own."""
    from tether import registry
    from tether.errors import ConfigError
    from tether.families.agent.tasks import AgentTask
    from tether.families.agent.tools import ToolEnv
    from tether.pyload import load_python_object

    e = cfg.env
    if e.env_class:
        env_class = load_python_object(e.env_class, what="env.env_class")
        if e.tools and not (isinstance(env_class, type) and issubclass(env_class, ToolEnv)):
            raise ConfigError(f"env.tools is set, but env.env_class={e.env_class} is not a tool "
                              "environment (a subclass of tether.families.agent.tools.ToolEnv); leave "
                              "env.env_class empty to play the tools with the built-in one, or subclass "
                              "ToolEnv")
        return env_class
    if e.tools:
        return ToolEnv
    task = registry.tasks.get(cfg.data.task) if cfg.data.task else None
    env_class = task.environment if isinstance(task, AgentTask) else None
    if env_class is None:
        raise ConfigError(
            "model.family=agent needs an environment: set env.env_class to "
            "path/to/file.py:Class, env.tools to Python functions, or data.task to a built-in agent task "
            "(kv_lookup, guess_number, tool_calc)"
        )
    return env_class


def is_tool_env(env_class: Any) -> bool:
    from tether.families.agent.tools import ToolEnv

    return isinstance(env_class, type) and issubclass(env_class, ToolEnv)


def tool_arguments(cfg: Any, env_class: type) -> dict[str, Any]:
    """What a tool environment is built with besides ``env.kwargs``: the functions of
    ``env.tools`` (else its own ``default_tools``), the parser, the answer reward and the
    malformed-call reward; the functions are refused unless each has a schema."""
    from tether.data.rewards import Scorer, load_reward
    from tether.errors import ConfigError
    from tether.families.agent.tools import load_parser, load_tools, tool_schema

    e = cfg.env
    tools = load_tools(e.tools) if e.tools else list(env_class.default_tools)
    if not tools:
        raise ConfigError(f"{env_class.__qualname__} has no tools: set env.tools to path/to/file.py:function "
                          "(or a list of functions)")
    for fn in tools:
        tool_schema(fn)  # refuses a function whose schema cannot be stated, now
    spec = e.answer_reward
    if spec == "auto":
        spec = "task" if cfg.data.task else "exact_match"
    try:
        scorer = Scorer(load_reward(spec, task=cfg.data.task or None), spec)
    except ConfigError as exc:
        raise ConfigError(f"env.answer_reward={e.answer_reward!r}: {exc}") from exc
    return {"tools": tools, "parser": load_parser(e.tool_parser), "answer_reward": AnswerScore(scorer),
            "malformed_reward": e.malformed_call_reward, "max_calls": e.max_tool_calls}


class AnswerScore:
    """A reward function's ``Scorer`` (its value checked finite and bounded) as a tool environment's
    answer reward, ``(answer, task row) -> float``."""

    def __init__(self, scorer: Any) -> None:
        self.scorer = scorer

    def __call__(self, answer: str, task: Any) -> float:
        from tether.vocabulary import Example

        fields = {k: v for k, v in task.items() if k not in ("prompt", "answer")}
        return self.scorer(Example(str(task.get("prompt", "")), str(task.get("answer", "")), fields), answer)


def environment_factory(cfg: Any):
    """What makes one environment of the recipe (``environment_class``), built with ``env.kwargs``
    (a tool environment's with ``tool_arguments`` too; skyrl-gym's with ``env.env_config``, and
    ``env.max_turns`` in its extras)."""
    from tether.families.agent.env import factory

    env_class = environment_class(cfg)
    options = dict(cfg.env.kwargs)
    if is_tool_env(env_class):
        options = {**tool_arguments(cfg, env_class), **options}
    return factory(env_class, options, env_config=cfg.env.env_config, extras={"max_turns": cfg.env.max_turns})


def chat_options(cfg: Any) -> Any:
    """The chat template's options (``ChatOptions``): ``data.system_prompt``, the tool schemas of a
    tool environment, ``data.chat_template_kwargs``."""
    from tether.families.agent.chat import ChatOptions
    from tether.families.agent.tools import load_tools, tool_schema

    env_class = environment_class(cfg)
    tools = []
    if is_tool_env(env_class):
        functions = load_tools(cfg.env.tools) if cfg.env.tools else env_class.default_tools
        tools = [tool_schema(fn) for fn in functions]
    return ChatOptions(system=cfg.data.system_prompt, tools=tools, kwargs=dict(cfg.data.chat_template_kwargs))


def limits_of(cfg: Any, context: int | None) -> Limits:
    e = cfg.env
    episode = e.max_episode_tokens or context or 2048
    return Limits(
        max_turns=e.max_turns,
        max_turn_tokens=e.max_turn_tokens or cfg.rollout.max_new_tokens,
        max_episode_tokens=episode,
        step_timeout_s=e.step_timeout_s,
        episode_timeout_s=e.episode_timeout_s,
    )


def turn_ends_of(cfg: Any, tokenizer: Any, generation_eos: Sequence[int]) -> TurnEnds:
    """What ends the recipe's turns (``tether.decoding.stops``): the end-of-turn ids of the
    tokenizer, its template and ``generation_eos`` (the model's generation config's), and
    ``env.turn_stop``; a stop string the tokenizer cannot express is refused naming the key."""
    from tether.decoding.stops import turn_ends
    from tether.families.agent.options import turn_stop_of

    return turn_ends(tokenizer, turn_stop_of(cfg.env, cfg.data.chat_template), generation_eos=generation_eos)


def player_for(cfg: Any, engine: Any, tokenizer: Any, context: int | None, threads: EnvThreads,
               ends: TurnEnds) -> Player:
    """The recipe's episode player over ``engine`` (``context``: the model's positions, or None;
    ``ends``: what ends its turns, as the engine was built with)."""
    return Player(engine, tokenizer, environment_factory(cfg), limits_of(cfg, context), threads,
                  schedule=cfg.env.schedule, chat=cfg.data.chat_template,
                  whole_turns=cfg.env.switch_at == "turn", end_ids=ends.end_ids,
                  chat_options=chat_options(cfg) if cfg.data.chat_template else None)


def env_seed(position: int) -> int:
    """The environment seed of a task at ``position`` of the task stream; dynamic sampling's extra
    stream (positions −1 − p) seeds from 2^30 + p, so seeds stay non-negative (NumPy's) and apart."""
    return position if position >= 0 else 2**30 + (-1 - position)


def task_row(example) -> dict[str, Any]:
    """What ``reset`` receives: the row's prompt and answer and its other columns."""
    return {"prompt": example.prompt, "answer": example.answer, **example.fields}


class AgentSampler:
    """The tokenizer, the token engine, the environment threads and the episode player of one
    worker."""

    def __init__(self, cfg, model_path: str, stop_text: str, *, device, threads: int, seed: int) -> None:
        """``stop_text`` is the data bundle's copy of ``env.turn_stop``; the turn ends are resolved
        from the recipe (``turn_ends_of``), the same way the driver checked them."""
        from tether import registry
        from tether.decoding.stops import generation_eos_ids
        from tether.modeling import context_length, load_tokenizer, model_config

        self.cfg = cfg
        self.tokenizer = load_tokenizer(model_path)
        ends = turn_ends_of(cfg, self.tokenizer, generation_eos_ids(model_path))
        strings = {"stop_strings": ends.strings} if ends.strings else {}  # a plug-in may not take them
        self.engine = registry.engines.get(cfg.rollout.engine).build(
            cfg, model_path, self.tokenizer, ends.ids, device=device, threads=threads, seed=seed, **strings)
        self.threads = EnvThreads(cfg.env.workers)
        self.switches = not cfg.budget().drains
        self.turn_switches = 0
        """Turn-boundary switches of the batch being played, over every round of dynamic sampling."""
        """Weights may change while a batch is played (its switches are counted)."""
        self.player = player_for(cfg, self.engine, self.tokenizer, context_length(model_config(model_path)),
                                 self.threads, ends)

    def generate(self, item: WorkItem) -> EpisodeBatch:
        t0 = time.perf_counter()
        g = item.group_size
        self.turn_switches = 0
        if item.dynamic is None:
            groups, extra_metrics = self._groups(item, item.examples, 0), {}
        else:  # DAPO's filter on episode returns (tether.rollout.dynamic)
            from tether.rollout.dynamic import fill

            groups, extra_metrics = fill(len(item.examples), item.examples, item.extra_examples,
                                         lambda tasks, rnd: self._groups(item, tasks, rnd),
                                         item.dynamic, item.batch_index)
        episodes = [ep for group in groups for ep in group.samples]
        wall = time.perf_counter() - t0
        failure = self.cfg.env.failure_reward
        failed = [ep for ep in episodes if ep.failed]
        if len(failed) > self.cfg.env.max_failed_frac * len(episodes):
            first = failed[0]
            raise RolloutError(
                f"{len(failed)} of {len(episodes)} episodes of rollout batch {item.batch_index} "
                f"failed (env.max_failed_frac={self.cfg.env.max_failed_frac:g}); the first: "
                f"{first.status}: {first.error or 'no message'}. Fix the environment, or raise "
                "env.max_failed_frac / env.step_timeout_s",
                batch_index=item.batch_index,
            )
        samples = [(i, s) for i, ep in enumerate(episodes) for s in ep.samples()]
        batch = EpisodeBatch(
            positions=[group.position for group in groups],
            ids=[s.ids for _, s in samples],
            model=[s.model for _, s in samples],
            logprobs=[s.logprobs for _, s in samples],
            versions=[s.versions for _, s in samples],
            episode_of=[i for i, _ in samples],
            rewards=[ep.reward(failure) for ep in episodes],
            statuses=[ep.status for ep in episodes],
            turns=[ep.turns for ep in episodes],
            transcripts=[ep.transcript for ep in episodes],
            step_rewards=[ep.step_rewards for ep in episodes],
            errors=[ep.error for ep in episodes],
            group_size=g,
            turn_tokens=[ep.turn_tokens for ep in episodes],
            counts=[dict(ep.counts) for ep in episodes] if any(ep.counts for ep in episodes) else [],
            template_rewrites=[ep.template_rewrites for ep in episodes],
        )
        batch.metrics.update(self._metrics(episodes, batch, wall))
        batch.metrics.update(extra_metrics)
        return batch

    def _groups(self, item: WorkItem, tasks, round_: int):
        """Play G episodes of each of ``tasks`` ((position, example) pairs): one ``Group`` each, its
        samples the episodes and its rewards their returns. Round r > 0 of dynamic sampling plays
        with its own seed."""
        from tether.rollout.dynamic import Group

        g, failure = item.group_size, self.cfg.env.failure_reward
        rows = [(task_row(example), env_seed(position)) for position, example in tasks for _ in range(g)]
        seed = item.seed if round_ == 0 else item.seed * 7919 + round_
        episodes = self.player.play(rows, item.params, seed)
        self.turn_switches += self.player.turn_switches
        return [Group(position, example, [], episodes[i * g:(i + 1) * g],
                      [ep.reward(failure) for ep in episodes[i * g:(i + 1) * g]], [])
                for i, (position, example) in enumerate(tasks)]

    def _metrics(self, episodes: list[Episode], batch: EpisodeBatch, wall: float) -> dict[str, float]:
        n = len(episodes)
        rewards = batch.rewards
        mean = sum(rewards) / n
        model_tokens = [ep.model_tokens for ep in episodes]
        lengths = sorted(sum(len(s.ids) for s in ep.samples()) for ep in episodes)
        turns = [ep.turns for ep in episodes]
        env_s = [ep.env_s for ep in episodes]
        out = {
            "reward/mean": mean,
            "reward/std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / n),
            "reward/errors": float(sum(ep.failed for ep in episodes)),
            "response/length_mean": sum(model_tokens) / n,
            "response/truncated_frac": sum(ep.status in BUDGET_ENDINGS for ep in episodes) / n,
            "agent/turns_mean": sum(turns) / n,
            "agent/turns_max": float(max(turns)),
            "agent/success_frac": sum(ep.succeeded for ep in episodes) / n,
            "agent/action_errors": float(sum(ep.action_errors for ep in episodes)),
            **{f"agent/{key}": float(sum(ep.counts.get(key, 0) for ep in episodes)) for key in COUNTED},
            "agent/env_errors": float(sum(ep.status == "error" for ep in episodes)),
            "agent/timeouts": float(sum(ep.status == "timeout" for ep in episodes)),
            "agent/masked_failures": float(sum(ep.failed for ep in episodes)
                                           if self.cfg.env.on_failure == "mask" else 0),
            "agent/abandoned_calls": float(self.threads.abandoned),
            "agent/turn_truncated_frac": sum(ep.turn_truncations for ep in episodes) / max(sum(turns), 1),
            "agent/env_s_mean": sum(env_s) / n,
            "agent/env_s_max": max(env_s),
            "agent/model_tokens_mean": sum(model_tokens) / n,
            "agent/env_tokens_mean": sum(lengths) / n - sum(model_tokens) / n,
            "agent/rewrites": float(sum(ep.rewrites for ep in episodes)),
            "agent/template_rewrites": float(sum(ep.template_rewrites for ep in episodes)),
            "agent/episode_tokens_p50": float(statistics.median(lengths)),
            "agent/episode_tokens_p90": float(lengths[min(n - 1, int(0.9 * n))]),
            "agent/episode_tokens_max": float(lengths[-1]),
            "time/generate": wall,
            "time/score": 0.0,
            "throughput/gen_tokens_per_s": sum(model_tokens) / max(wall, 1e-9),
            "memory/rollout_peak_mb": peak_rss_mb(),
        }
        for status in (s for s in ENDINGS if s not in FAILURES):  # failures: env_errors, timeouts
            out[f"agent/ended_{status}_frac"] = sum(ep.status == status for ep in episodes) / n
        out["staleness/multi_version_seq_frac"] = sum(len(set(v)) > 1 for v in batch.episode_versions()) / n
        if self.switches:
            wasted, switches = self.engine.take_counts()
            out["rollout/weight_switches"] = float(switches + self.turn_switches)
            out["rollout/turn_boundary_switches"] = float(self.turn_switches)
            out.update(cache_metrics(batch.versions, self.cfg.budget().mode))
            out["rollout/wasted_tokens"] = float(wasted)
        out.update(self.engine.report())
        return out

    def close(self) -> None:
        self.threads.close()
