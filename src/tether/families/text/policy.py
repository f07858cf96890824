"""The text family as the learner sees it (``tether.vocabulary.Policy``): a scored batch as
training tensors, each completion token's log-probability (and entropy) — a column is a token —
and the sampled KL estimators.

The learner's advantages, losses, corrections, aggregation, skipping rules and metrics are the
same for every family (``tether.families.flow.learn.FlowPolicy`` is the flow family's)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tether import registry
from tether.families.base import PolicyBase
from tether.families.text.batch import TrainBatch, to_train_batch, token_logprobs
from tether.modeling import load_causal_lm

log = logging.getLogger("tether.train")


class TextPolicy(PolicyBase):
    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.pad_id: int | None = None

    def load(self, path: str | Path, *, dtype: torch.dtype = torch.float32):
        model, tokenizer = load_causal_lm(path, dtype=dtype)
        self.pad_id = tokenizer.pad_token_id
        return model, tokenizer

    def save(self, model, tokenizer, folder: Path) -> None:
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)

    def batch(self, payload) -> TrainBatch:
        return to_train_batch(payload, self.pad_id)

    def forward(self, model, batch: TrainBatch, *, with_entropy: bool = False, forward=None):
        """(log-probs (n, L − 1), entropies or None, the KL's basis: the log-probs)."""
        logp, entropy = token_logprobs(model, batch, self.temperature, with_entropy=with_entropy,
                                       forward=forward)
        return logp, entropy, logp

    def kl(self, basis: torch.Tensor, ref_basis: torch.Tensor, estimator: str) -> torch.Tensor:
        return registry.kl_estimators.get(estimator)(basis, ref_basis)

    def fast_forward(self, model, enabled: bool):
        """The shared-prompt forward when asked for and the architecture has one, else None (the
        model's own forward); the choice is logged once."""
        from tether.decoding.prefix_forward import SharedPrefixForward, supports

        if not enabled:
            return None
        if not supports(model):
            log.info("train.shared_prefix: %s has no shared-prompt forward; using its own forward",
                     getattr(model.config, "model_type", type(model).__name__))
            return None
        return SharedPrefixForward(model)

    def layers(self, model) -> list[torch.nn.Module]:
        """The decoder layers: the module list of ``config.num_hidden_layers`` blocks (a Llama's or
        Qwen's ``model.layers``, GPT-2's ``transformer.h``), PEFT's adapters inside them."""
        count = model.config.num_hidden_layers
        lists = (m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count)
        return list(next(lists, []))

