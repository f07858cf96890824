"""The engines a token family's rollout workers can sample with (``rollout.engine``), as plug-ins.

An engine plug-in says which recipe keys are its own (so they are refused when another engine is
chosen), whether it can run in this Python, and builds the engine (``tether.vocabulary.TokenEngine``)
inside a worker. Importing this module loads no torch; ``build`` imports the engine itself.

    torch   the built-in engine (``tether.rollout.torch_engine``): any Hugging Face causal LM,
            with the native decoder on the CPU (``rollout.decoder``)
    vllm    vLLM (``tether.rollout.vllm_engine``): its section ``vllm``
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tether.errors import ConfigError
from tether.vocabulary import SamplingParams


@dataclass(frozen=True)
class EnginePlugin:
    """One ``rollout.engine`` choice."""

    name: str
    section: str | None = None
    """The recipe section only this engine reads."""
    keys: tuple[str, ...] = ()
    """Keys of shared sections only this engine reads (``section.key``)."""

    def check_here(self, cfg: Any) -> None:
        """With local workers (which run this Python): refuse at once what cannot run here."""

    def build(self, cfg: Any, model_path: str, tokenizer: Any, stop_ids: Sequence[int], *, device: Any,
              threads: int, seed: int) -> Any:
        raise NotImplementedError


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


class _Vllm(EnginePlugin):
    def check_here(self, cfg: Any) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(f"rollout.engine=vllm, but vLLM is not installed in this Python "
                              f"({sys.executable}); {VLLM_INSTALL_HINT}")

    def build(self, cfg: Any, model_path: str, tokenizer: Any, stop_ids: Sequence[int], *, device: Any,
              threads: int, seed: int) -> Any:
        from tether.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, stop_ids=stop_ids, device=device.type, options=cfg.vllm,
                          threads=threads, seed=seed, lora_rank=cfg.train.lora_rank)


TORCH = _Torch("torch", keys=("rollout.decoder", "rollout.lora_apply"))
VLLM = _Vllm("vllm", section="vllm")


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
