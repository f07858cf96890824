"""The engines rollout workers sample with (``rollout.engine``), as plug-ins
(``tether.plugins.EnginePlugin``).

An engine plug-in declares its section and keys (refused when another engine is chosen), what it
supports (kinds, in-flight modes, LoRA, devices, weight channels) and its checks, and builds the
engine (``tether.vocabulary.TokenEngine``) inside a worker. Importing this module loads no torch;
``build`` imports the engine itself.

    torch   the built-in engine (``tether.rollout.torch_engine``): any Hugging Face causal LM,
            with the native decoder on the CPU (``rollout.decoder``); also lends its torch to the
            engines step families build over their own models (kind ``step``)
    vllm    vLLM (``tether.rollout.vllm_engine``): its section ``vllm``
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tether.config.fields import knob
from tether.errors import ConfigError
from tether.plugins import EnginePlugin
from tether.vocabulary import SamplingParams


class _Torch(EnginePlugin):
    def check_here(self, cfg: Any) -> None:
        if cfg.rollout.decoder != "native":
            return
        from tether.decoding import native
        from tether.errors import NativeDecoderError

        try:
            native.library("native")
        except NativeDecoderError as e:
            raise ConfigError(str(e)) from e

    def build(self, cfg: Any, model_path: str, tokenizer: Any, stop_ids: Sequence[int], *, device: Any,
              threads: int, seed: int) -> Any:
        from tether.modeling import load_causal_lm
        from tether.rollout.torch_engine import TorchEngine

        model, _ = load_causal_lm(model_path)
        return TorchEngine(model.to(device), pad_id=tokenizer.pad_token_id, stop_ids=stop_ids,
                           decoder=cfg.rollout.decoder)


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


class _Vllm(EnginePlugin):
    def check(self, cfg: Any) -> None:
        rank = cfg.train.lora_rank
        if rank > VLLM_LORA_RANKS[-1]:
            raise ConfigError(f"train.lora_rank={rank} is above the largest rank vLLM serves "
                              f"({VLLM_LORA_RANKS[-1]}); lower train.lora_rank, or use rollout.engine=torch")
        try:  # where this Python runs the workers, its vLLM is theirs: a version too old is known now
            version = importlib.metadata.version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return
        from tether import registry

        if registry.backends.get(cfg.rollout.backend).local_workers:
            require_processed_logprobs(version)

    def check_here(self, cfg: Any) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(f"rollout.engine=vllm, but vLLM is not installed in this Python "
                              f"({sys.executable}); {VLLM_INSTALL_HINT}")

    def build(self, cfg: Any, model_path: str, tokenizer: Any, stop_ids: Sequence[int], *, device: Any,
              threads: int, seed: int) -> Any:
        from tether.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, stop_ids=stop_ids, device=device.type, options=cfg.vllm,
                          threads=threads, seed=seed, lora_rank=cfg.train.lora_rank)


TORCH = _Torch("torch", kinds=frozenset({"token", "step"}), keys=("rollout.decoder", "rollout.lora_apply"),
               inflight_updates=("drain", "keep", "recompute", "abort"), lora=True, devices=("cpu", "cuda"))
VLLM = _Vllm("vllm", kinds=frozenset({"token"}), section=("vllm", VllmSection),
             inflight_updates=("drain", "keep", "recompute", "abort"), lora=True, devices=("cpu", "cuda"),
             notes={"kinds": "vLLM serves language models"})


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
