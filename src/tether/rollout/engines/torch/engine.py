"""The built-in engine: any Hugging Face causal LM from a local directory, sampled in PyTorch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tether.decoding.sampling import sample, stepper_for
from tether.decoding.stops import StopStrings
from tether.rollout.engines import check_context
from tether.rollout.model_engine import ModelEngine
from tether.vocabulary import Completion, SamplingParams


class TorchEngine(ModelEngine):
    """Batched KV-cache sampling on a local model; stamps its version on every token."""

    def __init__(self, model: torch.nn.Module, *, pad_id: int, stop_ids: Sequence[int],
                 max_positions: int | None = None, version: int = 0, decoder: str = "auto",
                 stop_strings: StopStrings | None = None) -> None:
        super().__init__(model, version=version)
        self.pad_id = pad_id
        self.stop_ids = list(stop_ids)
        self.stop_strings = stop_strings
        """Text that also ends a completion, at the token that completes it (``tether.decoding.stops``)."""
        self.max_positions = max_positions or getattr(model.config, "max_position_embeddings", None)
        self.stepper = stepper_for(self.model, decoder=decoder)
        self.wasted_tokens = 0  # by abort, since the last ``take_counts``
        self.switches = 0

    def use_adapter(self, scale: float, terms=None) -> None:
        """As ``ModelEngine.use_adapter``; with low-rank ``terms`` the model's own forward samples
        (the lean decoders read merged weights)."""
        super().use_adapter(scale, terms)
        if terms is not None:
            from tether.decoding.sampling import transformers_stepper

            self.stepper = transformers_stepper(self.model)

    def take_counts(self) -> tuple[int, int]:
        """(tokens wasted by abort, weight switches) since the last call."""
        counts = (self.wasted_tokens, self.switches)
        self.wasted_tokens = self.switches = 0
        return counts

    @property
    def decoder_path(self) -> str:
        """How the last batch was decoded: ``native`` (the native decoder), ``python`` (the lean
        decoder's Python path) or ``transformers`` (the model's own forward)."""
        return self.stepper.path

    def report(self) -> dict[str, float]:
        """Which decoder sampled the last batch (``rollout.decoder``)."""
        return {"rollout/native_decoder": float(self.decoder_path == "native")}

    def generate(self, prompts: Sequence[Sequence[int]], *, samples_per_prompt: int,
                 params: SamplingParams, seed: int) -> list[list[Completion]]:
        check_context(prompts, params, self.max_positions)
        # one generator per batch on the engine's device: the same seed draws the same tokens on
        # the same kind of device (CPU and CUDA streams differ)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        out = sample(self.model, [list(p) for p in prompts], params, stop_ids=self.stop_ids,
                     pad_id=self.pad_id, generator=generator, stepper=self.stepper,
                     samples_per_prompt=samples_per_prompt, version=self._version, poll=self.poll,
                     inflight=self.inflight, stop_strings=self.stop_strings)
        self.wasted_tokens += out.wasted_tokens
        self.switches += out.switches
        completions = [
            Completion(token_ids=t, logprobs=lp, versions=vs, finish_reason=f)  # type: ignore[arg-type]
            for t, lp, vs, f in zip(out.tokens, out.logprobs, out.versions, out.finish_reasons, strict=True)
        ]
        n = samples_per_prompt
        return [completions[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _weights_changed(self) -> None:
        self.stepper.invalidate()
