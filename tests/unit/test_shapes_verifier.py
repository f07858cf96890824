"""The ``shapes`` verifier against images that are not the scene asked for: each way of gaming it
must earn a mean reward of at most 0.3 over the held-out prompts, while the task's own drawings
earn 1, and squares and circles are told apart."""

import random

import numpy as np
import pytest

from tether.families.flow import scenes
from tether.families.flow.task import split_scenes

HELD_OUT = split_scenes("eval")
GAMED = 0.3


def _boxes(scene: scenes.Scene, h: int, w: int) -> list[tuple[int, int]]:
    """Top-left corners of ``scene.count`` h × w boxes inside the named half, apart."""
    x0, y0, x1, y1 = scenes._half(scene.position)
    if scene.count == 1:
        return [(y0 + (y1 - y0 - h) // 2, x0 + (x1 - x0 - w) // 2)]
    if x1 - x0 >= 2 * w + 1:
        return [(y0 + (y1 - y0 - h) // 2, x0), (y0 + (y1 - y0 - h) // 2, x1 - w)]
    return [(y0, x0 + (x1 - x0 - w) // 2), (y1 - h, x0 + (x1 - x0 - w) // 2)]


def stamped(scene: scenes.Scene, mask: np.ndarray) -> np.ndarray:
    """``mask`` drawn ``scene.count`` times in the named colour in the named half, on black."""
    image = np.zeros((scenes.SIZE, scenes.SIZE, 3), np.uint8)
    h, w = mask.shape
    for y, x in _boxes(scene, h, w):
        image[y:y + h, x:x + w][mask] = scenes.COLOURS[scene.colour]
    return image


def bar(scene: scenes.Scene) -> np.ndarray:
    _, y0, _, y1 = scenes._half(scene.position)
    return np.ones((12, 3) if y1 - y0 == scenes.SIZE else (3, 12), bool)  # 36 pixels, a square's area


def ell(thickness: int = 3) -> np.ndarray:
    mask = np.zeros((7, 7), bool)
    mask[:, :thickness] = mask[-thickness:, :] = True
    return mask


def cross() -> np.ndarray:
    mask = np.zeros((7, 7), bool)
    mask[2:5, :] = mask[:, 2:5] = True
    return mask


def ring() -> np.ndarray:
    mask = np.ones((7, 7), bool)
    mask[2:5, 2:5] = False
    return mask


def half_painted(scene, rng):
    image = np.zeros((scenes.SIZE, scenes.SIZE, 3), np.uint8)
    x0, y0, x1, y1 = scenes._half(scene.position)
    image[y0:y1, x0:x1] = scenes.COLOURS[scene.colour]
    return image


def specks(scene, rng):
    image = np.zeros((scenes.SIZE, scenes.SIZE, 3), np.uint8)
    x0, y0, x1, y1 = scenes._half(scene.position)
    image[y0:y1:3, x0:x1:3] = scenes.COLOURS[scene.colour]
    return image


def grey_with_dots(scene, rng):
    image = np.full((scenes.SIZE, scenes.SIZE, 3), 100, np.uint8)
    x0, y0, x1, y1 = scenes._half(scene.position)
    for y in range(y0 + 1, y1 - 1, 4):
        for x in range(x0 + 1, x1 - 1, 4):
            image[y:y + 2, x:x + 2] = scenes.COLOURS[scene.colour]
    return image


def noise(scene, rng):
    return np.random.default_rng(rng.randrange(2 ** 31)).integers(0, 256, (scenes.SIZE, scenes.SIZE, 3),
                                                                   dtype=np.uint8)


def grey_background(scene, rng):
    image = scenes.render(scene, rng)
    return np.where(image.max(-1, keepdims=True) == 0, np.uint8(100), image)


DEGENERATE = {
    "the named half painted in the named colour": half_painted,
    "bars as squares, L-shapes as circles":
        lambda s, rng: stamped(s, bar(s) if s.shape == "square" else ell()),
    "bars": lambda s, rng: stamped(s, bar(s)),
    "L-shapes": lambda s, rng: stamped(s, ell()),
    "thick L-shapes (a square with a notch)": lambda s, rng: stamped(s, ell(4)),
    "crosses": lambda s, rng: stamped(s, cross()),
    "rings": lambda s, rng: stamped(s, ring()),
    "the named colour everywhere": lambda s, rng: np.broadcast_to(
        np.array(scenes.COLOURS[s.colour], np.uint8), (scenes.SIZE, scenes.SIZE, 3)).copy(),
    "white everywhere": lambda s, rng: np.full((scenes.SIZE, scenes.SIZE, 3), 255, np.uint8),
    "black": lambda s, rng: np.zeros((scenes.SIZE, scenes.SIZE, 3), np.uint8),
    "noise": noise,
    "specks in the named half": specks,
    "a grey background with dots": grey_with_dots,
    "the right scene on a grey background": grey_background,
}


def mean_score(make) -> float:
    rng = random.Random(0)
    return float(np.mean([scenes.score(s, make(s, rng)) for s in HELD_OUT for _ in range(2)]))


@pytest.mark.parametrize("case", list(DEGENERATE))
def test_a_degenerate_image_scores_low_on_the_held_out_prompts(case):
    assert mean_score(DEGENERATE[case]) <= GAMED


def test_one_fixed_scene_for_every_prompt_scores_low_whichever_it_is():
    """The best any single drawn scene does when shown for every held-out prompt: it follows 1.5 of
    a prompt's 4 words on average, and the reward squares the share."""
    best = max(float(np.mean([scenes.score(h, scenes.render(s, random.Random(0))) for h in HELD_OUT]))
               for s in scenes.all_scenes())
    assert best <= GAMED


def test_the_tasks_own_drawings_earn_the_full_reward():
    rng = random.Random(1)
    for scene in scenes.all_scenes():
        for _ in range(8):
            assert scenes.score(scene, scenes.render(scene, rng)) == 1.0, scene.prompt


def test_squares_and_circles_are_told_apart():
    """A circle drawn where a square is asked (and the reverse) fails the shape check and only it."""
    rng = random.Random(2)
    for scene in scenes.all_scenes():
        other = scenes.Scene(scene.count, scene.colour, "circle" if scene.shape == "square" else "square",
                             scene.position)
        got = scenes.checks(scene, scenes.render(other, rng))
        assert {k for k, ok in got.items() if not ok} == {"shape"}, (scene.prompt, got)


@pytest.mark.parametrize(("mask", "kind", "fails"), [
    (scenes._stamp("square"), "square", None),
    (scenes._stamp("circle"), "circle", None),
    (np.ones((12, 3), bool), None, "aspect"),
    (np.ones((5, 7), bool), None, "aspect"),
    (ell(3), None, "symmetry"),
    (ell(4), None, "symmetry"),
    (cross(), None, "solidity"),
    (ring(), None, "solidity"),
    (np.ones((8, 8), bool), None, "area"),
    (np.ones((4, 4), bool), None, "area"),
])
def test_each_form_is_judged_by_the_measure_that_tells_it(mask, kind, fails):
    ys, xs = np.nonzero(mask)
    form = scenes.form(list(zip(ys.tolist(), xs.tolist(), strict=True)))
    assert form.kind() == kind
    limits = {"aspect": form.aspect < scenes.MIN_ASPECT, "symmetry": form.symmetry < scenes.MIN_SYMMETRY,
              "solidity": form.solidity < scenes.MIN_SOLIDITY, "fill": form.fill < scenes.CIRCLE_FILL,
              "area": not scenes.SHAPE_AREA[0] <= form.area <= scenes.SHAPE_AREA[1]}
    assert limits[fails] if fails else not any(limits.values()), (form, limits)
