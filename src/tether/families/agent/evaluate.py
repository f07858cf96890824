"""Held-out episodes at hard boundaries: greedy success and return, and k sampled episodes per task.

``eval/pass_at_1`` is the share of held-out tasks whose greedy episode earns a return ≥ 1
(success); ``eval/return_mean`` their mean return; ``eval/turns_mean`` their turns. Then k =
``eval.num_samples`` episodes per task at the rollout settings: ``eval/sampled_pass_at_1`` and
``eval/sampled_return_mean``. It plays on the trainer's model (the published weights) with the
built-in engine and the recipe's environment.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from tether.families.agent.envthreads import EnvThreads
from tether.families.agent.episode import Episode
from tether.vocabulary import Example, SamplingParams

log = logging.getLogger("tether.eval")


def turn_ends_in_memory(model, tokenizer, cfg: Any):
    """The recipe's turn ends for a loaded ``model`` (its generation config's end ids)."""
    from tether.decoding.stops import as_ids
    from tether.families.agent.sampler import turn_ends_of

    generation = model.generation_config  # None for a model that does not generate
    return turn_ends_of(cfg, tokenizer, as_ids(None if generation is None else generation.eos_token_id))


def eval_engine(model, tokenizer, cfg: Any, decoder: str = "auto"):
    """The built-in engine over ``model`` as it is now (held-out episodes, the warm start's
    checks), with the recipe's turn ends; build one per set of weights: it packs them once."""
    from tether.decoding.stops import StopStrings
    from tether.rollout.engines.torch.engine import TorchEngine

    ends = turn_ends_in_memory(model, tokenizer, cfg)
    return TorchEngine(model, pad_id=tokenizer.pad_token_id, stop_ids=ends.ids, decoder=decoder,
                       stop_strings=StopStrings(tokenizer, ends.strings) if ends.strings else None)


def play_tasks(engine, tokenizer, cfg: Any, examples: Sequence[Example], params: SamplingParams, *,
               seed: int, repeats: int = 1) -> list[Episode]:
    """``repeats`` episodes of each example, task-major, with ``engine``."""
    from tether.families.agent.sampler import player_for, task_row
    from tether.modeling import context_length

    threads = EnvThreads(cfg.env.workers)
    try:
        player = player_for(cfg, engine, tokenizer, context_length(engine.model.config.to_dict()), threads,
                            turn_ends_in_memory(engine.model, tokenizer, cfg))
        tasks = [(task_row(ex), -1 - i) for i, ex in enumerate(examples) for _ in range(repeats)]
        return player.play(tasks, params, seed)
    finally:
        threads.close()


class AgentEvaluator:
    def __init__(self, model, tokenizer, examples: Sequence[Example], cfg: Any, *, seed: int,
                 num_samples: int, decoder: str) -> None:
        self.model, self.tokenizer, self.examples, self.cfg = model, tokenizer, list(examples), cfg
        self.seed, self.num_samples, self.decoder = seed, num_samples, decoder

    def __call__(self, step: int) -> Mapping[str, float]:
        was_training = self.model.training
        self.model.eval()
        params = self.cfg.sampling()
        failure = self.cfg.env.failure_reward
        try:
            engine = eval_engine(self.model, self.tokenizer, self.cfg, self.decoder)  # the weights read once
            greedy = play_tasks(engine, self.tokenizer, self.cfg, self.examples,
                                SamplingParams(max_new_tokens=params.max_new_tokens, temperature=0.0),
                                seed=self.seed)
            sampled = play_tasks(engine, self.tokenizer, self.cfg, self.examples, params,
                                 seed=self.seed * 7919 + step, repeats=self.num_samples)
        finally:
            self.model.train(was_training)
        n, k = len(greedy), self.num_samples
        failed = [ep for ep in (*greedy, *sampled) if ep.failed]
        if failed:  # the share shows in the summary; the cause only here
            log.warning("%d of %d held-out episodes failed (env.failure_reward=%g each); the first: %s: %s",
                        len(failed), n * (1 + k), failure, failed[0].status, failed[0].error or "no message")
        returns = [ep.reward(failure) for ep in greedy]
        sampled_returns = [ep.reward(failure) for ep in sampled]
        return {
            "eval/pass_at_1": sum(ep.succeeded for ep in greedy) / n,
            "eval/return_mean": sum(returns) / n,
            "eval/turns_mean": sum(ep.turns for ep in greedy) / n,
            "eval/action_errors_mean": sum(ep.action_errors for ep in greedy) / n,
            "eval/failed_frac": sum(ep.failed for ep in greedy) / n,
            "eval/sampled_pass_at_1": sum(ep.succeeded for ep in sampled) / (n * k),
            "eval/sampled_return_mean": sum(sampled_returns) / (n * k),
            "eval/sampled_failed_frac": sum(ep.failed for ep in sampled) / (n * k),
            "eval/examples": float(n),
        }


PANELS = (
    ("episodes", (("agent/success_frac", "success"), ("agent/turns_mean", "turns (mean)"))),
    (
        "episode length (tokens)",
        (
            ("agent/episode_tokens_p50", "p50"),
            ("agent/episode_tokens_p90", "p90"),
            ("agent/episode_tokens_max", "max"),
            ("agent/model_tokens_mean", "model (mean)"),
            ("agent/env_tokens_mean", "environment (mean)"),
        ),
    ),
    ("environment seconds per episode", (("agent/env_s_mean", "mean"), ("agent/env_s_max", "max"))),
    (
        "per batch",
        (
            ("agent/action_errors", "action errors"),
            ("agent/env_errors", "environment errors"),
            ("agent/timeouts", "timeouts"),
        ),
    ),
)


def report_episodes(metrics: list[dict[str, Any]], out) -> Any:
    """``episodes.png``: success and turns, the episode-length tail, environment time and failures
    against trained batches."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    for ax, (title, series) in zip(axes.flat, PANELS, strict=True):
        for key, label in series:
            ax.plot(steps, [m.get(key, float("nan")) for m in metrics], label=label, lw=1)
        ax.set_title(title)
        ax.set_xlabel("trained batches")
        ax.legend(fontsize=8)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
