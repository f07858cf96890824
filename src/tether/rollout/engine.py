"""The engine seam: what a generation backend must do, and the records it returns.

Shaped so a vLLM or SGLang adapter can sit behind it: the engine takes token ids (not text),
returns per-token log-probs of the distribution it actually sampled from and per-token policy
versions, and loads weights only when told, for an explicit version.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from tether.decoding.sampling import SamplingParams
from tether.errors import ConfigError

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of a prompt."""

    token_ids: list[int]
    logprobs: list[float]
    """log μ(token) under the distribution sampled from (temperature, top-k, top-p applied)."""
    versions: list[int]
    """The policy version that produced each token."""
    finish_reason: FinishReason


class Engine(Protocol):
    """Generates completions with its own copy of the weights and its own version."""

    @property
    def version(self) -> int:
        """The policy version of the weights loaded now."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], *, samples_per_prompt: int,
                 params: SamplingParams, seed: int) -> list[list[Completion]]:
        """``samples_per_prompt`` completions for each prompt, grouped by prompt, in order.

        The same seed, weights and inputs give the same tokens.
        """
        ...

    def load_weights(self, weights: Mapping[str, Any], version: int) -> None:
        """Make ``weights`` (name → tensor) current as ``version``; only called while idle."""
        ...


def check_context(prompts: Sequence[Sequence[int]], params: SamplingParams,
                  max_positions: int | None) -> None:
    """Refuse a batch whose longest prompt plus ``max_new_tokens`` does not fit the model's context
    (None: no known limit), naming both numbers."""
    longest = max(len(p) for p in prompts)
    if max_positions is not None and longest + params.max_new_tokens > max_positions:
        raise ConfigError(
            f"a {longest}-token prompt plus rollout.max_new_tokens={params.max_new_tokens} exceeds "
            f"the model's context of {max_positions} positions; lower data.max_prompt_tokens "
            "or rollout.max_new_tokens"
        )
