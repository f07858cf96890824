"""Tether's vocabulary: the records that cross its seams and the protocols of the seams.

Every layer speaks in these terms (docs/architecture.md draws the layers):

    records     Example, SamplingParams, Completion, DynamicSampling, WorkItem,
                GenerationRequest, RolloutBatch, WorkerLoss, TrainResult, LoopState, Capabilities
    protocols   RolloutPool, Learner, BoundaryHooks   the two seams of the driver loop, and its hooks
                Engine, TokenEngine                   what samples with a copy of the weights
                Payload, Sampler                      a family's scored batch, and what makes it
                Policy                                the learner's view of a family
                Family                                one policy family, whole (tether.families)

Pure Python: the control plane, the loop and the planner import it without loading torch.
Tensors appear as ``Any``. The learner's and a family's protocols (``Policy``, ``Capabilities``,
``DataBundle``, ``Family``) are in ``tether.vocabulary.family``, re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from tether.control.inflight import InflightMode

# -- data ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    """One prompt with its reference answer and whatever other fields its row had."""

    prompt: str
    answer: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    """The row's other columns (passed to reward functions); built-in tasks put their inputs here."""
    demonstration: str | None = None
    """A correct completion for supervised warm start (defaults to the answer)."""

    @property
    def target(self) -> str:
        return self.answer if self.demonstration is None else self.demonstration


@dataclass(frozen=True)
class SamplingParams:
    """How to sample tokens. ``temperature == 0`` means greedy."""

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0
    """Keep only the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches p (1 = off)."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def truncates(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)


FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of a prompt."""

    token_ids: list[int]
    logprobs: list[float]
    """log μ(token) under the distribution sampled from (temperature, top-k, top-p applied)."""
    versions: list[int]
    """The policy version that produced each token."""
    finish_reason: FinishReason


@dataclass(frozen=True)
class DynamicSampling:
    """DAPO's dynamic sampling, the ``rollout.dynamic_sampling*`` keys (``tether.rollout.dynamic``)."""

    max_draws: int = 3
    """A batch may generate at most ``max_draws × batch_size`` prompts in all."""
    on_short: Literal["error", "partial"] = "error"

    def extra_per_batch(self, batch_size: int) -> int:
        return (self.max_draws - 1) * batch_size


@dataclass(frozen=True)
class WorkItem:
    """One rollout batch for a worker to generate and score."""

    batch_index: int
    version: int
    examples: list[tuple[int, Example]]
    """(position in the prompt stream, example) for each prompt of the batch."""
    group_size: int
    params: SamplingParams
    seed: int
    dynamic: DynamicSampling | None = None
    """Dynamic sampling's settings, or None (the batch is its ``examples``, whatever they score)."""
    extra_examples: list[tuple[int, Example]] = field(default_factory=list)
    """With dynamic sampling: the batch's own slice of the extra stream, drawn from in order
    (positions −1 − p, p the position in that stream)."""


# -- the driver loop's records -------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationRequest:
    """One rollout batch to generate.

    ``index`` is the launch index: the data cursor in rollout batches (batch ``index`` of the
    prompt stream). ``version`` is the published version the batch is generated under.
    """

    index: int
    version: int


@dataclass(frozen=True)
class RolloutBatch:
    """A complete, scored rollout batch with its prompt groups intact.

    ``behavior_version`` is the oldest policy version that touched any of its tokens;
    ``newest_version`` the newest (equal unless weights changed mid-generation).
    ``payload`` is the world's own data (a family's ``Payload`` for the real world).
    """

    index: int
    behavior_version: int
    num_groups: int
    group_size: int
    payload: Any = None
    newest_version: int | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    completed_at: float | None = None
    """When the pool received the finished batch, in the driver's clock (``time.monotonic`` for
    real pools, virtual time for the simulated one); None if the pool does not say."""
    work_s: float | None = None
    """Seconds the worker spent generating and scoring it (the rest of launch → ready is queueing
    behind other batches and waiting to be reaped); None if unknown."""
    version_shares: Mapping[int, float] | None = None
    """The share of its completion tokens generated under each policy version (summing to 1);
    more than one version when weights changed mid-generation. None if the pool does not say."""

    def __post_init__(self) -> None:
        # a pool or fake built it wrong: an internal invariant, not a user's mistake
        assert self.num_groups >= 1 and self.group_size >= 1, (
            f"rollout batch {self.index}: num_groups and group_size must be >= 1, "
            f"got {self.num_groups} and {self.group_size}")
        assert self.newest_version is None or self.newest_version >= self.behavior_version, (
            f"rollout batch {self.index}: newest_version {self.newest_version} is older than "
            f"behavior_version {self.behavior_version}")

    @property
    def num_samples(self) -> int:
        return self.num_groups * self.group_size


@dataclass(frozen=True)
class WorkerLoss:
    """A rollout worker that died and was replaced (``rollout.on_worker_loss: replace``). The batch
    it was generating is no longer in flight: the driver launches it again as a new request."""

    worker: str
    cause: str
    batch_index: int | None
    """The batch it was generating, or None when it died idle."""
    restarts: int
    """Workers the pool has replaced so far, this one included."""


@dataclass(frozen=True)
class TrainResult:
    """What one rollout batch's training step did. ``committed_updates`` moves the clock."""

    committed_updates: int
    attempted_updates: int
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class LoopState:
    """Where a run stands between batches; all the loop needs to resume."""

    trained_batches: int = 0
    launched_batches: int = 0
    """Next fresh launch index (the data cursor, in rollout batches)."""
    dropped_batches: int = 0
    train_version: int = 0
    pending: tuple[int, ...] = ()
    """Launch indices abandoned by an interrupt before they trained; relaunched first on resume."""
    rollout_version: int | None = None
    """The version the engines held (last published). A resume that gives the engines these
    weights again continues exactly; None (older checkpoints) forces a publish on resume."""


def version_shares(versions: Iterable[Sequence[int]]) -> dict[int, float]:
    """version → the share of all the actions (tokens, denoising steps) sampled under it, oldest
    first; empty when there are none. ``versions``: each sample's per-action versions."""
    counts: dict[int, int] = {}
    for row in versions:
        for v in row:
            counts[v] = counts.get(v, 0) + 1
    total = sum(counts.values())
    return {v: counts[v] / total for v in sorted(counts)}


# -- the driver loop's seams ---------------------------------------------------------------------


@runtime_checkable
class RolloutPool(Protocol):
    """Generates rollout batches concurrently with the driver."""

    @property
    def inflight(self) -> int:
        """Launched generations not yet returned by ``reap``, ``wait`` or ``quiesce``."""
        ...

    def launch(self, request: GenerationRequest) -> None:
        """Start generating a batch; returns at once."""

    def reap(self) -> list[RolloutBatch]:
        """Every batch completed so far, in completion order, without blocking."""
        ...

    def wait(self, timeout: float | None) -> list[RolloutBatch]:
        """Block until at least one in-flight batch completes; return those completed."""
        ...

    def quiesce(self, timeout: float | None) -> list[RolloutBatch]:
        """Finish every in-flight generation and return the batches, in completion order;
        ``timeout`` bounds the wait for each next completion."""
        ...

    def publish(self, weights: Any, version: int) -> Mapping[str, float]:
        """Load ``weights`` as ``version`` into every engine: while quiesced, or — for a pool
        built for ``async.inflight_update`` other than drain — with generations running, which
        continue under the new weights."""
        ...

    def lost(self) -> list[WorkerLoss]:
        """Workers lost and replaced since the last call, oldest first (empty when none)."""
        ...

    def published_weights(self) -> Mapping[str, Any]:
        """A copy of the weights the engines hold now (a checkpoint written between two
        publications keeps them, so a resume gives the engines those very weights)."""
        ...


@runtime_checkable
class Learner(Protocol):
    """Trains on rollout batches and exports its weights for publication."""

    def train(self, batch: RolloutBatch, *, train_version: int) -> TrainResult:
        """Make up to U updates from ``batch``; report how many were committed."""
        ...

    def export_weights(self) -> Any:
        """The current weights, in whatever form this world's pool publishes."""
        ...


class BoundaryHooks(Protocol):
    """What happens at hard boundaries, after the drain and the publish."""

    def evaluate(self, step: int, version: int) -> Mapping[str, float]:
        """Evaluate the published weights after ``step`` trained batches."""
        ...

    def save(self, step: int, state: LoopState) -> None:
        """Checkpoint after ``step`` trained batches; nothing is outstanding."""


# -- rollout workers -----------------------------------------------------------------------------


class Engine(Protocol):
    """What a rollout worker needs of any family's engine: it samples with its own copy of the
    weights, which change only when told, as an explicit version."""

    @property
    def version(self) -> int:
        """The policy version of the weights in use now."""
        ...

    def load_weights(self, weights: Mapping[str, Any], version: int) -> None:
        """Copy ``weights`` (name → tensor) in as ``version``; only called while idle."""

    def bind(self, weights: Mapping[str, Any], version: int | None = None) -> None:
        """Sample from ``weights`` in place where it can (shared-memory or object-store views on
        the CPU), else copy them in; as ``version`` when given."""

    def watch(self, poll: Callable[[], int | None], inflight: InflightMode) -> None:
        """Without draining: call ``poll`` before every step of a generation (it binds newer
        weights when there are some and returns their version); ``inflight`` is the mode, whose
        declared ``on_switch`` (``tether.control.inflight``) says what happens to the sequences
        then. Called only with a mode its plug-in declares (``EnginePlugin.inflight_updates``)."""

    def take_up(self) -> int | None:
        """A safe point of the family's own (an agent's turn boundary): with ``watch`` set, take up
        the newest weights the worker holds now; their version, or None (nothing newer, no watch)."""

    def holding(self) -> AbstractContextManager[None]:
        """Inside, no weights are taken up mid-generation: every sequence sampled is one version's."""

    def use_adapter(self, scale: float, terms: Any | None = None) -> None:
        """Published weights are LoRA adapters from now on (``train.lora_rank``): applied at
        ``scale`` = α/r, merged into the weights, or with ``terms`` (the ``train`` section) as
        low-rank terms in the model's forward. Called only when its plug-in declares ``lora``."""

    def close(self) -> None:
        """Release what the engine holds (another process, a device)."""


class TokenEngine(Engine, Protocol):
    """An engine of token sequences (the built-in engine, vLLM): token ids in, completions with
    per-token log-probs of the distribution actually sampled and per-token versions out."""

    def generate(self, prompts: Sequence[Sequence[int]], *, samples_per_prompt: int,
                 params: SamplingParams, seed: int) -> list[list[Completion]]:
        """``samples_per_prompt`` completions for each prompt, grouped by prompt, in order; the
        same seed, weights and inputs give the same tokens."""
        ...

    def take_counts(self) -> tuple[int, int]:
        """(tokens wasted by abort, weight switches) since the last call."""
        ...

    def report(self) -> dict[str, float]:
        """Engine-specific figures of the last batch (``rollout/*``), merged into its metrics."""
        ...


class Payload(Protocol):
    """A family's scored rollout batch as a worker sends it: B prompt groups of G samples."""

    group_size: int
    metrics: dict[str, float]

    @property
    def num_groups(self) -> int: ...

    def check(self) -> None:
        """Raise ``ValueError`` unless every group is whole."""

    def version_shares(self) -> dict[int, float]:
        """version → the share of its actions sampled under it (``version_shares``)."""
        ...

    def sample_lines(self) -> list[dict]:
        """What to record of each sample (``FamilyBase.recorders``), JSON-ready; [] records nothing."""
        ...


class Sampler(Protocol):
    """A family's side of one rollout worker: its engine, and generating + scoring one batch."""

    engine: Engine

    def generate(self, item: WorkItem) -> Payload: ...

    def close(self) -> None:
        """Release what it holds besides its engine (environment threads); the worker then closes
        the engine."""


# the family's protocols, which name the records above
from tether.vocabulary.family import Capabilities, DataBundle, Evaluate, Family, Policy, Progress  # noqa: E402, F401
