"""Exact attribution of the importance log-ratio (``metrics.attribution``).

For a token sampled by the engine under version v, with μ the engine's log-prob and π_old the
learner's recomputation with the weights it holds when the batch trains:

    log π_old/μ  =  log π_old/π_v  +  log π_v/μ
                    (staleness)      (numerics)

π_v is the learner's own forward with the weights of version v, kept for that purpose: the
staleness part is what the updates since v changed, the numeric part what the engine's kernels,
precision and sampling path add at the same weights (both exact per token, and they add up to the
total). ``mismatch/numeric_*`` measures the second only on tokens whose v is the current version;
this measures it on every token, and the first beside it.

The learner keeps a copy of its weights for each version a future batch can still hold: a batch
trains at staleness ≤ budget, so its tokens' versions are ≥ train_version − budget; at most
budget + 1 copies, their memory reported. Versions the learner never held as a whole step's end
(intermediate updates of a step are never published) or held before a resume are not available:
their tokens are left out and ``attribution/token_frac`` says how many were covered.

With learner ranks (FSDP2) every rank keeps copies of its own shards only (1/N of the weights
each), and every rank takes part in each kept version's forward: the versions to run are those of
the whole batch, which every rank holds, so all ranks run the same collectives in the same order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch


def cache_versions(versions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N, T) each token's KV version under ``keep_cache`` (``tether.control.inflight.cache_versions``):
    the version of the first token of its run of ``mask``ed (model) tokens, the turn's prefill."""
    m = mask.bool()
    start = m.clone()
    start[:, 1:] &= ~m[:, :-1]
    index = torch.arange(m.shape[1], device=m.device).expand_as(m)
    first = torch.cummax(torch.where(start, index, torch.zeros_like(index)), dim=1).values
    return versions.gather(1, first)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of ``t`` (a rank's shard of an FSDP2 parameter, else ``t``)."""
    return t.to_local() if hasattr(t, "to_local") else t


class Attribution:
    """Weight copies by version, and the per-batch split of log π_old/μ."""

    def __init__(self, model: torch.nn.Module, budget_updates: int, *, keeps_cache: bool = False) -> None:
        self.model = model
        self.budget = budget_updates
        self.keeps_cache = keeps_cache
        """The in-flight mode keeps a sequence's KV cache across switches (``keep``): tokens after a
        switch were sampled over an older version's cache, and their numeric part is reported apart."""
        self.copies: dict[int, dict[str, torch.Tensor]] = {}

    def remember(self, version: int) -> None:
        """Keep the model's weights as ``version`` (the learner's now), and let go of every
        version no future batch can hold."""
        if version not in self.copies:
            self.copies[version] = self._snapshot()
        for old in [v for v in self.copies if v < version - self.budget]:
            del self.copies[old]

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    @contextlib.contextmanager
    def holding(self, version: int, current: int) -> Iterator[torch.nn.Module]:
        """The model with ``version``'s weights in place, then ``current``'s (kept: the weights it
        has now) back, in place: the optimizer's parameters and FSDP2's shards stay the same
        objects."""
        with torch.no_grad():
            self.model.load_state_dict(self.copies[version])
            try:
                yield self.model
            finally:
                self.model.load_state_dict(self.copies[current])

    @property
    def memory_mb(self) -> float:
        return sum(_local(t).numel() * t.element_size() for c in self.copies.values()
                   for t in c.values()) / 2**20

    def split(self, versions: torch.Tensor, mask: torch.Tensor, old_logp: torch.Tensor,
              behavior_logp: torch.Tensor, train_version: int,
              logp_of: Callable[[torch.nn.Module], torch.Tensor]) -> dict[str, float]:
        """``attribution/*`` for one batch: ``versions`` (N, T) each token's version, ``mask``
        (N, T) the completion tokens, ``old_logp`` log π_old, ``behavior_logp`` log μ, and
        ``logp_of(model)`` a model's log-probs of the batch (N, T). The model's weights must be
        ``train_version``'s, kept by ``remember``.

        With ``keeps_cache`` (each token's KV version: ``cache_versions``), the numeric part is also
        reported apart on the tokens sampled over an older version's cache: there π_v is the new
        weights over a prefix they computed themselves and μ the new weights over the prefix the
        old ones left in the cache, so log π_v/μ is the kept cache's gap (plus the kernels'
        numerics, which the other tokens' part measures)."""
        m = mask.bool()
        at_version = torch.full_like(old_logp, float("nan"))
        at_version[m & (versions == train_version)] = old_logp[m & (versions == train_version)]
        for v in sorted(set(versions[m].tolist()) - {train_version}):
            if v not in self.copies:
                continue
            tokens = m & (versions == v)
            with self.holding(v, train_version) as model:
                at_version[tokens] = logp_of(model)[tokens]
        covered = m & ~torch.isnan(at_version)
        out = {"attribution/token_frac": float(covered.sum()) / max(int(m.sum()), 1),
               "attribution/versions_kept": float(len(self.copies)),
               "attribution/memory_mb": self.memory_mb}
        if not covered.any():
            return out
        total = (old_logp - behavior_logp)[covered]
        stale = (old_logp - at_version)[covered]
        numeric = (at_version - behavior_logp)[covered]
        size = stale.abs().sum() + numeric.abs().sum()
        out.update({
            "attribution/total_logratio_abs_mean": float(total.abs().mean()),
            "attribution/staleness_logratio_abs_mean": float(stale.abs().mean()),
            "attribution/staleness_logratio_abs_max": float(stale.abs().max()),
            "attribution/numeric_logratio_abs_mean": float(numeric.abs().mean()),
            "attribution/numeric_logratio_abs_max": float(numeric.abs().max()),
            # how much of the ratio's size each cause accounts for (NaN when both are exactly 0)
            "attribution/staleness_share": float(stale.abs().sum() / size) if size > 0 else float("nan"),
            "attribution/residual_abs_max": float((total - stale - numeric).abs().max()),
        })
        if self.keeps_cache:
            mixed = (cache_versions(versions, mask) != versions)[covered]
            gap = numeric[mixed].abs()
            same = numeric[~mixed].abs()
            out.update({
                "attribution/kv_mixed_token_frac": float(mixed.float().mean()),
                "attribution/kv_gap_abs_mean": float(gap.mean()) if gap.numel() else 0.0,
                "attribution/kv_gap_abs_max": float(gap.max()) if gap.numel() else 0.0,
                "attribution/same_kv_numeric_abs_mean": float(same.mean()) if same.numel() else 0.0,
            })
        return out
