"""Held-out evaluation at hard boundaries: greedy pass@1, and k samples per prompt.

Greedy decoding gives ``eval/pass_at_1`` (the share of prompts answered fully right) and
``eval/greedy_reward_mean``. Then k = ``eval.num_samples`` completions per prompt are sampled at
the rollout settings: ``eval/sampled_reward_mean`` is their mean reward (verl's mean@k),
``eval/sampled_pass_at_1`` the share of samples fully right, and with k > 1 ``eval/pass_at_k`` the
share of prompts with at least one of their k fully right (pass@k estimated from exactly k
samples: Chen et al. 2021's unbiased estimator with n = k).

It runs right after the drain and publish, on the trainer's model, whose weights are then exactly
the published ones, while the rollout workers are idle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from tether.data.rewards import Scorer
from tether.decoding.sampling import SamplingParams, sample, stepper_for, stop_ids_for
from tether.vocabulary import Example


class Evaluator:
    def __init__(self, model: torch.nn.Module, tokenizer, examples: Sequence[Example], score: Scorer, *,
                 stop_text: str, params: SamplingParams, seed: int = 0, num_samples: int = 1,
                 batch_size: int = 256, decoder: str = "auto") -> None:
        self.model = model
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.examples = list(examples)
        self.score = score
        self.params = params
        self.seed = seed
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.stop_ids = stop_ids_for(tokenizer, stop_text)
        self.prompts = [tokenizer(e.prompt, add_special_tokens=False).input_ids for e in self.examples]

    def _rewards(self, params: SamplingParams, seed: int, stepper, repeats: int = 1) -> list[float]:
        """Rewards of ``repeats`` completions of each prompt, prompt-major (N · repeats,)."""
        device = next(self.model.parameters()).device
        generator = torch.Generator(device=device).manual_seed(seed)
        per_call = max(1, self.batch_size // repeats)  # prompts per call; each prefilled once
        rewards = []
        for i in range(0, len(self.prompts), per_call):
            out = sample(self.model, self.prompts[i:i + per_call], params, stop_ids=self.stop_ids,
                         pad_id=self.tokenizer.pad_token_id, generator=generator, stepper=stepper,
                         samples_per_prompt=repeats)
            for j, toks in enumerate(out.tokens):
                example = self.examples[i + j // repeats]
                rewards.append(self.score(example, self.tokenizer.decode(toks, skip_special_tokens=True)))
        return rewards

    def __call__(self, step: int) -> Mapping[str, float]:
        was_training = self.model.training
        self.model.eval()
        try:
            # reads the weights once for both passes
            stepper = stepper_for(self.model, decoder=self.decoder)
            greedy = self._rewards(SamplingParams(max_new_tokens=self.params.max_new_tokens, temperature=0.0),
                                   self.seed, stepper)
            sampled = self._rewards(self.params, self.seed * 7919 + step, stepper, self.num_samples)
        finally:
            self.model.train(was_training)
        n, k = len(greedy), self.num_samples
        metrics = {"eval/pass_at_1": sum(r >= 1.0 for r in greedy) / n,
                   "eval/greedy_reward_mean": sum(greedy) / n,
                   "eval/sampled_reward_mean": sum(sampled) / (n * k),
                   "eval/sampled_pass_at_1": sum(r >= 1.0 for r in sampled) / (n * k),
                   "eval/examples": float(n)}
        if k > 1:
            metrics["eval/pass_at_k"] = sum(any(r >= 1.0 for r in sampled[i * k:(i + 1) * k])
                                            for i in range(n)) / n
            metrics["eval/num_samples"] = float(k)
        return metrics
