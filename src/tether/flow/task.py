"""The flow family's data: the built-in ``shapes`` prompts with their held-out split, and image
rewards (the task's pixel verifier or a user's function).

An image reward has the text reward's signature with the image in place of the completion::

    def reward(prompt: str, image: numpy.ndarray, answer: str, fields: Mapping[str, Any]) -> float

``image`` is (H, W, 3) uint8 RGB. ``reward.function=task`` is ``shapes``' own verifier.
"""

from __future__ import annotations

import random

from tether.data.rewards import Scorer, check_signature
from tether.data.source import DataBundle
from tether.data.types import Example
from tether.errors import ConfigError
from tether.flow import scenes

TASKS = ("shapes",)


def held_out(scene: scenes.Scene) -> bool:
    """A quarter of the 64 prompts, never trained on (by RL or the warm start): those whose
    attribute indices sum to 0 mod 4, so each colour, count, shape and position is held out in
    equal measure and every held-out prompt is a new combination of words seen in training."""
    idx = (scene.count - 1, list(scenes.COLOURS).index(scene.colour), scenes.SHAPES.index(scene.shape),
           scenes.POSITIONS.index(scene.position))
    return sum(idx) % 4 == 0


def split_scenes(split: str) -> list[scenes.Scene]:
    return [s for s in scenes.all_scenes() if held_out(s) == (split == "eval")]


def examples(split: str, n: int, *, seed: int) -> list[Example]:
    """``n`` examples of ``split``: its prompts in a seeded order, repeated as often as needed."""
    pool = split_scenes(split)
    rng = random.Random(f"shapes/{split}/{seed}")
    out: list[Example] = []
    while len(out) < n:
        order = list(pool)
        rng.shuffle(order)
        out.extend(s.example() for s in order[: n - len(out)])
    return out


def flow_data(task: str, num_train: int, num_eval: int, *, seed: int) -> DataBundle:
    if task not in TASKS:
        raise ConfigError(f"data.task={task!r} is not an image task; model.family=flow has: "
                          f"{', '.join(TASKS)}")
    return DataBundle(train=examples("train", num_train, seed=seed),
                      eval=examples("eval", num_eval, seed=seed), stop_text="", skipped_long_prompts=0,
                      description=f"task {task}")


def flow_scorer(spec: str, *, task: str | None) -> Scorer:
    """The image reward named by ``reward.function``."""
    if spec == "task":
        if task not in TASKS:
            raise ConfigError(f"reward.function=task with model.family=flow needs data.task in {TASKS}")
        return Scorer(scenes.verify, "shapes")
    if ":" in spec:
        from tether.data.pyload import load_python_object

        fn = load_python_object(spec, what="reward function")
        check_signature(fn, spec)
        return Scorer(fn, spec)
    raise ConfigError(f"reward.function={spec!r} scores text; with model.family=flow use 'task' or "
                      "path/to/file.py:function taking (prompt, image, answer, fields)")
