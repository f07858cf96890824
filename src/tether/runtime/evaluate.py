"""Held-out evaluation at hard boundaries: greedy pass@1 and the sampled mean reward.

It runs right after the drain and publish, on the trainer's model, whose weights are then exactly
the published ones, while the rollout workers are idle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from tether.data.rewards import Scorer
from tether.data.types import Example
from tether.decoding.sampling import SamplingParams, sample, stepper_for, stop_ids_for


class Evaluator:
    def __init__(self, model: torch.nn.Module, tokenizer, examples: Sequence[Example], score: Scorer, *,
                 stop_text: str, params: SamplingParams, seed: int = 0, batch_size: int = 256) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.examples = list(examples)
        self.score = score
        self.params = params
        self.seed = seed
        self.batch_size = batch_size
        self.stop_ids = stop_ids_for(tokenizer, stop_text)
        self.prompts = [tokenizer(e.prompt, add_special_tokens=False).input_ids for e in self.examples]

    def _rewards(self, params: SamplingParams, seed: int, stepper) -> list[float]:
        generator = torch.Generator().manual_seed(seed)
        rewards = []
        for i in range(0, len(self.prompts), self.batch_size):
            out = sample(self.model, self.prompts[i:i + self.batch_size], params, stop_ids=self.stop_ids,
                         pad_id=self.tokenizer.pad_token_id, generator=generator, stepper=stepper)
            for ex, toks in zip(self.examples[i:i + self.batch_size], out.tokens, strict=True):
                rewards.append(self.score(ex, self.tokenizer.decode(toks, skip_special_tokens=True)))
        return rewards

    def __call__(self, step: int) -> Mapping[str, float]:
        was_training = self.model.training
        self.model.eval()
        try:
            stepper = stepper_for(self.model)  # reads the weights once for both passes
            greedy = self._rewards(SamplingParams(max_new_tokens=self.params.max_new_tokens, temperature=0.0),
                                   self.seed, stepper)
            sampled = self._rewards(self.params, self.seed * 7919 + step, stepper)
        finally:
            self.model.train(was_training)
        n = len(greedy)
        return {"eval/pass_at_1": sum(r >= 1.0 for r in greedy) / n,
                "eval/greedy_reward_mean": sum(greedy) / n,
                "eval/sampled_reward_mean": sum(sampled) / n,
                "eval/examples": float(n)}
