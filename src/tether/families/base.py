"""What most families share, as defaults a family class may keep or override.

A family (``tether.vocabulary.Family``) is registered as an instance; subclassing ``FamilyBase``
leaves a new family to say what a sample is (its sampler and payload), how the learner scores it
(its policy), how a model is built and evaluated, and what it supports (``Capabilities``).
Everything here imports lazily: config checks load a family without loading torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tether.vocabulary import Capabilities, DataBundle, Evaluate, Policy, Progress, Sampler


class FamilyBase:
    name: str = ""
    description: str = ""
    section: tuple[str, type] | None = None
    keys: tuple[str, ...] = ()
    """Keys of shared sections only this family reads (refused with another family)."""
    capabilities: Capabilities = Capabilities()
    warmstart_fields: tuple[str, ...] = ("loss",)
    records: str = "samples.jsonl"
    """The file in the run directory ``recorders`` writes the recorded samples to."""

    def check(self, cfg: Any) -> None:
        """No rules of its own."""

    def resolve(self, cfg: Any, explicit: set[str]) -> Any:
        """``cfg`` with this family's keys that follow ``train.algorithm`` filled in, except those in
        ``explicit`` (the dotted keys the recipe names); none here."""
        return cfg

    def norm_constant(self, cfg: Any) -> int:
        return cfg.rollout.max_new_tokens

    def plan_train_scale(self, cfg: Any) -> float:
        """What ``tether plan`` multiplies ``plan.train_time`` by for this recipe (1: it was timed
        on this recipe's updates)."""
        return 1.0

    def plan_lengths(self, cfg: Any) -> tuple[float, int]:
        """(mean, most) engine steps a sample takes, for ``tether plan``'s per-sequence model
        (0 mean: none, each batch takes plan.gen_time): the recipe's ``plan.mean_length`` tokens,
        at most ``rollout.max_new_tokens``."""
        return cfg.plan.mean_length, cfg.rollout.max_new_tokens

    def longest_sequence(self, cfg: Any) -> tuple[int | None, str]:
        """The most tokens one training row can hold (``train.max_tokens_per_micro_batch`` must
        hold it), and the keys that bound it; None: nothing bounds it (those keys would)."""
        return None, "no key"

    def recorders(self, cfg: Any, run_dir: Path) -> list[Any]:
        """``records`` (``metrics.record_every``) from payloads that say what to record of each
        sample (``sample_lines()``; [] records nothing)."""
        from tether.loop.observe import Recorder

        every = cfg.metrics.record_every
        return [Recorder(Path(run_dir) / self.records, every, lambda record: record.payload.sample_lines())
                ] if every else []

    def drains_at_turns(self, cfg: Any) -> bool:
        """Publications drain whole batches (no turns to stop at)."""
        return False

    def notes(self, cfg: Any) -> list[Any]:
        """None of its own."""
        return []

    def build_model(self, cfg: Any, out: Path, on_progress: Progress | None) -> str:
        from tether.errors import ConfigError

        raise ConfigError(f"model.family={self.name} cannot build a model: point model.path at an "
                          "existing model directory and set model.create_if_missing=false")

    def warmstart(self, cfg: Any, model_dir: Path, out: Path, on_progress: Progress | None) -> Any:
        from tether.errors import ConfigError

        raise ConfigError(f"tether warmstart fine-tunes an existing model; model.family={self.name} builds "
                          "and warm-starts its models itself (model.create_if_missing=true)")

    def build_differences(self, cfg: Any, path: Path) -> list[str]:
        return []

    def scorer(self, cfg: Any) -> Any:
        raise NotImplementedError

    def data(self, cfg: Any, model_path: Path) -> DataBundle:
        raise NotImplementedError

    def sampler(self, cfg: Any, model_path: str, stop_text: str, *, device: Any, threads: int,
                seed: int) -> Sampler:
        raise NotImplementedError

    def policy(self, cfg: Any) -> Policy:
        raise NotImplementedError

    def evaluator(self, cfg: Any, model: Any, tokenizer: Any, data: DataBundle, score: Any, *,
                  num_samples: int | None = None, run_dir: Path | None = None) -> Evaluate:
        raise NotImplementedError

    def eval_summary(self, cfg: Any, metrics: Mapping[str, float], samples: int) -> list[str]:
        """Every ``eval/*`` figure, one per line."""
        return [f"  {key.removeprefix('eval/')}: {value:.4g}" for key, value in sorted(metrics.items())
                if key.startswith("eval/")]

    def report(self, run_dir: Path, evals: list[dict[str, Any]], out: Path) -> list[Path]:
        return []

    def __repr__(self) -> str:
        return f"<family {self.name}>"


class PolicyBase:
    """What most policies share (``tether.vocabulary.Policy``): a checkpoint's model folder in the
    transformers layout (``config.json`` and ``model.safetensors``). ``load``, ``save``, ``batch``,
    ``forward``, ``kl`` and ``fast_forward`` are the family's own."""

    def write_folder(self, model: Any, folder: Path, weights: Mapping[str, Any] | None) -> None:
        model.config.save_pretrained(folder)
        if weights is not None:
            from safetensors.torch import save_file

            save_file({name: t.contiguous() for name, t in weights.items()},
                      str(Path(folder) / "model.safetensors"), metadata={"format": "pt"})

    def read_weights(self, folder: Path) -> Mapping[str, Any]:
        from safetensors.torch import load_file

        return load_file(str(Path(folder) / "model.safetensors"))

    def sliced_by_turn(self, batch: Any) -> bool:
        """Whether ``batch``'s columns carry their turn (``turn``, ``turn_return``: the agent
        family's per-turn credit and masked failures), so advantages are computed per (group, turn)
        slice (``tether.train.advantages.turn_advantages``); by default they are not."""
        return False
