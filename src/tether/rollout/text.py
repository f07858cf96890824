"""The language-model family's side of a rollout worker: prompts tokenized, completions sampled
by the built-in engine or vLLM, decoded and scored, gathered into one ``ScoredBatch``."""

from __future__ import annotations

import math
import time

from tether.loop.scored import ScoredBatch
from tether.procinfo import peak_rss_mb
from tether.rollout.types import WorkItem


class TextSampler:
    """The tokenizer, the engine and the reward of one worker (``WorkerSpec``)."""

    def __init__(self, spec, device) -> None:
        from tether.data.rewards import scorer
        from tether.decoding.sampling import stop_ids_for
        from tether.modeling import load_tokenizer

        self.spec = spec
        self.tokenizer = load_tokenizer(spec.model_path)
        stop_ids = stop_ids_for(self.tokenizer, spec.stop_text)
        if spec.engine == "vllm":
            from tether.rollout.vllm_engine import VLLMEngine, VllmOptions

            self.engine = VLLMEngine(spec.model_path, stop_ids=stop_ids, device=device.type,
                                     options=spec.vllm or VllmOptions(), threads=spec.num_threads,
                                     seed=spec.seed)
        else:
            from tether.modeling import load_causal_lm
            from tether.rollout.torch_engine import TorchEngine

            model, _ = load_causal_lm(spec.model_path)
            self.engine = TorchEngine(model.to(device), pad_id=self.tokenizer.pad_token_id, stop_ids=stop_ids,
                                      decoder=spec.decoder)
        self.score = scorer(spec.reward, task=spec.task)

    def generate(self, item: WorkItem) -> ScoredBatch:
        t0 = time.perf_counter()
        self._score_s, self._errors = 0.0, 0
        if item.dynamic is None:
            groups, extra_metrics = self._groups(item, item.examples, 0), {}
        else:
            from tether.rollout.dynamic import fill

            groups, extra_metrics = fill(len(item.examples), item.examples, item.extra_examples,
                                         lambda prompts, rnd: self._groups(item, prompts, rnd),
                                         item.dynamic, item.batch_index)
        generate_s = time.perf_counter() - t0 - self._score_s
        batch = ScoredBatch(positions=[g.position for g in groups], prompt_ids=[g.prompt_ids for g in groups],
                            completion_ids=[], logprobs=[], versions=[], rewards=[],
                            finish_reasons=[], completions=[], group_size=item.group_size)
        for g in groups:
            for c, reward, text in zip(g.samples, g.rewards, g.texts, strict=True):
                batch.completion_ids.append(c.token_ids)
                batch.logprobs.append(c.logprobs)
                batch.versions.append(c.versions)
                batch.rewards.append(reward)
                batch.finish_reasons.append(c.finish_reason)
                batch.completions.append(text)
        n = len(batch.rewards)  # the pool checks the batch is whole when it arrives
        mean = sum(batch.rewards) / n
        tokens = sum(len(t) for t in batch.completion_ids)
        if self.spec.inflight_update != "drain":
            wasted, switches = self.engine.take_counts()
            batch.metrics.update({
                "rollout/weight_switches": float(switches),
                "rollout/wasted_tokens": float(wasted),
                "staleness/multi_version_seq_frac": sum(len(set(v)) > 1 for v in batch.versions) / n,
            })
        if self.spec.engine == "torch":  # which decoder sampled it (rollout.decoder)
            batch.metrics["rollout/native_decoder"] = float(self.engine.decoder_path == "native")
        batch.metrics.update({
            "reward/mean": mean,
            "reward/std": math.sqrt(sum((r - mean) ** 2 for r in batch.rewards) / n),
            "reward/errors": float(self._errors),
            "response/length_mean": tokens / n,
            "response/truncated_frac": batch.finish_reasons.count("length") / n,
            "time/generate": generate_s,
            "time/score": self._score_s,
            "throughput/gen_tokens_per_s": tokens / max(generate_s, 1e-9),
            "memory/rollout_peak_mb": peak_rss_mb(),
            **extra_metrics,
        })
        return batch

    def _groups(self, item: WorkItem, prompts, round_: int):
        """Generate and score ``prompts`` ((position, example) pairs): one ``Group`` each. Round
        r > 0 of dynamic sampling samples with its own seed."""
        from tether.rollout.dynamic import Group

        prompt_ids = [self.tokenizer(ex.prompt, add_special_tokens=False).input_ids for _, ex in prompts]
        seed = item.seed if round_ == 0 else item.seed * 7919 + round_
        sampled = self.engine.generate(prompt_ids, samples_per_prompt=item.group_size, params=item.params,
                                       seed=seed)
        t0 = time.perf_counter()
        groups = []
        for (position, example), ids, samples in zip(prompts, prompt_ids, sampled, strict=True):
            texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in samples]
            rewards = [self._reward(example, t) for t in texts]
            groups.append(Group(position, example, ids, list(samples), rewards, texts))
        self._score_s += time.perf_counter() - t0
        return groups

    def _reward(self, example, text: str) -> float:
        try:
            return self.score(example, text)
        except Exception:
            if self.spec.reward_on_error == "raise":
                raise
            self._errors += 1
            return 0.0


