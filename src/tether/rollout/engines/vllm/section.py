"""vLLM's recipe section and its limits, read by its plug-in at config load and by the engine."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from tether.config.fields import knob
from tether.errors import ConfigError

VLLM_INSTALL_HINT = ("install vLLM's build for this machine: `make vllm` (CPU, a separate virtual "
                     "environment .venv-vllm whose pins vLLM needs) or `pip install 'tether[vllm]'` on a "
                     "GPU machine, and run tether from that environment")


@dataclass(frozen=True)
class VllmSection:
    """The vLLM engine (used when rollout.engine=vllm)."""

    dtype: Literal["float32", "bfloat16", "float16"] = knob(
        "float32",
        "Weights and activations in vLLM. float32 = the learner's precision, so the engine's log-probs "
        "are the learner's to ~1e-6; bfloat16 is faster on GPUs and adds a train–inference mismatch "
        "that mismatch/numeric_* report and correction.* are for. (vLLM's own 'auto' would run a "
        "float32 model in bfloat16, so Tether asks for a dtype.)",
    )
    gpu_memory_utilization: float = knob(
        0.9, "Share of its GPU's memory vLLM may take for weights and KV cache (GPU only).", min=0.05, max=1
    )
    cpu_kv_cache_gb: float = knob(
        1.0, "GiB of memory for vLLM's KV cache when it samples on CPU (VLLM_CPU_KVCACHE_SPACE).", min=0.1
    )
    enforce_eager: bool = knob(
        True,
        "Run the model eagerly; false lets vLLM capture CUDA graphs / compile (faster decoding on "
        "a GPU, a slower start).",
    )
    enable_prefix_caching: bool = knob(
        True,
        "Share the KV cache of a prompt's prefix between its group's samples; the cache is reset at "
        "every publication, so nothing computed under older weights is reused.",
    )


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts."""
VLLM_FIRST = (0, 10, 2)
"""The first vLLM that returns the log-probs of the distribution it samples from
(``logprobs_mode='processed_logprobs'``)."""


def require_processed_logprobs(version: str) -> None:
    """Refuse a vLLM that cannot return the log-probs of the distribution it samples from."""
    numbers = tuple(int(x) for x in re.findall(r"\d+", version)[:3])
    if numbers < VLLM_FIRST:
        raise ConfigError(
            f"vLLM {version} cannot return the log-probs of the distribution it samples from "
            "(logprobs_mode='processed_logprobs' arrived in 0.10.2), without which the importance "
            f"ratios would silently compare different distributions; {VLLM_INSTALL_HINT}")
