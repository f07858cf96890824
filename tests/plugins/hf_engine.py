"""A third engine, defined outside Tether as a maintainer would add one: transformers' own
``generate``, with its log-probs computed here by a second forward over prompt and completion.

It follows docs/architecture.md's "Adding an engine" step by step:

1. the engine: a ``tether.vocabulary.TokenEngine`` (``HFEngine``; ``ModelEngine`` gives it the
   version, ``bind``/``load_weights`` and the in-flight ``watch`` it never needs);
2. its section: a frozen dataclass of ``knob`` fields (``hf.batch_prompts``);
3. its plug-in: a ``tether.EnginePlugin`` declaring its kind (token), what it supports (drain
   only: ``generate`` cannot switch weights between steps; no LoRA; the CPU; float32, read from
   ``rollout.dtype`` as the built-in engine does, so ``rollout.dtype=bfloat16`` is refused), its checks (it
   samples at a temperature alone, so top-k/top-p are refused at load) and ``build``;
4. ``tether.register_engine``; a recipe names this file in ``run.plugins`` and sets
   ``rollout.engine: hf``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tether
from tether.config.fields import knob

# -- 1. the engine ------------------------------------------------------------------------------


def _engine_class():
    """Defined on first build, so that loading the plug-in (in every process) imports no torch."""
    import torch

    from tether.rollout.engines import check_context
    from tether.rollout.model_engine import ModelEngine
    from tether.vocabulary import Completion, SamplingParams

    class HFEngine(ModelEngine):
        """Samples with ``model.generate``; μ = softmax(logits / T) of a forward over the sequence."""

        def __init__(self, model: Any, *, stop_ids: Sequence[int], pad_id: int, use_cache: bool) -> None:
            super().__init__(model)
            self.stop_ids, self.pad_id, self.use_cache = list(stop_ids), pad_id, use_cache
            self.max_positions = getattr(model.config, "max_position_embeddings", None)

        def take_counts(self) -> tuple[int, int]:
            return 0, 0  # drain only: nothing aborted, no switch mid-generation

        def report(self) -> dict[str, float]:
            return {}

        def generate(self, prompts: Sequence[Sequence[int]], *, samples_per_prompt: int,
                     params: SamplingParams, seed: int) -> list[list[Completion]]:
            check_context(prompts, params, self.max_positions)
            out = []
            for i, prompt in enumerate(prompts):
                torch.manual_seed(seed * 100_003 + i)  # the same seed, weights and prompt: the same tokens
                ids = torch.tensor([list(prompt)], device=self.device)  # (1, P)
                with torch.no_grad():
                    seqs = self.model.generate(
                        ids, attention_mask=torch.ones_like(ids), do_sample=True,
                        temperature=params.temperature, top_k=0, top_p=1.0,
                        max_new_tokens=params.max_new_tokens, num_return_sequences=samples_per_prompt,
                        eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
                        use_cache=self.use_cache)  # (G, P + N)
                out.append([self._completion(seq, len(prompt), params.temperature) for seq in seqs])
            return out

        def _completion(self, seq: Any, prompt_len: int, temperature: float) -> Any:
            tokens = seq[prompt_len:].tolist()
            finish = "length"
            for n, tok in enumerate(tokens):
                if tok in self.stop_ids:
                    tokens, finish = tokens[:n + 1], "stop"
                    break
            whole = seq[:prompt_len + len(tokens)][None]  # (1, P + n)
            with torch.no_grad():
                logits = self.model(whole).logits[0, prompt_len - 1:-1].float()  # (n, V)
            logp = torch.log_softmax(logits / temperature, dim=-1)
            chosen = logp.gather(1, torch.tensor(tokens, device=self.device)[:, None])[:, 0]
            versions = [self.version] * len(tokens)
            return Completion(token_ids=tokens, logprobs=chosen.tolist(), versions=versions,
                              finish_reason=finish)

    return HFEngine


# -- 2. its section ---------------------------------------------------------------------------


@dataclass(frozen=True)
class HFSection:
    """The transformers-generate engine (used when rollout.engine=hf; a test plug-in)."""

    use_cache: bool = knob(True, "Use the KV cache in generate (false: every step runs the whole sequence "
                                 "again; slower, the same tokens).")


# -- 3. its plug-in ---------------------------------------------------------------------------


class HFPlugin(tether.EnginePlugin):
    def check(self, cfg: Any) -> None:
        r = cfg.rollout
        if r.top_k or r.top_p != 1.0:
            raise tether.ConfigError(f"rollout.engine=hf samples at rollout.temperature alone; remove "
                                     f"rollout.top_k={r.top_k} / rollout.top_p={r.top_p}")

    def build(self, cfg: Any, model_path: str, tokenizer: Any, stop_ids: Sequence[int], *, device: Any,
              threads: int, seed: int) -> Any:
        from tether.modeling import load_causal_lm

        model, _ = load_causal_lm(model_path)
        return _engine_class()(model.to(device), stop_ids=stop_ids, pad_id=tokenizer.pad_token_id,
                               use_cache=cfg.section("hf").use_cache)


HF = HFPlugin("hf", kinds=frozenset({"token"}), section=("hf", HFSection), inflight_updates=("drain",),
              lora=False, devices=("cpu",), dtypes=("float32",), dtype_key="rollout.dtype",
              notes={"inflight_updates": "transformers' generate runs a whole generation at once",
                     "lora": "it samples from whole weights",
                     "dtypes": "it samples at the learner's float32 precision"})

# -- 4. registered ------------------------------------------------------------------------------

tether.register_engine(HF)
