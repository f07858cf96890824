"""The built-in engine's plug-in (``rollout.engine=torch``): its keys (``rollout.decoder``,
``rollout.lora_apply``, ``rollout.dtype``), what it supports, and building ``engine.TorchEngine``
in a worker. Importing it loads no torch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tether.control.inflight import INFLIGHT_UPDATE_CHOICES
from tether.errors import ConfigError
from tether.plugins import WEIGHT_CHANNELS, EnginePlugin


class _Torch(EnginePlugin):
    def check(self, cfg: Any) -> None:
        r = cfg.rollout
        if r.decoder == "native" and r.dtype != "float32":
            raise ConfigError(f"rollout.decoder=native runs float32 only (its library multiplies with MKL's "
                              f"float32 packed GEMMs), and rollout.dtype={r.dtype}; set rollout.decoder=auto "
                              "or python (the lean decoder's Python path samples in any dtype), or "
                              "rollout.dtype=float32")

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
              threads: int, seed: int, stop_strings: Sequence[str] = ()) -> Any:
        import torch

        from tether.decoding.stops import StopStrings
        from tether.modeling import cast_parameters, check_dtype_on_device, load_causal_lm
        from tether.rollout.engines.torch.engine import TorchEngine

        check_dtype_on_device(cfg.rollout.dtype, device, key="rollout.dtype")  # a GPU worker without bfloat16
        # read in the dtype it samples in: a float32 copy first would be the worker's peak memory
        # (twice a bfloat16 model's); the rotary buffers stay float32 either way
        model, _ = load_causal_lm(model_path, dtype=getattr(torch, cfg.rollout.dtype))
        model = cast_parameters(model.to(device), cfg.rollout.dtype)
        return TorchEngine(model, pad_id=tokenizer.pad_token_id, stop_ids=stop_ids,
                           decoder=cfg.rollout.decoder,
                           stop_strings=StopStrings(tokenizer, stop_strings) if stop_strings else None)


TORCH = _Torch("torch", kinds=frozenset({"token", "step"}), keys=("rollout.decoder", "rollout.lora_apply"),
               inflight_updates=INFLIGHT_UPDATE_CHOICES, lora=True, devices=("cpu", "cuda"),
               dtypes=("float32", "bfloat16"), dtype_key="rollout.dtype", weight_channels=WEIGHT_CHANNELS,
               notes={"dtypes": "float16 is vLLM's, vllm.dtype"})
