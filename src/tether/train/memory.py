"""What the learner says when it runs out of memory: in which phase, and which keys lower that
phase's memory (``LearnerMemoryError``).

An allocation that fails — ``torch.OutOfMemoryError`` on a GPU, a ``MemoryError`` on the CPU — is
turned into one error naming the phase it failed in, the recipe's settings that size it and the
keys that lower it. The run then ends as after any learner error: nothing of the failed batch is
saved, the run directory keeps its newest checkpoint, and ``tether train`` says how to resume.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tether.errors import LearnerMemoryError
from tether.procinfo import MARKS_ENV

PHASES = {
    "old": "π_old and the reference (forwards without gradients, before the batch's updates)",
    "update": "an update's forward and backward",
    "optimizer": "the optimizer step",
    "publication": "the publication (the weights gathered for the engines)",
}
"""Each phase's words, by the name ``phase`` takes."""


def knobs(name: str, train: Any, *, bf16: bool = True) -> list[str]:
    """The keys that lower phase ``name``'s memory, each with why; ones already at their lowest
    setting are left out, and ``train.dtype=bfloat16`` where the family has no bfloat16 learner
    (``bf16`` False)."""
    if train.max_tokens_per_micro_batch:
        micro = (f"train.max_tokens_per_micro_batch: fewer tokens per forward (now "
                 f"{train.max_tokens_per_micro_batch}; halve it)")
    else:
        micro = (f"train.micro_batch_size: fewer sequences per forward (now {train.micro_batch_size}"
                 f"{', a whole mini-batch' if train.micro_batch_size == 0 else ''}; halve it), or "
                 "train.max_tokens_per_micro_batch: pack them by a token budget")
    ranks = f"train.world_size: more learner ranks, each holding a shard (now {train.world_size})"
    lora = "train.lora_rank: train LoRA adapters, not every weight (gradients and AdamW state for them alone)"
    bf16 = [] if train.dtype == "bfloat16" or not bf16 else [
        "train.dtype=bfloat16: half the bytes of every activation"]
    out = {
        "old": [micro, *bf16, ranks],
        "update": [micro, *([] if train.activation_checkpointing else [
            "train.activation_checkpointing=true: keep each layer's input only, recompute the rest in "
            "the backward"]), *bf16, *([] if train.lora_rank else [lora]), ranks],
        "optimizer": [*([] if train.lora_rank else [lora]), ranks],
        "publication": [*([] if train.lora_rank else ["train.lora_rank: publish the adapters, not every "
                                                       "weight"])],
    }[name]
    return out


def explain(name: str, train: Any, *, bf16: bool = True) -> str:
    lines = [f"the learner ran out of memory in {PHASES[name]}"]
    if found := knobs(name, train, bf16=bf16):
        lines.append("what lowers it: " + "; ".join(found))
    return ". ".join(lines)


_open_phases: list[str] = []
"""The marks of the phases this process is in, innermost last (kept only under ``MARKS_ENV``)."""


def _mark(folder: str) -> None:
    with contextlib.suppress(OSError):  # a folder removed under a closing run
        Path(folder, str(os.getpid())).write_text(_open_phases[-1] if _open_phases else "")


@contextlib.contextmanager
def phase(name: str, train: Any, *, bf16: bool = True) -> Iterator[None]:
    """Run a phase of the learner's work; an allocation that fails in it becomes a
    ``LearnerMemoryError`` saying so (one raised by a phase inside it passes through). ``bf16``:
    whether the family has a bfloat16 learner to offer. Under ``MARKS_ENV`` the phase is marked for
    the time it runs, with what would explain running out of memory in it."""
    assert name in PHASES, name
    folder = os.environ.get(MARKS_ENV)  # a learner process's phase, for whoever outlives it
    if folder:
        _open_phases.append(f"{PHASES[name]}\n{explain(name, train, bf16=bf16)}")
        _mark(folder)
    try:
        yield
    except (torch.OutOfMemoryError, MemoryError) as exc:
        raise LearnerMemoryError(explain(name, train, bf16=bf16)) from exc
    finally:
        if folder:
            _open_phases.pop()
            _mark(folder)
