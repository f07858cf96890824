"""The torch learner: any family's policy model (a Hugging Face causal LM for text) trained with U
updates per rollout batch.

Per batch: advantages over the whole batch; π_old (the trainer's log-probs with the weights it
holds now) once, before any update; then the batch is split into U mini-batches, each one
optimizer update (with gradient accumulation over micro-batches inside it). A non-finite
gradient norm skips that update — not committed, counted — and ``TrainResult`` reports how many
were committed, so the version clock stays honest.

With a ``Ranks`` group (``train.world_size`` > 1, ``tether.train.sharded``) the same learner runs
in each of N processes on a model sharded with FSDP2: every rank computes the batch's advantages,
trains its share of each mini-batch (whole prompt groups), normalises its part of the loss by the
whole mini-batch's counts, and gradients are summed, so the update is the single-process one;
π_old, the corrections and every metric are computed over the whole mini-batch from gathered rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tether.config import Config
from tether.errors import ConfigError
from tether.modeling import (
    disable_dropout,
    dropout_settings,
    fingerprint,
    learner_device,
    model_config,
    unique_parameters,
)
from tether.train import checkpointing, fsdp, learner_state, lora, memory, packing, precision
from tether.train.advantages import (
    Advantages,
    group_advantages,
    overlong_penalty,
    per_episode,
    turn_advantages,
    units_of,
)
from tether.train.batch_stats import BatchStats, batch_metrics
from tether.train.collective import Solo
from tether.train.corrections import correct
from tether.train.ema import Ema
from tether.train.losses import LossInputs, LossSettings, aggregate, behavior_outside, loss_for
from tether.train.schedule import lr_factor
from tether.vocabulary import RolloutBatch, TrainResult

log = logging.getLogger("tether.train")


def _behind(logp: torch.Tensor, behavior: torch.Tensor, keep: torch.Tensor, settings: LossSettings) -> dict:
    """``ratio/behavior_outside_clip_frac`` of these rows, when any is in the loss."""
    value = behavior_outside(logp, behavior, keep, settings)
    return {} if value is None else {"ratio/behavior_outside_clip_frac": value}


def _denominators(keep: torch.Tensor) -> tuple[float, float]:
    """Tokens and sequences that count in a mini-batch's loss."""
    return float(keep.sum()), float((keep.sum(dim=1) > 0).sum())


class TorchLearner:
    """The learner of one process, or of one rank (``group``). Everything it is told is the
    recipe: the ``train``, ``correction`` and ``reward`` sections, the family's policy."""

    def __init__(self, model_path: str | Path, cfg: Config, *, group: Solo | None = None) -> None:
        self.cfg = cfg
        self.s = s = cfg.train
        self.group = group or Solo()
        self.loss_fn = loss_for(s.loss)  # a plug-in's checked (losses.CheckedLoss)
        self.norm_constant = cfg.family().norm_constant(cfg)
        """L_max: Dr. GRPO's normalising constant for ``seq_mean_token_sum_norm``."""
        torch.manual_seed(cfg.run.seed)
        self.device = learner_device(s.device)
        self.precision = precision.of(cfg, self.device)  # train.dtype: the forwards' compute dtype
        self.policy = self.precision.policy(cfg.family().policy(cfg))
        features = cfg.family().capabilities.features
        self.token_rows = "token_budget" in features  # for train/pad_frac
        # an allocation that fails names its phase and what lowers it (tether.train.memory)
        self._phase = functools.partial(memory.phase, train=s, bf16="mixed_precision" in features)
        # train.dtype=bfloat16 with LoRA: the frozen base read straight in bfloat16 (FSDP2 asks one
        # dtype of a unit's trained parameters only: the adapters, float32)
        self.model, self.tokenizer = self.precision.load(self.policy, model_path, frozen=s.lora_rank > 0)
        self._without_dropout(model_path)
        self.model_path = model_path
        self.base_fingerprint = None
        if s.lora_rank:  # adapters only train and publish; the reference is the base (lora.disabled)
            self.model = lora.attach(self.model, s)
            self.precision.settle(self.model)  # what trains in float32, the base in the compute dtype
            if self.group.rank == 0:  # what checkpoints record: the base as it was loaded
                self.base_fingerprint = fingerprint(model_path)
            if s.lora_dropout and self.group.rank == 0:
                log.warning("train.lora_dropout=%g: the adapters' inputs are dropped in the learner's "
                            "forwards, so the ratio's numerator is a random sub-network of the policy the "
                            "engine sampled (ratio/* and mismatch/* carry that noise); the model's own "
                            "forward runs, not the shared-prompt one", s.lora_dropout)
        self.model.to(self.device).train()
        checkpointing.apply(self.model, self.policy, s, family=cfg.model.family, rank=self.group.rank)
        self.names = list(self._published())  # the published names, tied ones once
        self.ref_model = None
        if s.kl_coef > 0 and not s.lora_rank:  # frozen; sharded like the model with ranks
            self.ref_model, _ = self.policy.load(model_path)
            disable_dropout(self.ref_model)
            self.ref_model.to(self.device).eval().requires_grad_(False)
        if self.group.world > 1:
            fsdp.shard(self.model, self.policy.layers(self.model), self.precision.fsdp_policy(),
                       cpu_offload=s.cpu_offload)
            if self.ref_model is not None:  # both after checkpointing.apply
                fsdp.shard(self.ref_model, self.policy.layers(self.ref_model), self.precision.fsdp_policy(),
                           cpu_offload=s.cpu_offload)
        self.forward = self._forward_for(self.model)
        self.ref_forward = self._forward_for(self.ref_model) if self.ref_model is not None else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.ema = Ema(self.model, s.ema_decay, s.ema_every) if s.ema_decay > 0 else None
        self.attribution = None
        if cfg.metrics.attribution:
            from tether.train.attribution import Attribution

            budget = cfg.budget()
            self.attribution = Attribution(self.model, budget.staleness_budget,
                                           keeps_cache=budget.mode.keeps_cache)
        # the fused kernel: one pass over every parameter instead of a handful of small ops per
        # tensor (2.2 against 9.8 ms a step for the demo model on one CPU thread), and no
        # parameter-sized temporaries (the foreach implementation allocates them each step); FSDP2's
        # DTensor shards take it too
        self.optimizer = torch.optim.AdamW(self.params, lr=s.lr, betas=(s.adam_beta1, s.adam_beta2),
                                           weight_decay=s.weight_decay, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, functools.partial(
            lr_factor, kind=s.lr_schedule, warmup_steps=s.warmup_steps,
            total_steps=s.num_batches * s.updates_per_batch, min_ratio=s.min_lr_ratio))
        self.committed = 0
        self.skipped = 0

    def _without_dropout(self, model_path: str | Path) -> None:
        """Train without the dropout a model's config may turn on (a family's loader turns the
        config's off; every dropout module is turned off here), saying so once."""
        settings = dropout_settings(model_config(model_path))
        modules = disable_dropout(self.model)
        if (settings or modules) and self.group.rank == 0:
            shown = ", ".join(f"{k}={v:g}" for k, v in settings.items()) or f"{modules} dropout modules"
            log.warning("the model's config turns dropout on (%s); every policy forward runs without it, so "
                        "the learner's log-probs are those of the distribution the engine sampled "
                        "(docs/training.md)", shown)

    # -- the Learner protocol -----------------------------------------------------------------

    def export_weights(self) -> dict[str, torch.Tensor]:
        """name → tensor of every parameter, tied ones once. Sharded: gathered whole onto the CPU
        (a collective), returned on rank 0 (other ranks get an empty dict)."""
        with self._phase("publication"):
            if self.group.world == 1:
                return self._published()
            return fsdp.whole_weights(self.model, self.names)

    def evaluation_weights(self) -> contextlib.AbstractContextManager:
        """Inside it the model holds what held-out evaluation measures: the EMA's weights with
        ``train.ema_decay`` (every rank enters it), else the trained ones."""
        return self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext()

    def evaluating(self, evaluate: Callable[[int], Any]) -> Callable[[int], Any]:
        """A held-out evaluator of this learner's own model: in the training forward's dtype, on
        the evaluation weights."""
        run = self.precision.evaluating(evaluate)

        def on_evaluation_weights(step: int) -> Any:
            with self.evaluation_weights():
                return run(step)

        return on_evaluation_weights

    def _published(self) -> dict[str, torch.Tensor]:
        """What an engine needs of the weights: every parameter, or with LoRA the adapters."""
        return lora.adapters(self.model) if self.s.lora_rank else unique_parameters(self.model)

    def train(self, batch: RolloutBatch, *, train_version: int) -> TrainResult:
        s = self.s
        tb = self.policy.batch(batch.payload).to(self.device)
        u = s.updates_per_batch
        if u > tb.size:
            raise ConfigError(f"train.updates_per_batch={u} exceeds the {tb.size} sequences of a rollout "
                              "batch; lower it or raise rollout.batch_size × rollout.group_size")
        stats = BatchStats()
        adv, mask = self._advantages(tb, stats)
        minibatches = torch.arange(tb.size, device=self.device).tensor_split(u)  # U contiguous mini-batches
        groups = torch.div(units_of(tb), tb.group_size, rounding_mode="floor")  # (N,)
        shares = [self.group.share(rows, groups) for rows in minibatches]  # this rank's rows of each
        self._check_shares(minibatches, groups)
        inline_old = u == 1 and len(self._micro(tb, shares[0])) == 1
        same = tb.behavior_versions == train_version  # sampled with the weights π_old comes from
        mine = torch.cat(shares)
        with self._phase("old"):
            old = None if inline_old else self._no_grad_logp(self.model, tb, mine)
            ref = self._reference(tb, mine)
            split = self._attribute(tb, old, mine, train_version) if self.attribution is not None else {}
        committed = 0
        for rows, share in zip(minibatches, shares, strict=True):
            with self._phase("update"):  # the optimizer step inside it is its own phase
                committed += self._update(tb, rows, share, adv.values, mask, same, old, ref, stats)
        return TrainResult(committed, u, {**self._metrics(stats, adv.frac_zero_std, u - committed), **split})

    def _reference(self, tb: Any, mine: torch.Tensor) -> torch.Tensor | None:
        """What the KL term compares under the reference policy: the frozen copy's, or with LoRA
        the model's own with its adapters off; None without a KL term."""
        if self.ref_model is not None:
            return self._no_grad_logp(self.ref_model, tb, mine, basis=True)
        if self.s.kl_coef > 0 and self.s.lora_rank:
            with lora.disabled(self.model):
                return self._no_grad_logp(self.model, tb, mine, basis=True)
        return None

    def _attribute(self, tb: Any, old: torch.Tensor | None, mine: torch.Tensor,
                   train_version: int) -> dict[str, float]:
        """``attribution/*`` of the batch, before its updates (π_old is the weights now)."""
        assert self.attribution is not None
        self.attribution.remember(train_version)
        old = old if old is not None else self._no_grad_logp(self.model, tb, mine)
        return self.attribution.split(tb.behavior_versions, tb.mask, old, tb.behavior_logp, train_version,
                                      lambda model: self._no_grad_logp(model, tb, mine))

    def _check_shares(self, minibatches, groups: torch.Tensor) -> None:
        """Every rank needs rows of every mini-batch: refuse mini-batches of fewer prompt groups
        than ranks, saying what to change."""
        if self.group.world == 1:
            return
        fewest = min(len(torch.unique_consecutive(groups[rows])) for rows in minibatches)
        if fewest < self.group.world:
            raise ConfigError(
                f"a mini-batch holds {fewest} prompt group(s), fewer than the train.world_size="
                f"{self.group.world} ranks, which split mini-batches by whole groups; raise "
                "rollout.batch_size, or lower train.updates_per_batch or train.world_size")

    def _advantages(self, tb: Any, stats: BatchStats) -> tuple[Advantages, torch.Tensor]:
        """Advantages of the (shaped) rewards, and the loss mask (N, L − 1) of the samples kept."""
        s, shaping = self.s, self.cfg.reward
        if self.policy.sliced_by_turn(tb):  # per (group, turn) slice: env.credit=turn, env.on_failure=mask
            adv = turn_advantages(tb, estimator=s.advantage, std_norm=s.adv_std_norm,
                                  drop_zero_std=s.drop_zero_std, clip=s.adv_clip)
            stats.add("credit/turns_max", tb.turn.max() + 1)
            for name, cols in (("turn", tb.turn >= 0), ("first_turn", tb.turn == 0)):
                if bool(cols.any()):  # each token's turn return, averaged over the tokens
                    stats.add(f"credit/{name}_return_mean", tb.turn_return[cols].mean())
            if s.adv_clip:
                stats.add("train/adv_clipped_frac", adv.clipped_frac)
            keep = adv.keep & ~tb.truncated if s.mask_truncated else adv.keep  # (N,)
            return adv, tb.mask * keep.float()[:, None]
        rewards, lengths, episode = per_episode(tb)  # per row, or per episode when one spans rows
        if shaping.overlong_buffer:
            penalty = overlong_penalty(lengths, max_len=self.norm_constant,
                                       buffer=shaping.overlong_buffer, factor=shaping.overlong_penalty)
            rewards = rewards + penalty
            stats.add("reward/overlong_penalty_mean", penalty.mean())
            stats.add("reward/overlong_frac", (penalty < 0).float().mean())
        adv = group_advantages(rewards, tb.group_size, estimator=s.advantage, std_norm=s.adv_std_norm,
                               scope=s.adv_scope, drop_zero_std=s.drop_zero_std, clip=s.adv_clip)
        if episode is not None:  # back to rows
            adv = dataclasses.replace(adv, values=adv.values[episode], keep=adv.keep[episode])
        if s.adv_clip:
            stats.add("train/adv_clipped_frac", adv.clipped_frac)
        keep = adv.keep & ~tb.truncated if s.mask_truncated else adv.keep  # (N,)
        return adv, tb.mask * keep.float()[:, None]

    # -- one update ---------------------------------------------------------------------------

    def _micro_count(self, n: int) -> int:
        m = self.s.micro_batch_size
        return 1 if m <= 0 else math.ceil(n / m)

    def _micro(self, tb: Any, rows: torch.Tensor) -> list[torch.Tensor]:
        """``rows`` in micro-batches of ``train.micro_batch_size`` rows, or packed by
        ``train.max_tokens_per_micro_batch`` (``tether.train.packing``); every rank runs as many
        (the sharded model's forward and backward are collectives), so a rank with fewer rows or
        tokens may get empty ones."""
        if not self.s.max_tokens_per_micro_batch:
            return list(rows.tensor_split(self._micro_count(self.group.most(len(rows)))))
        groups = torch.div(units_of(tb), tb.group_size, rounding_mode="floor")
        parts = packing.by_tokens(tb, rows, self.s.max_tokens_per_micro_batch, groups=groups,
                                  shared=self.forward is not None)
        return parts + [rows[:0]] * (self.group.most(len(parts)) - len(parts))

    def _forward_for(self, model):
        """The family's faster forward (a language model's shared-prompt forward) when asked for
        and possible, else None (the model's own forward)."""
        # the shared-prompt forward reads each adapted layer's merged weight: it cannot drop inputs
        return self.policy.fast_forward(model, self.s.shared_prefix and not self.s.lora_dropout)

    def _no_grad_logp(self, model, tb: Any, mine: torch.Tensor, *,
                      basis: bool = False) -> torch.Tensor:
        """log π of ``model`` for every row of ``tb`` (N, L − 1) — or, with ``basis``, what the
        family's KL term compares (the log-probs, or a flow step's means): this rank computes
        ``mine``, the others theirs."""
        forward = {id(self.model): self.forward, id(self.ref_model): self.ref_forward}.get(id(model))
        parts, micro = [], self._micro(tb, mine)
        with torch.no_grad():
            for rows in micro:
                out = self.policy.forward(model, tb.rows(self._runnable(rows, mine)), forward=forward)
                parts.append(out[2 if basis else 0][: len(rows)])
        return self.group.gather(torch.cat(parts), torch.cat(micro), tb.size)  # packed: in any order

    @staticmethod
    def _runnable(rows: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
        """``rows``, or one stand-in row when empty: a rank with nothing in a micro-batch still
        runs the sharded model's forward and backward with the others (its result unused)."""
        return rows if len(rows) else mine[:1]

    def _update(self, tb: Any, rows: torch.Tensor, mine: torch.Tensor, adv: torch.Tensor,
                mask: torch.Tensor, same: torch.Tensor, old: torch.Tensor | None, ref: torch.Tensor | None,
                stats: BatchStats) -> int:
        """One optimizer update from mini-batch ``rows`` (global row indices), of which this rank
        trains ``mine``. ``adv``, ``mask``, ``same``, ``old``, ``ref``: whole-batch tensors."""
        s = self.s
        weigh = s.anchor == "proximal"
        settings = LossSettings(s.clip_low, s.clip_high, s.dual_clip)
        self.optimizer.zero_grad(set_to_none=True)
        if not self._has_signal(adv[rows], mask[rows], ref):  # the same answer on every rank
            return self._skip(stats, "train/skipped_no_signal")
        start = int(rows[0])  # rows are contiguous: row r of the batch is r − start of the mini-batch
        # (a micro-batch ``part`` may be any of them, packed by tokens)
        behavior = tb.behavior_logp[rows]
        # π_old of the mini-batch's rows fixes the corrections and so the loss denominators. It is
        # known before any forward pass, or (U = 1, one micro-batch: ``old`` is None) it is the one
        # forward's log-probs, gathered from every rank (the identity in one process).
        old_rows = corr = None
        if old is not None:
            old_rows = old[rows]
            corr = self._corrections(old_rows, behavior, mask[rows], same[rows], weigh, stats)
            if corr is None:
                return self._skip(stats, "train/skipped_no_signal")
            total_tokens, total_seqs = _denominators(corr.keep)
        micro = self._micro(tb, mine)
        self._count_micro(tb, micro, stats)
        for part in micro:
            mb = tb.rows(self._runnable(part, mine))
            logp, entropy, own = self.policy.forward(self.model, mb, with_entropy=True, forward=self.forward)
            logp, entropy, own = logp[: len(part)], entropy[: len(part)], own[: len(part)]
            local = part - start
            if old_rows is None:
                old_rows = self.group.gather(logp.detach(), local, len(rows))
                corr = self._corrections(old_rows, behavior, mask[rows], same[rows], weigh, stats)
                if corr is None:
                    return self._skip(stats, "train/skipped_no_signal")
                total_tokens, total_seqs = _denominators(corr.keep)  # once per mini-batch, as above
            old_mb, weights, keep = old_rows[local], corr.weights[local], corr.keep[local]
            anchor = old_mb if weigh else tb.behavior_logp[part]
            inputs = LossInputs(logp=logp, anchor_logp=anchor, advantages=adv[part], mask=keep)
            per_token, loss_metrics = self.loss_fn(inputs, settings)
            behavior_mb = tb.behavior_logp[part]
            loss_metrics = {**loss_metrics, **_behind(logp.detach(), behavior_mb, keep, settings)}
            policy = aggregate(per_token * weights, keep, s.aggregation, norm_constant=self.norm_constant,
                               total_tokens=total_tokens, total_seqs=total_seqs)
            total = policy
            kl = kl_cols = None
            if ref is not None:
                kl_cols = self.policy.kl(own, ref[part], s.kl_estimator)  # (n, T): each column's term
                kl = aggregate(kl_cols, keep, s.aggregation, norm_constant=self.norm_constant,
                               total_tokens=total_tokens, total_seqs=total_seqs)
                total = policy + s.kl_coef * kl
            if not len(part):
                total = total * 0.0  # a stand-in row: its backward only takes part in the collectives
            total.backward()
            if self.group.world > 1:  # the figures of the whole micro-batch, from every rank's rows
                policy, kl, loss_metrics, logp, entropy, anchor, keep = self._whole(
                    part, logp.detach(), entropy, anchor, behavior_mb, adv, keep, weights,
                    None if kl_cols is None else kl_cols.detach(), total_tokens, total_seqs, settings)
                total = policy if kl is None else policy + s.kl_coef * kl
            if kl is not None:
                stats.part("loss/kl", kl.detach())
            stats.part("loss/policy", policy.detach())
            stats.part("loss/total", total.detach())
            for key, value in loss_metrics.items():
                stats.add(key, value)
            valid = keep.bool()
            if valid.any():
                stats.ratios.append(torch.exp(logp.detach() - anchor)[valid])
                stats.entropy.append(entropy[valid])
        stats.done()
        max_norm = s.grad_clip if s.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)  # over every rank's shards
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        if not torch.isfinite(grad_norm):
            return self._skip(stats, "train/skipped_nonfinite_grad")
        stats.add("train/grad_norm", grad_norm)
        with self._phase("optimizer"):
            self.optimizer.step()
            if self.ema is not None:
                self.ema.step(self.committed)
        self.scheduler.step()
        self.committed += 1
        return 1

    def _count_micro(self, tb: Any, micro: list[torch.Tensor], stats: BatchStats) -> None:
        """``train/micro_batches`` of an update, and for a family of token rows its tokens for
        ``train/pad_frac``."""
        stats.add("train/micro_batches", len(micro))
        if not self.token_rows:
            return
        real, grid = packing.padding(tb, micro)
        stats.tokens[0] += real
        stats.tokens[1] += grid

    def _corrections(self, old: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor, same: torch.Tensor,
                     weigh: bool, stats: BatchStats) -> Any:
        """The corrections of a mini-batch from its π_old (every rank's rows), their metrics
        counted; None when they mask every token (nothing to learn from)."""
        corr = correct(old, behavior, mask, self.cfg.correction, weigh=weigh, same_weights=same)
        for key, value in corr.metrics.items():
            stats.add(key, value)
        return corr if corr.keep.any() else None

    def _whole(self, part, logp, entropy, anchor, behavior, adv, keep, weights, kl_cols, total_tokens,
               total_seqs, settings):
        """The loss figures of one micro-batch over every rank's rows (this rank's ``part`` and the
        others'), computed as one process would: (policy, kl, loss metrics, logp, entropy, anchor,
        keep) of those rows. ``kl_cols``: this rank's per-column KL terms (n, T), or None; each
        family's KL basis may have any shape (a step's mean image for flow), its terms are columns."""
        s = self.s
        fields = torch.stack([logp, entropy, anchor, behavior, keep, weights,
                              kl_cols if kl_cols is not None else torch.zeros_like(logp)], dim=1)
        rows, full = self.group.collect(fields, part)
        logp, entropy, anchor, behavior, keep, weights, kl_rows = full.unbind(1)
        inputs = LossInputs(logp=logp, anchor_logp=anchor, advantages=adv[rows], mask=keep)
        with torch.no_grad():
            per_token, loss_metrics = self.loss_fn(inputs, settings)
            loss_metrics = {**loss_metrics, **_behind(logp, behavior, keep, settings)}
            policy = aggregate(per_token * weights, keep, s.aggregation, norm_constant=self.norm_constant,
                               total_tokens=total_tokens, total_seqs=total_seqs)
            kl = None
            if kl_cols is not None:
                kl = aggregate(kl_rows, keep, s.aggregation, norm_constant=self.norm_constant,
                               total_tokens=total_tokens, total_seqs=total_seqs)
        return policy, kl, loss_metrics, logp, entropy, anchor, keep

    @staticmethod
    def _has_signal(adv: torch.Tensor, mask: torch.Tensor, ref: torch.Tensor | None) -> bool:
        """Whether a mini-batch has anything to learn from: a token in the loss (not every group
        dropped for zero variance, nor every sample masked or truncated out) whose advantage is
        not zero, or a KL term. Without one the gradient is zero and a step would only move the
        weights by the optimizer's momentum and weight decay."""
        in_loss = mask.any(dim=1)  # (N,)
        return bool(in_loss.any()) and (ref is not None or bool((adv[in_loss] != 0).any()))

    def _skip(self, stats: BatchStats, reason: str) -> int:
        """An update that is not made: no optimizer step (AdamW would still move the weights by
        its momentum), no scheduler step, not committed; counted under ``reason``."""
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped += 1
        stats.skips[reason] = stats.skips.get(reason, 0) + 1
        return 0

    def _metrics(self, stats: BatchStats, frac_zero_std: float, skipped: int) -> dict[str, float]:
        return batch_metrics(stats, lr=self.optimizer.param_groups[0]["lr"], frac_zero_std=frac_zero_std,
                             skipped=skipped, group=self.group, device=self.device)

    # -- state: the checkpoint format is tether.train.learner_state's ------------------------------

    def save(self, path: str | Path) -> None:
        """Model (safetensors) and tokenizer, optimizer, scheduler, RNG and counters."""
        learner_state.save(self, Path(path))

    def load(self, path: str | Path) -> None:
        """Continue from a checkpoint written at any world size, whole or sharded."""
        learner_state.load(self, Path(path))
