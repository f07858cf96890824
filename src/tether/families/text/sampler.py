"""The text family's side of a rollout worker: prompts tokenized, completions sampled
by the built-in engine or vLLM, decoded and scored, gathered into one ``ScoredBatch``."""

from __future__ import annotations

import math
import time

from tether.control.inflight import cache_metrics
from tether.data.rewards import score_all
from tether.families.text.payload import ScoredBatch
from tether.procinfo import peak_rss_mb
from tether.vocabulary import WorkItem


class TextSampler:
    """The tokenizer, the token engine (``rollout.engine``) and the reward of one worker."""

    def __init__(self, cfg, model_path: str, stop_text: str, *, device, threads: int, seed: int) -> None:
        from tether import registry
        from tether.decoding.sampling import stop_ids_for
        from tether.modeling import load_tokenizer

        self.cfg = cfg
        self.tokenizer = load_tokenizer(model_path)
        stop_ids = stop_ids_for(self.tokenizer, stop_text)
        self.engine = registry.engines.get(cfg.rollout.engine).build(
            cfg, model_path, self.tokenizer, stop_ids, device=device, threads=threads, seed=seed)
        self.score = cfg.family().scorer(cfg)
        self.switches = cfg.budget().mode.switches
        """The engine switches weights mid-generation: each batch reports how often, and its waste."""

    def close(self) -> None:
        """Nothing to release besides the engine."""

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
                            finish_reasons=[], completions=[], group_size=item.group_size,
                            prompts=[g.example.prompt for g in groups],
                            answers=[g.example.answer for g in groups])
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
        if self.switches:
            wasted, switches = self.engine.take_counts()
            batch.metrics.update({
                "rollout/weight_switches": float(switches),
                "rollout/wasted_tokens": float(wasted),
                "staleness/multi_version_seq_frac": sum(len(set(v)) > 1 for v in batch.versions) / n,
                **cache_metrics(batch.versions, self.cfg.budget().mode),
            })
        batch.metrics.update(self.engine.report())
        batch.metrics.update(self.score.take_parts())  # reward.functions: each part's mean
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
        texts = [[self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in samples]
                 for samples in sampled]
        pairs = [(example, text)
                 for (_, example), group in zip(prompts, texts, strict=True) for text in group]
        rewards, errors = score_all(self.score, pairs, on_error=self.cfg.reward.on_error)
        self._errors += errors
        g = item.group_size
        groups = [Group(position, example, ids, list(samples), rewards[i * g:(i + 1) * g], group_texts)
                  for i, ((position, example), ids, samples, group_texts)
                  in enumerate(zip(prompts, prompt_ids, sampled, texts, strict=True))]
        self._score_s += time.perf_counter() - t0
        return groups
