"""The built-in engine's plug-in (``rollout.engine=torch``): its keys (``rollout.decoder``,
``rollout.lora_apply``), what it supports, and building ``engine.TorchEngine`` in a worker.
Importing it loads no torch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tether.control.inflight import INFLIGHT_UPDATE_CHOICES
from tether.errors import ConfigError
from tether.plugins import EnginePlugin


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
        from tether.rollout.engines.torch.engine import TorchEngine

        model, _ = load_causal_lm(model_path)
        return TorchEngine(model.to(device), pad_id=tokenizer.pad_token_id, stop_ids=stop_ids,
                           decoder=cfg.rollout.decoder)


TORCH = _Torch("torch", kinds=frozenset({"token", "step"}), keys=("rollout.decoder", "rollout.lora_apply"),
               inflight_updates=INFLIGHT_UPDATE_CHOICES, lora=True, devices=("cpu", "cuda"))
