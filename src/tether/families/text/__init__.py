"""The text family (``model.family: text``): causal language models. A sample is a completion of
a prompt; an action (a column of the training tensors) is a completion token.

- ``sampler``: a rollout worker's tokenizer, token engine (built-in or vLLM) and reward;
- ``payload``: the scored batch it sends (``ScoredBatch``);
- ``batch`` / ``policy``: the learner's side (token log-probs, the shared-prompt forward);
- ``evaluate``: held-out greedy pass@1 and sampled pass@k;
- ``warmstart``: supervised fine-tuning on demonstrations before RL.

The engines it samples with are plug-ins of their own (``tether.rollout.engines``), as are the
tasks (``tether.data.tasks``) and rewards (``tether.data.rewards``) it reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tether.control.inflight import INFLIGHT_UPDATE_CHOICES
from tether.families.base import FamilyBase
from tether.vocabulary import Capabilities, DataBundle, Progress

ALL_FEATURES = frozenset({"token_sampling", "decoder", "dynamic_sampling", "truncation", "shared_prefix",
                          "datasets", "attribution", "learner_ranks", "learner_actor", "lora",
                          "mixed_precision", "token_budget"})


class TextFamily(FamilyBase):
    name = "text"
    description = "causal language models: a sample is a completion, an action a token"
    keys = ("model.init_arch", "model.init_size", "reward.function", "reward.functions", "reward.weights",
            "reward.on_error")
    capabilities = Capabilities(engine_kind="token",
                                inflight_updates=INFLIGHT_UPDATE_CHOICES,
                                features=ALL_FEATURES)
    warmstart_fields = ("loss", "pass_at_1")

    def longest_sequence(self, cfg: Any) -> tuple[int | None, str]:
        """A prompt (after any chat template) and a completion, each at its bound."""
        d, r = cfg.data, cfg.rollout
        return d.max_prompt_tokens + r.max_new_tokens, (f"data.max_prompt_tokens={d.max_prompt_tokens} + "
                                                        f"rollout.max_new_tokens={r.max_new_tokens}")

    def build_model(self, cfg: Any, out: Path, on_progress: Progress | None) -> str:
        import logging
        import shutil

        from tether.data.tiny_model import init_model
        from tether.families.text.warmstart import run_warmstart

        init = out.parent / f"{out.name}.init"  # the untrained model, removed once warm-started
        try:
            info = init_model(init, arch=cfg.model.init_arch, size=cfg.model.init_size, seed=cfg.run.seed)
            logging.getLogger("tether.data").info("built a %s %s model (%d parameters); warm-starting it",
                                                  cfg.model.init_size, cfg.model.init_arch, info.parameters)
            warm = run_warmstart(cfg, init, out, on_progress)
            shutil.copy2(init / "tether_model.json", out / "tether_model.json")
        finally:
            shutil.rmtree(init, ignore_errors=True)
        return (f"warm start: held-out pass@1 {100 * warm.pass_at_1_before:.1f}% → "
                f"{100 * warm.pass_at_1_after:.1f}% in {warm.steps} steps, {warm.seconds:.0f}s")

    def warmstart(self, cfg: Any, model_dir: Path, out: Path, on_progress: Progress | None):
        """``tether warmstart``: fine-tune the model in ``model_dir`` on the recipe's data."""
        from tether.families.text.warmstart import run_warmstart

        return run_warmstart(cfg, model_dir, out, on_progress)

    def scorer(self, cfg: Any) -> Any:
        from tether.data.rewards import scorer, scorer_of

        return scorer_of(cfg, lambda spec: scorer(spec, task=cfg.data.task or None))

    def data(self, cfg: Any, model_path: Path) -> DataBundle:
        """The recipe's examples, each prompt checked against the model's context: what
        ``rollout.max_new_tokens`` leaves of it bounds a prompt (``data.on_long_prompt``), so no
        prompt fails in a worker mid-run."""
        from tether.data.source import resolve_data
        from tether.errors import ConfigError
        from tether.modeling import context_length, load_tokenizer, model_config

        tokenizer = load_tokenizer(model_path)
        context, new = context_length(model_config(model_path)), cfg.rollout.max_new_tokens
        if context is None:
            return resolve_data(cfg.data, tokenizer, seed=cfg.run.seed, eval_seed=cfg.eval_seed)
        if new >= context:
            raise ConfigError(f"rollout.max_new_tokens={new} leaves no room for a prompt in the model's "
                              f"context of {context} positions ({model_path}); lower rollout.max_new_tokens")
        why = (f"the {context - new} tokens the model's context of {context} positions leaves after "
               f"rollout.max_new_tokens={new}")
        return resolve_data(cfg.data, tokenizer, seed=cfg.run.seed, eval_seed=cfg.eval_seed,
                            room=context - new, room_why=why)

    def sampler(self, cfg: Any, model_path: str, stop_text: str, *, device: Any, threads: int, seed: int):
        from tether.families.text.sampler import TextSampler

        return TextSampler(cfg, model_path, stop_text, device=device, threads=threads, seed=seed)

    def policy(self, cfg: Any):
        from tether.families.text.policy import TextPolicy

        return TextPolicy(cfg.rollout.temperature)

    def evaluator(self, cfg: Any, model: Any, tokenizer: Any, data: DataBundle, score: Any, *,
                  num_samples: int | None = None, run_dir: Path | None = None):
        from tether.families.text.evaluate import Evaluator

        k = cfg.eval.num_samples if num_samples is None else num_samples
        return Evaluator(model, tokenizer, data.eval, score, stop_text=data.stop_text, params=cfg.sampling(),
                         seed=cfg.eval_seed, num_samples=k, decoder=cfg.rollout.decoder)

    def eval_summary(self, cfg: Any, metrics: Mapping[str, float], samples: int) -> list[str]:
        lines = [f"  greedy:  pass@1 {metrics['eval/pass_at_1']:.1%}, mean reward "
                 f"{metrics['eval/greedy_reward_mean']:.3f}"]
        line = (f"  sampled: pass@1 {metrics['eval/sampled_pass_at_1']:.1%}, mean reward "
                f"{metrics['eval/sampled_reward_mean']:.3f}")
        if samples > 1:
            line += f", pass@{samples} {metrics['eval/pass_at_k']:.1%}"
        return [*lines, line + f"  ({samples} per prompt at temperature {cfg.rollout.temperature:g})"]


FAMILY = TextFamily()
