"""vLLM's plug-in (``rollout.engine=vllm``): its section (``section.VllmSection``), what it
supports, its limits checked at config load (LoRA ranks; its version where this Python runs the
workers), and building ``engine.VLLMEngine`` in a worker. Importing it loads neither torch nor vLLM."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from collections.abc import Sequence
from typing import Any

from tether.control.inflight import INFLIGHT_UPDATE_CHOICES
from tether.errors import ConfigError
from tether.plugins import WEIGHT_CHANNELS, EnginePlugin
from tether.rollout.engines.vllm.section import (
    VLLM_INSTALL_HINT,
    VLLM_LORA_RANKS,
    VllmSection,
    require_processed_logprobs,
)


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
              threads: int, seed: int, stop_strings: Sequence[str] = ()) -> Any:
        from tether.rollout.engines.vllm.engine import VLLMEngine

        return VLLMEngine(model_path, stop_ids=stop_ids, device=device.type, options=cfg.vllm,
                          threads=threads, seed=seed, lora_rank=cfg.train.lora_rank,
                          stop_strings=stop_strings)


VLLM = _Vllm("vllm", kinds=frozenset({"token"}), section=("vllm", VllmSection),
             inflight_updates=INFLIGHT_UPDATE_CHOICES, lora=True, devices=("cpu", "cuda"),
             dtypes=("float32", "bfloat16", "float16"), dtype_key="vllm.dtype",
             weight_channels=WEIGHT_CHANNELS,
             notes={"kinds": "vLLM serves language models"})
