"""The engines rollout workers sample with (``rollout.engine``): one folder per engine, each
holding its plug-in (``__init__.py``: a ``tether.plugins.EnginePlugin`` declaring its section,
keys, what it supports and its checks), its section, and the engine itself (``engine.py``, a
``tether.vocabulary.TokenEngine``, imported only when a worker builds it). What they share is here.

    torch/  the built-in engine: any Hugging Face causal LM, with the native decoder on the CPU
            (``rollout.decoder``); also lends its torch to the engines step families build over
            their own models (kind ``step``)
    vllm/   vLLM: its section ``vllm``, its limits (version, LoRA ranks) checked at config load

Adding an engine: docs/architecture.md, "Adding an engine".
"""

from __future__ import annotations

from collections.abc import Sequence

from tether.errors import ConfigError
from tether.vocabulary import SamplingParams


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
