"""What a recipe tells each component: the learner's settings and the sampling parameters,
read from a ``Config`` (``tether train``, learner ranks and rank actors build theirs here)."""

from __future__ import annotations

from tether.config import Config


def learner_settings(cfg: Config):
    from tether.train.corrections import CorrectionSettings
    from tether.train.learner import LearnerSettings

    t, c = cfg.train, cfg.correction
    return LearnerSettings(
        updates_per_batch=t.updates_per_batch, loss=t.loss, aggregation=t.aggregation,
        clip_low=t.clip_low, clip_high=t.clip_high, dual_clip=t.dual_clip, adv_std_norm=t.adv_std_norm,
        mask_truncated=t.mask_truncated, overlong_buffer=cfg.reward.overlong_buffer,
        overlong_penalty=cfg.reward.overlong_penalty,
        advantage=t.advantage, adv_scope=t.adv_scope, drop_zero_std=t.drop_zero_std, kl_coef=t.kl_coef,
        kl_estimator=t.kl_estimator,
        anchor=t.anchor,
        correction=CorrectionSettings(tis=c.tis, tis_cap=c.tis_cap, mask=c.mask, mask_low=c.mask_low,
                                      mask_high=c.mask_high, outlier_token=c.outlier_token),
        lr=t.lr, warmup_steps=t.warmup_steps, lr_schedule=t.lr_schedule, min_lr_ratio=t.min_lr_ratio,
        total_updates=t.num_batches * t.updates_per_batch, weight_decay=t.weight_decay,
        betas=(t.adam_beta1, t.adam_beta2),
        grad_clip=t.grad_clip, micro_batch_size=t.micro_batch_size, shared_prefix=t.shared_prefix,
        temperature=cfg.rollout.temperature,
        max_new_tokens=(cfg.flow.train_steps or cfg.flow.steps) if cfg.model.family == "flow"
        else cfg.rollout.max_new_tokens,
        seed=cfg.run.seed, device=t.device,
        sharded_checkpoints=cfg.checkpoint.sharded, attribution=cfg.metrics.attribution,
        staleness_budget=cfg.async_.max_staleness * t.updates_per_batch, family=cfg.model.family,
        flow_train_steps=cfg.flow.train_steps,
    )


def sampling(cfg: Config):
    from tether.decoding.sampling import SamplingParams

    r = cfg.rollout
    return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_k=r.top_k,
                          top_p=r.top_p)
