"""The agent family (``model.family: agent``): causal language models acting over multi-turn
episodes against an environment (docs/agents.md). A sample is an episode; an action (a column of
the training tensors) is a token the model sampled — observation tokens are context only.

- ``env``: the environment protocol and the skyrl-gym / gymnasium adapters;
- ``episode``: one episode as played, the samples it becomes, how it ends, its budgets;
- ``episodes``: playing episodes token in, token out, with environment calls on threads;
- ``payload`` / ``policy``: the ``EpisodeBatch`` and its training tensors (loss on model tokens);
- ``sampler``: a rollout worker's side (engine, environment threads, metrics);
- ``tasks``: the built-in ``kv_lookup``, ``guess_number`` and ``tool_calc`` tasks with scripted
  transcripts;
- ``warmstart`` / ``evaluate``: fine-tuning on transcripts, and held-out episode success;
- ``options``: its recipe section, ``env``.

Staleness is the text family's: an episode is as old as its oldest model token, a group of G
episodes of one task is admitted, batched and budgeted as a prompt group is.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tether.control.inflight import INFLIGHT_UPDATE_CHOICES, TURN_SAFE, inflight_mode
from tether.errors import ConfigError
from tether.families.agent.options import EnvSection
from tether.families.text import TextFamily
from tether.vocabulary import Capabilities, DataBundle

NOT_YET = "not supported by the agent family yet"
TOOL_KEYS = ("tool_parser", "answer_reward", "malformed_call_reward", "max_tool_calls")
"""``env`` keys only a tool environment reads."""


class AgentFamily(TextFamily):
    name = "agent"
    description = (
        "language models over multi-turn environment episodes: a sample is an episode, an action a token"
    )
    section = ("env", EnvSection)
    keys = ("model.init_arch", "model.init_size", "plan.turns", "plan.env_time")
    capabilities = Capabilities(
        engine_kind="token",
        inflight_updates=INFLIGHT_UPDATE_CHOICES,
        features=frozenset(
            {
                "token_sampling",
                "decoder",
                "datasets",
                "truncation",
                "shared_prefix",
                "learner_ranks",
                "learner_actor",
                "lora",
                "mixed_precision",
                "token_budget",
                "dynamic_sampling",
            }
        ),
        notes={"attribution": NOT_YET},
    )
    warmstart_fields = ("loss", "pass_at_1")
    records = "episodes.jsonl"  # a line an episode (EpisodeBatch.sample_lines)

    def check(self, cfg: Any) -> None:
        e = cfg.env
        if not e.env_class and not cfg.data.task:
            raise ConfigError(
                "model.family=agent needs an environment: set env.env_class to path/to/file.py:Class "
                "(with data.dataset for its task rows), or data.task to kv_lookup, guess_number or tool_calc"
            )
        if e.switch_at == "turn" and inflight_mode(cfg.async_.inflight_update).turn_mode is None:
            raise ConfigError("env.switch_at=turn takes up published weights between turns, which needs "
                              f"async.inflight_update={' or '.join(TURN_SAFE)} (it is "
                              f"{cfg.async_.inflight_update}); set one, or env.switch_at=token")
        if e.max_episode_tokens and e.max_turn_tokens and e.max_turn_tokens >= e.max_episode_tokens:
            raise ConfigError(
                f"env.max_turn_tokens={e.max_turn_tokens} leaves no room for an observation in "
                f"env.max_episode_tokens={e.max_episode_tokens}; lower the first or raise the second"
            )
        check_credit(cfg)
        from tether.families.agent.sampler import environment_factory, is_tool_env

        made = environment_factory(cfg)  # refuses a non-environment, or arguments its constructor cannot take
        if not is_tool_env(made.env_class):
            default = EnvSection()
            unread = [f"env.{k}={getattr(e, k)}" for k in TOOL_KEYS if getattr(e, k) != getattr(default, k)]
            if unread:
                raise ConfigError(f"{', '.join(unread)} configure a tool environment, but "
                                  f"{made.name} is not one; leave them at their defaults, or set env.tools "
                                  "(the built-in tool environment) or an env.env_class subclassing ToolEnv")

    def drains_at_turns(self, cfg: Any) -> bool:
        """``drain`` with ``env.switch_at=turn`` (``InflightMode.turn_mode``): a publication waits
        for the turns in flight."""
        return inflight_mode(cfg.async_.inflight_update).drains and cfg.env.switch_at == "turn"

    def longest_sequence(self, cfg: Any) -> tuple[int | None, str]:
        """An episode's sequence, observations included: env.max_episode_tokens (0 = the model's
        context, which the recipe does not know)."""
        bound = cfg.env.max_episode_tokens
        return bound or None, f"env.max_episode_tokens={bound}" if bound else "env.max_episode_tokens"

    def norm_constant(self, cfg: Any) -> int:
        """The most model tokens an episode can have."""
        return cfg.env.max_turns * (cfg.env.max_turn_tokens or cfg.rollout.max_new_tokens)

    def build_model(self, cfg: Any, out: Path, on_progress) -> str:
        import logging
        import shutil

        from tether.data.tiny_model import init_model
        from tether.families.agent.warmstart import run_agent_warmstart

        init = out.parent / f"{out.name}.init"
        try:
            # a recipe that renders turns with a chat template gets a chat model (tiny_model.CHATML_TEMPLATE)
            chat = cfg.data.chat_template
            info = init_model(init, arch=cfg.model.init_arch, size=cfg.model.init_size, seed=cfg.run.seed,
                              chat=chat)
            logging.getLogger("tether.data").info(
                "built a %s %s%s model (%d parameters); warm-starting it on scripted transcripts",
                cfg.model.init_size,
                cfg.model.init_arch,
                " chat" if chat else "",
                info.parameters,
            )
            warm = run_agent_warmstart(cfg, init, out, on_progress)
            shutil.copy2(init / "tether_model.json", out / "tether_model.json")
        finally:
            shutil.rmtree(init, ignore_errors=True)
        return (
            f"warm start: held-out episode success {100 * warm.pass_at_1_before:.1f}% → "
            f"{100 * warm.pass_at_1_after:.1f}% in {warm.steps} steps, {warm.seconds:.0f}s"
        )

    def warmstart(self, cfg: Any, model_dir: Path, out: Path, on_progress):
        from tether.families.agent.warmstart import run_agent_warmstart

        return run_agent_warmstart(cfg, model_dir, out, on_progress)

    def scorer(self, cfg: Any) -> Any:
        return None  # an episode's reward comes from its environment

    def data(self, cfg: Any, model_path: Path) -> DataBundle:
        """The task rows: a built-in agent task's, or a dataset's (each row passed to ``reset``).
        Refuses token budgets the model's context cannot hold (``check_context``) first."""
        from dataclasses import replace

        from tether.modeling import context_length, model_config

        check_context(cfg, context_length(model_config(model_path)), model_path)

        # data.chat_template renders observations here (the player), not the rows' prompts
        plain = replace(cfg, data=replace(cfg.data, chat_template=False))
        bundle = super().data(plain, model_path)
        from tether.decoding.stops import generation_eos_ids
        from tether.families.agent.options import turn_stop_of
        from tether.families.agent.sampler import turn_ends_of
        from tether.modeling import load_tokenizer

        # a stop string the tokenizer cannot express is refused here, before any worker starts
        turn_ends_of(cfg, load_tokenizer(model_path), generation_eos_ids(model_path))
        return replace(bundle, stop_text=turn_stop_of(cfg.env, cfg.data.chat_template))

    def sampler(self, cfg: Any, model_path: str, stop_text: str, *, device: Any, threads: int, seed: int):
        from tether.families.agent.sampler import AgentSampler

        return AgentSampler(cfg, model_path, stop_text, device=device, threads=threads, seed=seed)

    def policy(self, cfg: Any):
        from tether.families.agent.policy import AgentPolicy

        e = cfg.env
        return AgentPolicy(cfg.rollout.temperature, credit=e.credit, gamma=e.gamma,
                           mask_failures=e.on_failure == "mask")

    def evaluator(
        self,
        cfg: Any,
        model: Any,
        tokenizer: Any,
        data: DataBundle,
        score: Any,
        *,
        num_samples: int | None = None,
        run_dir: Path | None = None,
    ):
        from tether.families.agent.evaluate import AgentEvaluator

        k = cfg.eval.num_samples if num_samples is None else num_samples
        return AgentEvaluator(
            model, tokenizer, data.eval, cfg, seed=cfg.eval_seed, num_samples=k, decoder=cfg.rollout.decoder
        )

    def eval_summary(self, cfg: Any, metrics: Mapping[str, float], samples: int) -> list[str]:
        return [
            f"  greedy:  success {metrics['eval/pass_at_1']:.1%}, mean return "
            f"{metrics['eval/return_mean']:.3f}, {metrics['eval/turns_mean']:.2f} turns, "
            f"failed {metrics['eval/failed_frac']:.1%}",
            f"  sampled: success {metrics['eval/sampled_pass_at_1']:.1%}, mean return "
            f"{metrics['eval/sampled_return_mean']:.3f}, failed {metrics['eval/sampled_failed_frac']:.1%}  "
            f"({samples} per task at temperature {cfg.rollout.temperature:g})",
        ]

    def report(self, run_dir: Path, evals: list[dict[str, Any]], out: Path) -> list[Path]:
        """``episodes.png``: success, turns, the episode-length tail, environment time and failures."""
        from tether.families.agent.evaluate import report_episodes
        from tether.runtime.report import _read_jsonl

        rows = [r for r in _read_jsonl(run_dir / "metrics.jsonl") if "agent/turns_mean" in r]
        return [report_episodes(rows, out / "episodes.png")] if rows else []


def check_credit(cfg: Any) -> None:
    """Refuse what per-turn credit and masked failures cannot honour, naming the keys."""
    from tether import registry

    e, t = cfg.env, cfg.train
    if e.credit == "episode" and e.gamma != 1.0:
        raise ConfigError(f"env.gamma={e.gamma:g} discounts turn rewards, which only env.credit=turn reads; "
                          "set env.credit=turn, or leave env.gamma at 1")
    sliced = e.credit == "turn" or e.on_failure == "mask"
    if sliced and cfg.reward.overlong_buffer:
        raise ConfigError("reward.overlong_buffer shapes an episode's return, which advantages per turn "
                          f"or with failures masked (env.credit={e.credit}, env.on_failure={e.on_failure}) "
                          "do not read; set reward.overlong_buffer=0, or env.credit=episode and "
                          "env.on_failure=score")
    if e.credit != "turn":
        return
    loss = registry.losses.canonical(t.loss)
    if loss not in ("ppo_clip", "cispo"):
        raise ConfigError(f"env.credit=turn gives each token its turn's advantage, which train.loss={t.loss} "
                          "does not take (gspo clips the whole sequence on one advantage; a plug-in's loss "
                          "is written for one per sequence); set train.loss=ppo_clip or cispo, or "
                          "env.credit=episode")
    if t.adv_scope != "group" or t.advantage == "reinforce_pp":
        raise ConfigError(f"env.credit=turn compares each turn with the same turn of its group's other "
                          f"episodes; train.advantage={t.advantage} with train.adv_scope={t.adv_scope} uses "
                          "a baseline over the whole batch; set train.advantage=grpo or rloo with "
                          "train.adv_scope=group, or env.credit=episode")


FAMILY = AgentFamily()


def check_context(cfg: Any, context: int | None, model_path: Any) -> None:
    """Refuse (``ConfigError``) an ``env.max_episode_tokens`` past the model's ``context`` (its
    config's positions; None: unknown, nothing to check), or a turn budget (``env.max_turn_tokens``,
    else ``rollout.max_new_tokens``) that leaves no room for an observation in what an episode may
    hold, so the run stops before it starts rather than mid-rollout."""
    if context is None:
        return
    e = cfg.env
    where = f"the model's context of {context} positions ({model_path})"
    if e.max_episode_tokens > context:
        raise ConfigError(f"env.max_episode_tokens={e.max_episode_tokens} is more than {where}; lower it "
                          f"to at most {context}, or set 0 (the model's context)")
    episode = e.max_episode_tokens or context
    turn, key = (e.max_turn_tokens, "env.max_turn_tokens") if e.max_turn_tokens else (
        cfg.rollout.max_new_tokens, "rollout.max_new_tokens (env.max_turn_tokens=0)")
    if turn >= episode:
        held = f"env.max_episode_tokens={episode}" if e.max_episode_tokens else where
        raise ConfigError(f"{key.split(' ')[0]}={turn} leaves no room for an observation in {held}; lower "
                          f"{key}" + ("" if e.max_episode_tokens else " below the context"))
