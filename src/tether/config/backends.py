"""The recipe sections of the backends a run may use instead of the built-in ones: Ray for
rollout workers and the learner (``ray``), vLLM as the engine (``vllm``). Part of the schema
(``tether.config.schema.SECTIONS``); each section is refused when its backend is not chosen."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tether.config.fields import knob


@dataclass(frozen=True)
class RaySection:
    """The Ray backend (used when rollout.backend=ray)."""

    address: str = knob(
        "",
        "Ray cluster to connect to ('auto', 'host:6379' or 'ray://host:10001'); empty = start a "
        "local Ray instance for this run (no dashboard, no usage reporting, temp dir in the run "
        "directory) and shut it down at the end.",
    )
    local_cpus: int = knob(
        0, "CPUs the local Ray instance offers (0 = all of this machine's). Ignored with ray.address.",
        min=0,
    )
    cpus_per_worker: float = knob(
        0.0, "CPUs each rollout actor requests (0 = rollout.threads_per_worker).", min=0
    )
    learner: Literal["driver", "actor"] = knob(
        "driver",
        "Where the learner (and held-out evaluation) runs: 'driver' = in the `tether train` "
        "process; 'actor' = in a Ray actor of its own requesting train.threads CPUs, its weights "
        "going straight from it to the object store. With 'actor' on a cluster, the run directory "
        "must be on a filesystem the learner's node sees (it writes the checkpoints).",
    )
    learner_placement: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = knob(
        "PACK",
        "With ray.learner=actor and train.world_size > 1: the Ray placement group strategy of the "
        "ranks' bundles (train.threads CPUs each, plus one GPU when train.device is CUDA), reserved "
        "together before any rank starts. PACK = as few nodes as fit (one node's fast links when it "
        "has room); STRICT_PACK = one node or refuse; SPREAD / STRICT_SPREAD = across nodes.",
    )
    gpus_per_worker: float = knob(
        0.0,
        "GPUs each rollout actor requests; above 0 the actor's engine samples on its GPU (CUDA, "
        "float32 weights copied in at every publication; fractions share a GPU). 0 = sample on "
        "CPUs. The learner trains where train.device says.",
        min=0,
    )


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
