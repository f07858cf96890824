"""The flow family's data: the built-in ``shapes`` prompts with their held-out split, and image
rewards (the task's pixel verifier or a user's function).

An image reward has the text reward's signature with the image in place of the completion::

    def reward(prompt: str, image: numpy.ndarray, answer: str, fields: Mapping[str, Any]) -> float

``image`` is (H, W, 3) uint8 RGB. ``reward.function=task`` is ``shapes``' own verifier.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tether import registry
from tether.data.rewards import Scorer, check_signature
from tether.errors import ConfigError
from tether.families.flow import scenes
from tether.vocabulary import DataBundle, Example


def held_out(scene: scenes.Scene) -> bool:
    """A quarter of the 64 prompts, never trained on (by RL or the warm start): those whose
    attribute indices sum to 0 mod 4, so each colour, count, shape and position is held out in
    equal measure and every held-out prompt is a new combination of words seen in training."""
    idx = (scene.count - 1, list(scenes.COLOURS).index(scene.colour), scenes.SHAPES.index(scene.shape),
           scenes.POSITIONS.index(scene.position))
    return sum(idx) % 4 == 0


def split_scenes(split: str) -> list[scenes.Scene]:
    return [s for s in scenes.all_scenes() if held_out(s) == (split == "eval")]


@dataclass(frozen=True)
class ImageTask:
    """A built-in task of the flow family: prompts, and a verifier of images (``data.task``)."""

    name: str
    description: str
    family: str = "flow"
    difficulties: tuple[int, ...] = (1,)
    default_difficulty: int = 1
    stop: str = ""

    def examples(self, split: str, n: int, *, seed: int = 0, difficulty: int | None = None) -> list[Example]:
        """``n`` examples of ``split``: its prompts in a seeded order, repeated as often as needed."""
        pool = split_scenes(split)
        rng = random.Random(f"shapes/{split}/{seed}")
        out: list[Example] = []
        while len(out) < n:
            order = list(pool)
            rng.shuffle(order)
            out.extend(s.example() for s in order[: n - len(out)])
        return out

    def verify(self, prompt: str, image, answer: str, fields) -> float:
        return scenes.verify(prompt, image, answer, fields)


SHAPES = ImageTask("shapes", "16×16 images of one or two coloured squares or circles on a side, scored from "
                   "pixels (count, colour, shape, position)")


def flow_data(cfg) -> DataBundle:
    """The recipe's prompts, train and held-out: a built-in image task's, or a prompt file's
    (``data.dataset``: a .txt of one prompt a line, as Flow-GRPO's, or any dataset form with a
    prompt column; an answer column is optional and reaches the reward)."""
    d = cfg.data
    if d.dataset:
        from tether.data.source import dataset_description, dataset_splits

        train, held_out = dataset_splits(d, seed=cfg.run.seed, answers=False)
        return DataBundle(train=train, eval=held_out[: d.num_eval], stop_text="", skipped_long_prompts=0,
                          description=dataset_description(d))
    task = registry.tasks.get(d.task)
    return DataBundle(train=task.examples("train", d.num_train, seed=cfg.run.seed),
                      eval=task.examples("eval", d.num_eval, seed=cfg.eval_seed), stop_text="",
                      skipped_long_prompts=0, description=f"task {task.name}")


def flow_scorer(cfg) -> Scorer:
    """The image reward named by ``reward.function`` (or the weighted sum of ``reward.functions``):
    ``task`` (the task's verifier), or path/to/file.py:function taking (prompt, image, answer, fields)."""
    from tether.data.rewards import scorer_of

    return scorer_of(cfg, lambda spec: _image_reward(cfg, spec))


def _image_reward(cfg, spec: str) -> Scorer:
    if spec == "task":
        task = registry.tasks.get(cfg.data.task)
        return Scorer(task.verify, task.name)
    if ":" in spec:
        from tether.pyload import load_python_object

        fn = load_python_object(spec, what="reward function")
        check_signature(fn, spec)
        return Scorer(fn, spec)
    raise ConfigError(f"reward.function={spec!r} scores text; with model.family=flow use 'task' or "
                      "path/to/file.py:function taking (prompt, image, answer, fields)")
