"""Batched KV-cache decoding of a causal LM: sampling with exact per-token log-probs, and the
lean decode path for the Llama family. Shared by the rollout engine, warm start and evaluation,
so none of them depends on another."""

from tether.decoding.sampling import (
    Completions,
    SamplingParams,
    left_pad,
    sample,
    stepper_for,
    stop_ids_for,
    truncate_logits,
)

__all__ = ["Completions", "SamplingParams", "left_pad", "sample", "stepper_for", "stop_ids_for",
           "truncate_logits"]
