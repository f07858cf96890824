"""The learner's view of a family (``Policy``) and a policy family whole (``Capabilities``,
``DataBundle``, ``Family``): part of Tether's vocabulary (``tether.vocabulary`` re-exports them).
Pure Python, as the rest of it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from tether.vocabulary import Example, Sampler

# -- the learner ----------------------------------------------------------------------------------


class Policy(Protocol):
    """What the learner asks of a family. A *column* of the training tensors is one action — a
    completion token, a denoising step — so advantages, losses, corrections, aggregation and
    every ratio metric are the same code for every family."""

    def load(self, path: str | Path, *, dtype: Any = None) -> tuple[Any, Any]:
        """(model, tokenizer or None) from a model directory, its parameters in ``dtype`` (a
        ``torch.dtype``; float32 when not given): the learner reads a LoRA run's frozen base in its
        compute dtype, without a float32 copy first. A ``load`` without ``dtype`` is read in
        float32, and its frozen part cast afterwards."""
        ...

    def save(self, model: Any, tokenizer: Any, folder: Path) -> None:
        """Write the whole model (and tokenizer) as a model directory ``load`` reads."""

    def batch(self, payload: Any) -> Any:
        """The payload as training tensors: an object with ``size``, ``group_size``, ``rewards``
        (N,), ``mask``, ``behavior_logp``, ``behavior_versions`` (N, T), ``truncated`` (N,),
        ``rows(index)``, ``to(device)`` and ``episode``: (N,), the unit each row belongs to when one
        unit of a group spans several rows (they share its reward and advantage), else None."""
        ...

    def write_folder(self, model: Any, folder: Path, weights: Mapping[str, Any] | None) -> None:
        """A checkpoint's model folder of ``weights`` gathered from learner ranks (None: sharded,
        the folder holds what describes the model only). ``PolicyBase``'s: a transformers layout."""

    def read_weights(self, folder: Path) -> Mapping[str, Any]:
        """The parameters a checkpoint's model folder holds (``write_folder``'s or ``save``'s), by name."""
        ...

    def forward(self, model: Any, batch: Any, *, with_entropy: bool = False,
                forward: Any = None) -> tuple[Any, Any, Any]:
        """(log-probs (n, T), entropies or None, what the KL term compares)."""
        ...

    def kl(self, basis: Any, ref_basis: Any, estimator: str) -> Any:
        """The per-column KL to the reference policy, (n, T)."""
        ...

    def fast_forward(self, model: Any, enabled: bool) -> Any:
        """A faster forward of ``model`` when asked for and possible, else None."""
        ...

    def sliced_by_turn(self, batch: Any) -> bool:
        """Whether ``batch``'s columns carry their turn (``turn`` (N, T) long, −1 outside a turn, and
        ``turn_return``), so advantages are computed per (group, turn) slice (``PolicyBase``'s: no)."""
        ...

    def layers(self, model: Any) -> list[Any]:
        """``model``'s repeated blocks in order (a language model's decoder layers, a transformer's
        blocks), the units learner ranks shard one by one and ``train.activation_checkpointing``
        recomputes; empty when it has none."""
        ...


# -- families -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Capabilities:
    """What a family can run with. A recipe asking for anything else is refused at load, with a
    message generated from this (``tether.config.features``)."""

    engine_kind: str = "token"
    """The kind of engine its sampler uses (``tether.plugins.ENGINE_KINDS``): any ``rollout.engine``
    that declares that kind runs it."""
    backends: tuple[str, ...] | None = None
    """``rollout.backend`` values it is limited to; None: any backend."""
    inflight_updates: tuple[str, ...] = ("drain",)
    """``async.inflight_update`` values: anything but drain needs a sampler whose engine switches
    weights between steps and stamps each action's version (the engine must declare them too)."""
    features: frozenset[str] = frozenset()
    """Optional features it supports, by name (``tether.config.features.FEATURES``)."""
    notes: Mapping[str, str] = field(default_factory=dict)
    """Why something is not supported, by feature name or axis (``engine_kind``, ``backends``,
    ``inflight_updates``): added to the refusal."""


@dataclass(frozen=True)
class DataBundle:
    """What a run trains and evaluates on."""

    train: list[Example]
    eval: list[Example]
    stop_text: str
    """Text that ends an answer besides EOS ('' = none)."""
    skipped_long_prompts: int
    description: str


Evaluate = Callable[[int], Mapping[str, float]]
"""Held-out evaluation after ``step`` trained batches → ``eval/*`` metrics."""

Progress = Callable[[int, Mapping[str, float]], None]
"""Told each step of long work (a warm start) and its figures."""


@runtime_checkable
class Family(Protocol):
    """One policy family: what a sample is, how it is generated, scored, trained and evaluated.
    A family is one folder under ``tether/families`` (or a user's module) and one
    ``tether.register_family`` call; the loop, the control plane, the pools and the learner do
    not know which family runs."""

    name: str
    description: str
    section: tuple[str, type] | None
    """Its own recipe section (name, frozen dataclass of ``knob`` fields), or None."""
    keys: tuple[str, ...]
    """Keys of shared sections only it reads (``section.key``; refused with another family)."""
    capabilities: Capabilities
    warmstart_fields: tuple[str, ...]
    """The figures a warm start reports, shown by its progress display."""

    def check(self, cfg: Any) -> None:
        """Refuse (``ConfigError``) combinations of keys this family cannot run."""

    def resolve(self, cfg: Any, explicit: set[str]) -> Any:
        """``cfg`` with this family's keys that follow ``train.algorithm`` (a preset's) filled in,
        except those in ``explicit`` (the dotted keys the recipe names, which win); ``FamilyBase``'s
        fills none."""
        ...

    def norm_constant(self, cfg: Any) -> int:
        """L_max: the most columns a sample can have (Dr. GRPO's normaliser)."""
        ...

    def plan_train_scale(self, cfg: Any) -> float:
        """What ``tether plan`` multiplies ``plan.train_time`` by for this recipe (``FamilyBase``'s:
        1, the time was measured on this recipe's updates)."""
        ...

    def plan_lengths(self, cfg: Any) -> tuple[float, int]:
        """(mean, most) engine steps a sample takes for ``tether plan``'s per-sequence model (the
        cost of in-flight switches); a mean of 0: no such model."""
        ...

    def longest_sequence(self, cfg: Any) -> tuple[int | None, str]:
        """The most tokens one training row can hold and the keys that bound it (None: nothing
        bounds it); ``train.max_tokens_per_micro_batch`` must hold it."""
        ...

    def notes(self, cfg: Any) -> list[Any]:
        """``AdmissionNote``s on this family's settings that run but do not do what they seem to
        (logged once at the start of a run)."""
        ...

    def recorders(self, cfg: Any, run_dir: Path) -> list[Any]:
        """``LoopObserver``s that record a run's samples in ``run_dir`` from each trained batch's
        payload (``BatchRecord.payload``), each line with its ``step`` (trimmed on resume); closed
        (``close()``) when the run ends. ``FamilyBase``'s writes its ``records`` file
        (``samples.jsonl``) from a payload's ``sample_lines()`` every ``metrics.record_every``
        batches."""
        ...

    def drains_at_turns(self, cfg: Any) -> bool:
        """Whether, with ``async.inflight_update=drain``, a publication waits only for the turns in
        flight (each generation stops at its next turn boundary and takes it up there) rather than
        for whole rollout batches."""
        ...

    def build_model(self, cfg: Any, out: Path, on_progress: Progress | None) -> str:
        """Create a new model directory at ``out`` (and warm-start it); returns one line saying
        how it went, for the log."""
        ...

    def warmstart(self, cfg: Any, model_dir: Path, out: Path, on_progress: Progress | None) -> Any:
        """``tether warmstart``: fine-tune the model in ``model_dir`` on the recipe's data into
        ``out``; a ``WarmstartResult``. ``FamilyBase``'s refuses (a family that builds and
        warm-starts its models itself)."""
        ...

    def build_differences(self, cfg: Any, path: Path) -> list[str]:
        """The recipe's build keys that differ from what built the model at ``path``; for a model
        Tether did not build (no ``warmstart.json``), those the recipe sets away from their defaults,
        which do nothing since the model is used as it is (``tether.data.prepare.unbuilt_keys``)."""
        ...

    def scorer(self, cfg: Any) -> Any:
        """The reward, as ``Scorer`` (loaded from ``reward.function``)."""
        ...

    def data(self, cfg: Any, model_path: Path) -> DataBundle:
        """Train and held-out examples (checked against the model, e.g. prompt lengths)."""
        ...

    def sampler(self, cfg: Any, model_path: str, stop_text: str, *, device: Any, threads: int,
                seed: int) -> Sampler:
        """The sampler one rollout worker runs, on ``device``."""
        ...

    def policy(self, cfg: Any) -> Policy:
        """The learner's view of this family."""
        ...

    def evaluator(self, cfg: Any, model: Any, tokenizer: Any, data: DataBundle, score: Any, *,
                  num_samples: int | None = None, run_dir: Path | None = None) -> Evaluate:
        """Held-out evaluation of ``model`` (it may write pictures under ``run_dir``)."""
        ...

    def eval_summary(self, cfg: Any, metrics: Mapping[str, float], samples: int) -> list[str]:
        """Lines ``tether eval`` prints for ``metrics``."""
        ...

    def report(self, run_dir: Path, evals: list[dict[str, Any]], out: Path) -> list[Path]:
        """This family's own plots for ``tether report`` (written into ``out``)."""
        ...
