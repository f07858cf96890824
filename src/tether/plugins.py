"""What an engine (``rollout.engine``) or a rollout backend (``rollout.backend``) declares about
itself: its recipe section and keys, what it supports, its checks, and how it is built.

A recipe is checked against these declarations when it is read (``tether.config.features``), the
same way for a built-in plug-in and a registered one (``tether.register_engine``,
``tether.register_backend``); nothing asks an engine or backend by name. Importing this module
loads no torch.

Kinds of engine a family asks for (``Capabilities.engine_kind``):

    token   token ids in, completions with per-token log-probs and versions out
            (``tether.vocabulary.TokenEngine``): the text and agent families
    step    the family builds its own engine over its model (``tether.rollout.model_engine``),
            e.g. a flow model's denoising steps; the engine plug-in lends it the worker's torch

Weight channels a backend delivers published weights through (an engine declares those it can
sample from):

    shared_memory   a file in /dev/shm the worker maps (local workers)
    object_store    Ray's object store (Ray actors)
    in_process      the learner's own tensors, copied in (workers in the driver's process)
    collective      a torch.distributed broadcast from the learner's process (``rollout.weight_sync=
                    collective``; ``tether.rollout.collective``): an engine takes it only when it
                    declares it, since its worker must join the group and load what it receives
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tether.errors import PluginError

ENGINE_KINDS = ("token", "step")
WEIGHT_CHANNELS = ("shared_memory", "object_store", "in_process", "collective")
HOST_CHANNELS = WEIGHT_CHANNELS[:3]
"""The channels an engine takes unless it declares otherwise: those that hand it tensors."""
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EnginePlugin:
    """One ``rollout.engine`` choice. Subclass it for ``check``, ``check_here`` and ``build``."""

    name: str
    kinds: frozenset[str] = frozenset({"token"})
    """The kinds of engine it is (``ENGINE_KINDS``): a family runs with it when its
    ``Capabilities.engine_kind`` is among them."""
    section: tuple[str, type] | None = None
    """Its own recipe section (name, frozen dataclass of ``knob`` fields), read only when it is
    chosen; None when it has none."""
    keys: tuple[str, ...] = ()
    """Keys of shared sections only it reads (``section.key``)."""
    inflight_updates: tuple[str, ...] = ("drain",)
    """``async.inflight_update`` modes it runs: anything but drain needs ``watch`` (switch weights
    between steps and stamp each token's version)."""
    lora: bool = False
    """Whether it samples from published LoRA adapters (``train.lora_rank``; ``use_adapter``)."""
    devices: tuple[str, ...] = ("cpu",)
    """Device types it samples on (a backend says where its workers run)."""
    weight_channels: tuple[str, ...] = HOST_CHANNELS
    """Channels it can take published weights from (``WEIGHT_CHANNELS``; ``collective`` only when
    declared)."""
    dtypes: tuple[str, ...] = ("float32",)
    """Precisions it samples in (its weights and activations; ``DTYPES``)."""
    dtype_key: str | None = None
    """The key a recipe picks one of ``dtypes`` with (``section.key``: ``rollout.dtype`` for the
    built-in engine, ``vllm.dtype`` for vLLM), or None when it samples in ``dtypes[0]`` alone. A key
    of a shared section is one of its ``keys`` (added when not listed)."""
    notes: Mapping[str, str] = field(default_factory=dict)
    """Why something is not supported, by axis (``inflight_updates``, ``lora``, ``devices``,
    ``weight_channels``, ``dtypes``): added to the refusal."""

    def dtype(self, cfg: Any) -> str:
        """The precision the recipe asks it to sample in."""
        if self.dtype_key is None:
            return self.dtypes[0]
        section, name = self.dtype_key.split(".")
        return getattr(cfg.section(section), name)

    def __post_init__(self) -> None:
        check_declared(self)
        if not self.kinds or not set(self.kinds) <= set(ENGINE_KINDS):
            raise PluginError(f"engine {self.name!r} declares kinds {sorted(self.kinds)}; each must be one "
                              f"of {', '.join(ENGINE_KINDS)}")
        key = self.dtype_key
        if key is not None and key.split(".")[0] != section_name(self) and key not in self.keys:
            object.__setattr__(self, "keys", (*self.keys, key))

    def check(self, cfg: Any) -> None:
        """Rules of its own keys, at config load (any Python)."""

    def check_here(self, cfg: Any) -> None:
        """With local workers (which run this Python): refuse at once what cannot run here."""

    def build(self, cfg: Any, model_path: str, tokenizer: Any, stop_ids: Sequence[int], *, device: Any,
              threads: int, seed: int, stop_strings: Sequence[str] = ()) -> Any:
        """A ``tether.vocabulary.TokenEngine`` inside a rollout worker (token engines). A completion
        ends at the first token among ``stop_ids`` or the token that completes one of
        ``stop_strings`` (text of several tokens, matched on what was sampled; the agent family
        passes them only when the recipe has some: ``tether.decoding.stops``), that token included."""
        raise NotImplementedError(f"engine {self.name!r} builds no token engine")


@dataclass(frozen=True)
class BackendPlugin:
    """One ``rollout.backend`` choice. Subclass it for ``check``, ``check_here``, ``session``
    and ``pool``."""

    name: str
    section: tuple[str, type] | None = None
    """Its own recipe section (name, frozen dataclass of ``knob`` fields), or None."""
    keys: tuple[str, ...] = ()
    """Keys of shared sections only it reads (``section.key``)."""
    weight_channel: str = "shared_memory"
    """How its workers receive published weights (``WEIGHT_CHANNELS``): ``rollout.weight_sync=auto``."""
    other_channels: tuple[str, ...] = ()
    """Channels its pool also delivers through when ``rollout.weight_sync`` asks for one."""
    inflight_updates: tuple[str, ...] = ("drain",)
    """``async.inflight_update`` modes its pool runs: anything but drain needs weights that reach
    workers while they generate."""
    notes: Mapping[str, str] = field(default_factory=dict)
    """Why something is not supported, by axis (``inflight_updates``): added to the refusal."""
    supervised: bool = False
    """Train in a child process with ``tether train`` as its parent, which reports an end the run
    could not (``tether.runtime.supervise``)."""
    local_workers: bool = True
    """Its workers run this Python on this machine, so what they need is checked here at once."""

    def __post_init__(self) -> None:
        check_declared(self)
        for field_, channel in [("weight_channel", self.weight_channel),
                                *(("other_channels", c) for c in self.other_channels)]:
            if channel not in WEIGHT_CHANNELS:
                raise PluginError(f"backend {self.name!r} declares {field_}={channel!r}; "
                                  f"it must be one of {', '.join(WEIGHT_CHANNELS)}")

    def channel(self, cfg: Any) -> str:
        """The channel the recipe's ``rollout.weight_sync`` picks (``WEIGHT_CHANNELS``)."""
        asked = cfg.rollout.weight_sync
        return self.weight_channel if asked == "auto" else {"shm": "shared_memory"}.get(asked, asked)

    def worker_device(self, cfg: Any) -> str:
        """The device type its workers sample on (``DEVICES``)."""
        return "cpu"

    def warm_up(self, cfg: Any) -> None:
        """Start, ahead of ``pool``, what starting its workers will wait for; called as the learner
        builds, so that the two overlap. Nothing by default."""

    def check(self, cfg: Any) -> None:
        """Rules of its own keys (config time)."""

    def check_here(self, cfg: Any) -> None:
        """Refuse at once, before anything starts, a backend this Python cannot drive."""

    def session(self, cfg: Any, run_dir: Path) -> contextlib.AbstractContextManager[Any]:
        """What the run holds open for this backend; yields it (or None) to ``pool``."""
        return contextlib.nullcontext()

    def pool(self, settings: Any, batches: Callable[[int], Sequence[Any]], weights: Any, session: Any, *,
             initial_version: int, extras: Callable[[int], Sequence[Any]] | None) -> Any:
        """The ``tether.vocabulary.RolloutPool`` of the run."""
        raise NotImplementedError


def section_name(plugin: Any) -> str | None:
    """The name of a plug-in's own section (an engine, backend or family), or None."""
    section = plugin.section
    return section[0] if section is not None else None


def check_declared(plugin: Any) -> None:
    """What every plug-in that may own a section declares (an engine, a backend, a family): its
    ``name`` an identifier, its own ``section`` (name, dataclass) or None; a section name another
    section has is refused when the recipe is read (``tether.config.config.plugin_section_classes``)."""
    import dataclasses

    if not (isinstance(plugin.name, str) and plugin.name.isidentifier()):
        raise PluginError(f"a plug-in name must be an identifier (letters, digits, _), got {plugin.name!r}")
    section = plugin.section
    if section is None:
        return
    if not (isinstance(section, tuple) and len(section) == 2 and isinstance(section[0], str)
            and section[0].isidentifier() and dataclasses.is_dataclass(section[1])):
        raise PluginError(f"{plugin.name!r} declares section={section!r}; give (name, a frozen "
                          "dataclass of tether knob fields)")
