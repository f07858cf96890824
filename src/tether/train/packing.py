"""Micro-batches of a mini-batch packed by a token budget (``train.max_tokens_per_micro_batch``).

A fixed count of sequences per micro-batch (``train.micro_batch_size``) either wastes memory on
short sequences or runs out on long ones when lengths have a long tail. Packing by tokens puts
many short sequences in one forward and a long one nearly alone, with every forward about the
same size. How the micro-batches are made does not change the update: the loss of each is
normalised by the whole mini-batch's counts (``losses.aggregate``'s ``total_tokens`` /
``total_seqs``), so their gradients sum to the mini-batch's whatever the split.

What a micro-batch costs is what its forward computes:

- the model's own forward lays its rows out as a grid padded to its longest row, so a
  micro-batch of n rows costs n × its longest row (padding included);
- the shared-prompt forward (``tether.decoding.prefix_forward``) computes each group's prompt
  once and only the real completion tokens, so a prompt group's rows go into one micro-batch
  together (a *unit*) costing its prompt once plus each completion. A group over the budget is
  cut into consecutive runs that fit, each with its prompt (that forward treats any run of
  adjacent rows with one prompt as a group).

Units are placed longest first, each into the first micro-batch it fits (first-fit
decreasing); a unit over the budget on its own (a row longer than the budget, which a checked
recipe cannot produce) gets a micro-batch to itself. Rows come back in ascending order inside
each micro-batch, so a group's rows stay adjacent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Unit:
    """Rows that go into one micro-batch together."""

    rows: tuple[int, ...]  # global row indices, ascending
    tokens: int  # what the shared-prompt forward computes for them: the prompt once, each completion
    width: int  # the longest row's tokens


def _cost(units: Sequence[Unit], padded: bool) -> int:
    if padded:  # rows × the longest row
        return sum(len(u.rows) for u in units) * max(u.width for u in units)
    return sum(u.tokens for u in units)


def pack(units: Sequence[Unit], budget: int, *, padded: bool) -> list[list[int]]:
    """First-fit decreasing: each unit, most expensive first, into the first micro-batch whose cost
    stays within ``budget`` with it (``padded``: rows × longest row; else the units' tokens), or
    into a new one. Returns each micro-batch's rows, ascending."""
    order = sorted(units, key=lambda u: (-_cost([u], padded), u.rows[0]))
    bins: list[list[Unit]] = []
    for unit in order:
        for held in bins:
            if _cost([*held, unit], padded) <= budget:
                held.append(unit)
                break
        else:
            bins.append([unit])
    return [sorted(r for u in held for r in u.rows) for held in bins]


def units(rows: Sequence[int], lengths: Sequence[int], budget: int, *, prompts: Sequence[int] | None = None,
          groups: Sequence[int] | None = None) -> list[Unit]:
    """The units of ``rows`` (global indices, ascending): each row alone, or with ``prompts`` and
    ``groups`` (each row's prompt length and prompt group, indexed by global row) the runs of a
    group's rows, cut where a run would exceed ``budget`` (prompt once plus completions)."""
    if prompts is None or groups is None:
        return [Unit((r,), lengths[r], lengths[r]) for r in rows]
    out: list[Unit] = []
    run: list[int] = []
    tokens = 0
    for r in rows:
        completion = lengths[r] - prompts[r]
        same = run and groups[run[-1]] == groups[r]
        if same and tokens + completion <= budget:
            run.append(r)
            tokens += completion
            continue
        if run:
            out.append(Unit(tuple(run), tokens, max(lengths[i] for i in run)))
        run, tokens = [r], lengths[r]
    if run:
        out.append(Unit(tuple(run), tokens, max(lengths[i] for i in run)))
    return out


def lengths_of(tb) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's real tokens (prompt + completion) and prompt length, (N,) each, of a right-padded
    token batch (``TrainBatch``): the prompt ends where the first loss column predicts from, or is
    the whole row when nothing of it is in the mask."""
    seq_len = tb.attention_mask.sum(1)
    has_completion = tb.mask.sum(1) > 0
    return seq_len, torch.where(has_completion, tb.mask.argmax(1) + 1, seq_len)


def by_tokens(tb, rows: torch.Tensor, budget: int, *, shared: bool,
              groups: torch.Tensor) -> list[torch.Tensor]:
    """``rows`` of ``tb`` (global indices) in micro-batches of at most ``budget`` tokens; ``shared``:
    the shared-prompt forward runs, so a prompt group's rows (``groups``, (N,)) stay together."""
    lengths, prompts = (t.tolist() for t in lengths_of(tb))
    made = units(rows.tolist(), lengths, budget, prompts=prompts if shared else None,
                 groups=groups.tolist() if shared else None)
    return [torch.as_tensor(part, dtype=rows.dtype, device=rows.device)
            for part in pack(made, budget, padded=not shared)]


def padding(tb, parts: Sequence[torch.Tensor]) -> tuple[int, int]:
    """(real tokens, positions) of ``parts`` of a batch of token rows (a family with the
    ``token_budget`` feature) laid out as grids padded to each one's longest row."""
    lengths = tb.attention_mask.sum(1)
    real = grid = 0
    for part in parts:
        if len(part):
            of = lengths[part]
            real += int(of.sum())
            grid += len(part) * int(of.max())
    return real, grid
