"""A scored rollout batch as training tensors, and per-token log-probs of a causal LM."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tether.decoding.vocab import entropy_of, scaled_logits
from tether.errors import ConfigError, RolloutError
from tether.families.text.payload import ScoredBatch


@dataclass(frozen=True)
class TrainBatch:
    """N = B·G sequences (prompt + completion), right-padded to length L.

    Token j of a sequence is predicted by position j − 1, so per-token tensors are (N, L − 1):
    column j − 1 holds token j's log-prob; ``mask`` marks completion tokens.
    """

    input_ids: torch.Tensor  # (N, L)
    attention_mask: torch.Tensor  # (N, L)
    targets: torch.Tensor  # (N, L − 1) the token each position predicts
    mask: torch.Tensor  # (N, L − 1) 1.0 on completion tokens
    behavior_logp: torch.Tensor  # (N, L − 1) log μ from the engine, 0 off the mask
    rewards: torch.Tensor  # (N,)
    group_size: int
    behavior_versions: torch.Tensor  # (N, L − 1) the policy version that sampled each token, −1 off the mask
    truncated: torch.Tensor  # (N,) bool: cut off at max_new_tokens (finish reason 'length')
    episode: torch.Tensor | None = None
    """(N,) long, non-decreasing: the episode each row belongs to, when an episode can span several
    rows (an agent episode whose environment rewrote its history). Rows of one episode share its
    reward and advantage, and ``group_size`` counts episodes. None: a row is a sample."""
    turn: torch.Tensor | None = None
    """(N, L − 1) long: the turn of its episode (0, 1, …) each loss column belongs to, −1 elsewhere
    and on rows left out of the advantages (an agent episode's failure under env.on_failure=mask).
    With it, advantages are computed per (group, turn) slice of ``turn_return`` (``tether.train.
    advantages.sliced_advantages``). None: one advantage per row, from ``rewards``."""
    turn_return: torch.Tensor | None = None
    """(N, L − 1) the return of each column's turn (0 where ``turn`` is −1)."""

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device) -> TrainBatch:
        """The same batch with every tensor on ``device``."""
        if self.input_ids.device == device:
            return self
        return TrainBatch(*(t.to(device) if isinstance(t, torch.Tensor) else t
                            for t in (getattr(self, f.name) for f in dataclasses.fields(self))))

    def rows(self, index: torch.Tensor | slice) -> TrainBatch:
        return TrainBatch(self.input_ids[index], self.attention_mask[index], self.targets[index],
                          self.mask[index], self.behavior_logp[index], self.rewards[index], self.group_size,
                          self.behavior_versions[index], self.truncated[index],
                          None if self.episode is None else self.episode[index],
                          None if self.turn is None else self.turn[index],
                          None if self.turn_return is None else self.turn_return[index])


def to_train_batch(scored: ScoredBatch, pad_id: int) -> TrainBatch:
    """Tensors for ``scored``; refuses a batch without the engine's log-probs."""
    n, g = len(scored.completion_ids), scored.group_size
    if not scored.logprobs or any(lp is None for lp in scored.logprobs):
        raise ConfigError("the rollout batch carries no engine log-probs, which the loss needs for its "
                          "ratio and corrections; the engine must return per-token log-probs")
    prompts = [scored.prompt_ids[i // g] for i in range(n)]
    seqs = [list(p) + list(c) for p, c in zip(prompts, scored.completion_ids, strict=True)]
    width = max(len(s) for s in seqs)
    ids = torch.full((n, width), pad_id, dtype=torch.long)  # (N, L)
    attn = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width - 1))
    behavior = torch.zeros((n, width - 1))
    versions = torch.full((n, width - 1), -1, dtype=torch.long)
    for i, (seq, p, lps, vs) in enumerate(zip(seqs, prompts, scored.logprobs, scored.versions, strict=True)):
        if len(lps) != len(seq) - len(p) or len(vs) != len(lps):
            raise RolloutError(f"sample {i}: {len(lps)} log-probs and {len(vs)} versions for "
                             f"{len(seq) - len(p)} completion tokens")
        ids[i, : len(seq)] = torch.as_tensor(seq)
        attn[i, : len(seq)] = 1
        start, end = len(p) - 1, len(seq) - 1
        mask[i, start:end] = 1.0
        behavior[i, start:end] = torch.as_tensor(lps, dtype=torch.float32)
        versions[i, start:end] = torch.as_tensor(vs, dtype=torch.long)
    if not torch.isfinite(behavior).all():
        raise RolloutError("the engine's log-probs contain non-finite values")
    truncated = torch.as_tensor([reason == "length" for reason in scored.finish_reasons], dtype=torch.bool)
    return TrainBatch(ids, attn, ids[:, 1:], mask, behavior,
                      torch.as_tensor(scored.rewards, dtype=torch.float32), g, versions, truncated)


def token_logprobs(model: torch.nn.Module, batch: TrainBatch, temperature: float,
                   *, with_entropy: bool = False, forward=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(token_j | tokens_<j) at ``temperature``, (N, L − 1); and entropy if asked.

    ``forward``: a ``SharedPrefixForward`` of ``model``, which computes the completion columns
    with each group's prompt run once (the other columns are then 0: only completion columns are
    ever used); None runs the model's own forward over every row, to the longest row's length."""
    if forward is not None:
        return forward(batch.input_ids, batch.attention_mask, batch.mask, temperature,
                       with_entropy=with_entropy)
    # rows are right-padded: a micro-batch runs to its own longest row, W ≤ L (causal attention
    # leaves every real position as it is), and its columns past W − 1 are 0, as off the mask. No
    # KV cache: nothing reads it, and a layer recomputed in the backward would fill it twice
    full = batch.input_ids.shape[1]
    width = min(max(int(batch.attention_mask.sum(1).max()), 2), full)
    logits = model(input_ids=batch.input_ids[:, :width], attention_mask=batch.attention_mask[:, :width],
                   use_cache=False).logits[:, :-1]
    logp_all = torch.log_softmax(scaled_logits(logits, temperature), dim=-1)  # (N, W − 1, V)
    logp = logp_all.gather(-1, batch.targets[:, : width - 1, None]).squeeze(-1)  # (N, W − 1)
    entropy = entropy_of(logp_all) if with_entropy else None
    if width < full:
        logp = torch.nn.functional.pad(logp, (0, full - width))  # (N, L − 1)
        entropy = None if entropy is None else torch.nn.functional.pad(entropy, (0, full - width))
    return logp, entropy
