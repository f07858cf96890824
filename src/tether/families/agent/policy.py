"""The agent family as the learner sees it: an episode batch as the text family's training tensors,
with the loss mask on model tokens only.

A column is a token, as in the text family, so advantages (on the episode return), losses,
corrections and attribution are the same code; environment tokens are context, never actions.
"""

from __future__ import annotations

import logging

import torch

from tether.errors import RolloutError
from tether.families.agent.episodes import BUDGET_ENDINGS
from tether.families.agent.payload import EpisodeBatch
from tether.families.text.batch import TrainBatch
from tether.families.text.policy import TextPolicy

log = logging.getLogger("tether.train")


def to_train_batch(batch: EpisodeBatch, pad_id: int) -> TrainBatch:
    """Tensors for ``batch``, a row per sample: token j of a sample is predicted by column j − 1,
    which is in the loss exactly when token j was sampled by the engine. An episode of several
    samples (its history rewritten) gives each its return, and says so in ``episode``."""
    n = len(batch.ids)
    seqs = [ids or [pad_id] for ids in batch.ids]  # an episode whose reset failed has no tokens
    width = max(max(len(s) for s in seqs), 2)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width - 1))
    behavior = torch.zeros((n, width - 1))
    versions = torch.full((n, width - 1), -1, dtype=torch.long)
    for i, (seq, model, lps, vs) in enumerate(
        zip(seqs, batch.model, batch.logprobs, batch.versions, strict=True)
    ):
        ids[i, : len(seq)] = torch.as_tensor(seq)
        attn[i, : len(seq)] = 1
        if not model:
            continue
        if model[0]:
            raise RolloutError(f"sample {i} starts with a model token; it must start with an observation")
        flags = torch.as_tensor(model[1:], dtype=torch.bool)
        cols = slice(0, len(seq) - 1)
        mask[i, cols] = flags.float()
        behavior[i, cols] = torch.as_tensor(lps[1:], dtype=torch.float32) * flags
        versions[i, cols] = torch.where(flags, torch.as_tensor(vs[1:], dtype=torch.long), -1)
    if not torch.isfinite(behavior).all():
        raise RolloutError("the engine's log-probs contain non-finite values")
    of = torch.as_tensor(batch.episode_of, dtype=torch.long)
    truncated = torch.as_tensor([s in BUDGET_ENDINGS for s in batch.statuses], dtype=torch.bool)[of]
    return TrainBatch(
        ids,
        attn,
        ids[:, 1:],
        mask,
        behavior,
        torch.as_tensor(batch.rewards, dtype=torch.float32)[of],
        batch.group_size,
        versions,
        truncated,
        of if n != len(batch.rewards) else None,
    )


class AgentPolicy(TextPolicy):
    """The text family's policy over whole episodes (no shared-prompt forward: a group's episodes
    share only their first observation, and the loss mask has holes)."""

    def batch(self, payload: EpisodeBatch) -> TrainBatch:
        return to_train_batch(payload, self.pad_id)

    def fast_forward(self, model, enabled: bool):
        if enabled:
            log.info(
                "train.shared_prefix: a group's episodes share only their first observation; "
                "using the model's own forward"
            )
        return None
