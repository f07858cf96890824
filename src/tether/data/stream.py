"""The prompt stream: which prompts make up rollout batch k, for any k, deterministically.

Position p of the stream is example ``perm_e[p mod N]`` of epoch ``e = p // N``, each epoch a
fresh permutation seeded by (seed, e). Batch k holds positions ``k·B … k·B + B − 1``. Random
access by batch index is what makes resume exact: batch k is the same prompts whether the run got
there in one go or was interrupted, and no prompt is trained twice or skipped within an epoch.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from tether.errors import ConfigError
from tether.vocabulary import Example


class PromptStream:
    def __init__(self, examples: Sequence[Example], batch_size: int, *, seed: int = 0,
                 name: str = "") -> None:
        if not examples:
            raise ConfigError("the prompt stream needs at least one example")
        if batch_size < 1:
            raise ConfigError(f"rollout.batch_size must be >= 1, got {batch_size}")
        self.examples = list(examples)
        self.batch_size = batch_size
        self.seed = seed
        self.label = f"prompt-stream/{seed}" + (f"/{name}" if name else "")
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = list(range(len(self.examples)))
            random.Random(f"{self.label}/{epoch}").shuffle(perm)
            self._perms = {epoch: perm}  # batches move forward: keep only the current epoch
        return perm

    def batch(self, index: int) -> list[tuple[int, Example]]:
        """(stream position, example) for the prompts of rollout batch ``index``."""
        n = len(self.examples)
        out = []
        for pos in range(index * self.batch_size, (index + 1) * self.batch_size):
            out.append((pos, self.examples[self._perm(pos // n)[pos % n]]))
        return out
