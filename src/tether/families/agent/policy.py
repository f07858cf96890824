"""The agent family as the learner sees it: an episode batch as the text family's training tensors,
with the loss mask on model tokens only.

A column is a token, as in the text family, so advantages (on the episode return), losses,
corrections and attribution are the same code; environment tokens are context, never actions.
With ``env.credit=turn`` each model token also carries its turn and that turn's discounted return
(``TrainBatch.turn``, ``turn_return``); with ``env.on_failure=mask`` a failed episode's rows leave
the loss and the advantages.
"""

from __future__ import annotations

import logging

import torch

from tether.errors import RolloutError
from tether.families.agent.episode import BUDGET_ENDINGS, FAILURES
from tether.families.agent.payload import EpisodeBatch
from tether.families.text.batch import TrainBatch
from tether.families.text.policy import TextPolicy

log = logging.getLogger("tether.train")


def to_train_batch(batch: EpisodeBatch, pad_id: int, *, credit: str = "episode", gamma: float = 1.0,
                   mask_failures: bool = False) -> TrainBatch:
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
    turn = turn_return = None
    if credit == "turn" or mask_failures:
        turn, turn_return = turn_columns(batch, mask, credit=credit, gamma=gamma, mask_failures=mask_failures)
        mask = mask * (turn >= 0)  # a masked failure's rows leave the loss
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
        turn,
        turn_return,
    )


def turn_rewards(batch: EpisodeBatch) -> list[list[float]]:
    """Each episode's reward per turn: its ``step_rewards``, one per turn (a turn whose step did not
    return has 0), and for a failed episode its return (``batch.rewards``) at its last turn and 0
    before, so the rewards of every episode add up to its return."""
    out = []
    for e, turns in enumerate(batch.turn_tokens):
        k = len(turns)
        if batch.statuses[e] in FAILURES:
            out.append([0.0] * (k - 1) + [batch.rewards[e]] if k else [])
        else:
            steps = list(batch.step_rewards[e][:k])
            out.append(steps + [0.0] * (k - len(steps)))
    return out


def turn_columns(batch: EpisodeBatch, mask: torch.Tensor, *, credit: str, gamma: float,
                 mask_failures: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(turn, turn_return), each (N, L − 1): the turn of each loss column (−1 elsewhere and on a
    masked failure's rows) and R_t of that turn (``tether.train.advantages.turn_returns``). With
    ``credit=episode`` the whole episode is turn 0 and its return is R_0."""
    from tether.train.advantages import turn_returns

    if len(batch.turn_tokens) != len(batch.rewards):
        raise RolloutError("the episode batch does not say which tokens each turn sampled (turn_tokens)")
    rewards = turn_rewards(batch)
    if credit == "episode":
        rewards = [[batch.rewards[e]] for e in range(len(rewards))]
    k = max(max((len(r) for r in rewards), default=1), 1)
    r = torch.zeros(len(rewards), k)  # (E, K)
    present = torch.zeros(len(rewards), k, dtype=torch.bool)
    for e, row in enumerate(rewards):
        r[e, : len(row)] = torch.as_tensor(row, dtype=torch.float32)
        present[e, : len(row)] = True
    returns = turn_returns(r, present, gamma)  # (E, K)
    turn = torch.full(mask.shape, -1, dtype=torch.long)  # (N, L − 1)
    value = torch.zeros(mask.shape)
    done = [0] * len(rewards)  # model tokens of each episode placed so far, over its samples
    for i, e in enumerate(batch.episode_of):
        if mask_failures and batch.statuses[e] in FAILURES:
            continue
        cols = mask[i].nonzero().flatten()  # (n,) this row's model-token columns, in order
        ends = torch.as_tensor(batch.turn_tokens[e]).cumsum(0)  # (turns,)
        t = torch.bucketize(torch.arange(done[e], done[e] + len(cols)), ends, right=True)
        if len(cols) and int(t[-1]) >= len(batch.turn_tokens[e]):
            raise RolloutError(f"episode {e} has more model tokens than its turns sampled")
        done[e] += len(cols)
        t = t if credit == "turn" else torch.zeros_like(t)  # episode credit: one turn, R_0 its return
        turn[i, cols] = t
        value[i, cols] = returns[e, t]
    return turn, value


class AgentPolicy(TextPolicy):
    """The text family's policy over whole episodes (no shared-prompt forward: a group's episodes
    share only their first observation, and the loss mask has holes)."""

    def __init__(self, temperature: float, *, credit: str = "episode", gamma: float = 1.0,
                 mask_failures: bool = False) -> None:
        super().__init__(temperature)
        self.credit, self.gamma, self.mask_failures = credit, gamma, mask_failures

    def batch(self, payload: EpisodeBatch) -> TrainBatch:
        return to_train_batch(payload, self.pad_id, credit=self.credit, gamma=self.gamma,
                              mask_failures=self.mask_failures)

    def sliced_by_turn(self, batch: TrainBatch) -> bool:
        return batch.turn is not None

    def fast_forward(self, model, enabled: bool):
        if enabled:
            log.info(
                "train.shared_prefix: a group's episodes share only their first observation; "
                "using the model's own forward"
            )
        return None
