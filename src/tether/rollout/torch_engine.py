"""The built-in engine: any Hugging Face causal LM from a local directory, sampled in PyTorch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from tether.decoding.sampling import SamplingParams, sample, stepper_for
from tether.modeling import bind_into, load_into
from tether.rollout.engine import Completion, check_context


class TorchEngine:
    """Batched KV-cache sampling on a local model; stamps its version on every token."""

    def __init__(self, model: torch.nn.Module, *, pad_id: int, stop_ids: Sequence[int],
                 max_positions: int | None = None, version: int = 0, decoder: str = "auto") -> None:
        self.model = model.eval()
        self.pad_id = pad_id
        self.stop_ids = list(stop_ids)
        self.max_positions = max_positions or getattr(model.config, "max_position_embeddings", None)
        self._version = version
        self.device = next(self.model.parameters()).device
        self.stepper = stepper_for(self.model, decoder=decoder)
        self.poll = None
        self.inflight_update = "keep"
        self.wasted_tokens = 0  # by abort, since the last ``take_counts``
        self.switches = 0

    def watch(self, poll, inflight_update: str) -> None:
        """Switch weights mid-generation: before every decode step ``poll`` puts newer weights in
        place (through ``bind``) and returns their version, or returns None;
        ``inflight_update`` (keep, recompute, abort) says what happens to the sequences then."""
        self.poll, self.inflight_update = poll, inflight_update

    def take_counts(self) -> tuple[int, int]:
        """(tokens wasted by abort, weight switches) since the last call."""
        counts = (self.wasted_tokens, self.switches)
        self.wasted_tokens = self.switches = 0
        return counts

    @property
    def decoder_path(self) -> str:
        """How the last batch was decoded: ``native`` (the native decoder), ``python`` (the lean
        decoder's Python path) or ``transformers`` (the model's own forward)."""
        return getattr(self.stepper, "path", "transformers")

    @property
    def version(self) -> int:
        return self._version

    def generate(self, prompts: Sequence[Sequence[int]], *, samples_per_prompt: int,
                 params: SamplingParams, seed: int) -> list[list[Completion]]:
        check_context(prompts, params, self.max_positions)
        # one generator per batch on the engine's device: the same seed draws the same tokens on
        # the same kind of device (CPU and CUDA streams differ)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        out = sample(self.model, [list(p) for p in prompts], params, stop_ids=self.stop_ids,
                     pad_id=self.pad_id, generator=generator, stepper=self.stepper,
                     samples_per_prompt=samples_per_prompt, version=self._version, poll=self.poll,
                     inflight_update=self.inflight_update)
        self.wasted_tokens += out.wasted_tokens
        self.switches += out.switches
        completions = [
            Completion(token_ids=t, logprobs=lp, versions=vs, finish_reason=f)  # type: ignore[arg-type]
            for t, lp, vs, f in zip(out.tokens, out.logprobs, out.versions, out.finish_reasons, strict=True)
        ]
        n = samples_per_prompt
        return [completions[i * n:(i + 1) * n] for i in range(len(prompts))]

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``weights`` into the model (from any device to the engine's), unless the model
        already uses them (bound views)."""
        load_into(self.model, weights)
        self.stepper.invalidate()
        self._version = version

    def bind(self, weights: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Use ``weights`` (e.g. shared-memory views) as the model's parameters, without copying;
        with ``version``, they are that version from now on (a new object per version). An engine
        on a GPU cannot sample from host memory, so there they are copied in instead."""
        if self.device.type != "cpu":
            self.load_weights(weights, self._version if version is None else version)
            return
        bind_into(self.model, weights)
        self.stepper.invalidate()
        if version is not None:
            self._version = version
