"""How the learner's ranks share a rollout batch: which rows each trains, and how they agree.

Every rank holds the whole rollout batch and computes its advantages (as one process would);
each mini-batch's rows are then split across ranks by whole prompt groups, and every per-row
quantity the loss normalises by or reports on is gathered, so each rank sees the whole
mini-batch wherever the single-process learner would. ``Solo`` is one process (world size 1):
every operation is the identity.
"""

from __future__ import annotations

import torch


class Solo:
    """One process trains everything."""

    world = 1
    rank = 0

    def share(self, rows: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a mini-batch (``rows``: global row indices; ``groups``: the group of
        every row of the batch, (N,))."""
        return rows

    def collect(self, values: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, values) of every rank's ``values`` at its global ``rows``, in row order."""
        return rows, values

    def gather(self, values: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
        """A tensor of ``n`` rows holding every rank's ``values`` at its global ``rows``."""
        rows, values = self.collect(values, rows)
        if len(rows) == n and bool((rows == torch.arange(n, device=rows.device)).all()):
            return values
        out = values.new_zeros((n, *values.shape[1:]))
        out[rows] = values
        return out

    def most(self, value: float) -> float:
        """The largest ``value`` over the ranks (an int stays an int)."""
        return value


class Ranks(Solo):
    """``world`` processes in a ``torch.distributed`` process group (gloo on CPU, NCCL on GPUs)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()

    def share(self, rows: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        of_rows = groups[rows]
        distinct = torch.unique_consecutive(of_rows)
        mine = distinct.tensor_split(self.world)[self.rank]  # contiguous runs of whole groups
        return rows[torch.isin(of_rows, mine)]

    def collect(self, values: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parts: list = [None] * self.world
        self.dist.all_gather_object(parts, (rows.cpu(), values.detach().cpu()))
        rows = torch.cat([r for r, _ in parts]).to(values.device)
        values = torch.cat([v for _, v in parts]).to(values.device)
        order = torch.argsort(rows)
        return rows[order], values[order]

    def most(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)  # exact for any count below 2**53
        if self.dist.get_backend() == "nccl":
            t = t.cuda()
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return type(value)(t.item())
