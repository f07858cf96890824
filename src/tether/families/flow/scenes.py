"""The built-in image task ``shapes``: prompts from a small grammar, images drawn to match them,
and a reward read exactly from pixels.

A prompt names a count, a colour, a shape and a position: ``"two blue circles left"``. An image
is 16 × 16 RGB on black. A pixel is *lit* when its brightest channel is at least 128; a lit pixel
has a palette colour only when it is within ``COLOUR_RADIUS`` of it (so white is not yellow, nor
grey any colour); a *blob* is a 4-connected set of lit pixels of at least ``MIN_BLOB`` (smaller
ones are *specks*); a *shape* is a blob whose form (``Form``) is a square's or a circle's:
``SHAPE_AREA`` pixels, a bounding box near square (``MIN_ASPECT``), convex (``MIN_SOLIDITY``),
mirror-symmetric (``MIN_SYMMETRY``), and filling its box as a square (≥ ``SQUARE_FILL``) or a
circle (``CIRCLE_FILL`` up to that) does. So a bar, an L, a cross, a ring or a smear is a blob
and no shape. Five checks, from the pixels alone:

- colour: the shapes are the named colour (``COLOUR_SHARE`` of their pixels and of all lit ones);
- count: exactly the named number of shapes, and no other blob;
- shape: every blob is a shape of the named kind;
- position: the shapes lie in the named half (``POSITION_SHARE`` of their pixels and of all lit
  ones);
- background: something is drawn (``MIN_PIXELS`` lit), at least ``DARK_SHARE`` of the frame is
  unlit, the unlit pixels are near black (their brightest channels average at most
  ``DARK_MEAN``: no grey fill, no dim noise) and there are at most ``MAX_SPECKS`` speck pixels.

Colour, count and position are read from the shapes, so an image without one earns none of
them, and a circle drawn where a square is asked fails the shape check alone. ``score`` is 0
without the background, else the square of the share of the four words followed: 0, 1/16, ¼,
9/16, 1 (an image passes at 1). ``tests/unit/test_shapes_verifier.py`` holds the images that
gamed earlier versions (a painted half, bars, L-shapes, solid colours, specks, one fixed scene
for every prompt…), each held at ≤ 0.3.

``render`` draws an image that passes, from a random layout; the warm start trains on such
images with deliberately noisy captions (``tether.families.flow.warmstart``).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tether.errors import DataError
from tether.vocabulary import Example

SIZE = 16
COUNTS = {"one": 1, "two": 2}
COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0)}
SHAPES = ("square", "circle")
POSITIONS = ("left", "right", "top", "bottom")
WORDS = ("<pad>", *COUNTS, *COLOURS, "square", "squares", "circle", "circles", *POSITIONS)
"""The prompt vocabulary; a prompt is always four words."""
PROMPT_WORDS = 4
MIN_PIXELS = 8
MIN_BLOB = 12
"""Fewer lit pixels than this together are a speck, not a shape (a 2 × 2 dot is not a square)."""
SHAPE_AREA = (20, 60)
"""The pixels a shape covers (the drawn ones: 36 and 37)."""
MIN_ASPECT = 0.75
"""Short over long side of a shape's bounding box (drawn: 1; a 3 × 12 bar 0.25, 5 × 7 0.71)."""
MIN_SOLIDITY = 0.85
"""A shape's area over its convex hull's (drawn square 1, circle 0.90; an L, a cross 0.80, a ring
0.82)."""
MIN_SYMMETRY = 0.75
"""A shape's least overlap with its mirror images (drawn: 1; an L 0.47, a notched square 0.63)."""
SQUARE_FILL = 0.88
"""A shape's area over its bounding box's, from which it is a square (drawn 1); below, down to
``CIRCLE_FILL``, a circle (drawn 0.76; a disc π/4)."""
CIRCLE_FILL = 0.65
COLOUR_SHARE = 0.8
POSITION_SHARE = 0.9
DARK_SHARE = 0.6
"""The least share of the frame unlit (two drawn shapes leave 71%; a painted half 50%)."""
COLOUR_RADIUS = 110.0
"""How far (RGB distance) a lit pixel may be from a palette colour to have it."""
DARK_MEAN = 32.0
"""The most the unlit pixels' brightest channels may average: a clean, near-black background."""
MAX_SPECKS = 2
SQUARE_SIDE = 6
CIRCLE_DIAMETER = 7
CHECKS = ("colour", "count", "shape", "position", "background")
WORDS_CHECKED = CHECKS[:4]
"""The checks of the prompt's words; ``background`` gates them (``score``)."""


@dataclass(frozen=True)
class Scene:
    count: int
    colour: str
    shape: str
    position: str

    @property
    def prompt(self) -> str:
        noun = self.shape + ("s" if self.count > 1 else "")
        word = next(w for w, n in COUNTS.items() if n == self.count)
        return f"{word} {self.colour} {noun} {self.position}"

    @classmethod
    def parse(cls, prompt: str) -> Scene:
        words = prompt.split()
        if len(words) != PROMPT_WORDS or words[0] not in COUNTS or words[1] not in COLOURS:
            raise DataError(f"not a shapes prompt: {prompt!r} (expected e.g. 'two blue circles left')")
        shape = words[2].rstrip("s")
        if shape not in SHAPES or words[3] not in POSITIONS:
            raise DataError(f"not a shapes prompt: {prompt!r} (expected e.g. 'two blue circles left')")
        return cls(COUNTS[words[0]], words[1], shape, words[3])

    def example(self) -> Example:
        fields = {"count": self.count, "colour": self.colour, "shape": self.shape, "position": self.position}
        return Example(prompt=self.prompt, answer=self.prompt, fields=fields)


def all_scenes() -> list[Scene]:
    return [Scene(n, c, s, p) for n in COUNTS.values() for c in COLOURS for s in SHAPES for p in POSITIONS]


def random_scene(rng: random.Random) -> Scene:
    return Scene(rng.choice(list(COUNTS.values())), rng.choice(list(COLOURS)), rng.choice(SHAPES),
                 rng.choice(POSITIONS))


def encode(prompt: str) -> list[int]:
    """Word ids of a prompt (unknown words are an error: the grammar is closed)."""
    ids = []
    for word in prompt.split():
        if word not in WORDS:
            raise DataError(f"word {word!r} of prompt {prompt!r} is not in the shapes vocabulary "
                             f"{WORDS[1:]}")
        ids.append(WORDS.index(word))
    return ids


# -- drawing --------------------------------------------------------------------------------

def _half(position: str) -> tuple[int, int, int, int]:
    """(x0, y0, x1, y1) of the named half, end exclusive."""
    h = SIZE // 2
    return {"left": (0, 0, h, SIZE), "right": (h, 0, SIZE, SIZE), "top": (0, 0, SIZE, h),
            "bottom": (0, h, SIZE, SIZE)}[position]


def _stamp(shape: str) -> np.ndarray:
    if shape == "square":
        return np.ones((SQUARE_SIDE, SQUARE_SIDE), dtype=bool)
    d = CIRCLE_DIAMETER
    yy, xx = np.mgrid[:d, :d]
    c = (d - 1) / 2
    return (xx - c) ** 2 + (yy - c) ** 2 <= (d / 2) ** 2 - 0.25


def render(scene: Scene, rng: random.Random) -> np.ndarray:
    """A (16, 16, 3) uint8 image that ``score`` passes for ``scene``: blobs placed at random in the
    named half, apart from each other."""
    stamp = _stamp(scene.shape)
    side = stamp.shape[0]
    x0, y0, x1, y1 = _half(scene.position)
    for _ in range(1000):
        image = np.zeros((SIZE, SIZE, 3), dtype=np.uint8)
        taken = np.zeros((SIZE, SIZE), dtype=bool)
        ok = True
        for _ in range(scene.count):
            x, y = rng.randint(x0, x1 - side), rng.randint(y0, y1 - side)
            area = np.zeros_like(taken)
            area[max(y - 1, 0):y + side + 1, max(x - 1, 0):x + side + 1] = True  # a one-pixel gap
            if (area & taken).any():
                ok = False
                break
            taken[y:y + side, x:x + side] |= stamp
            image[y:y + side, x:x + side][stamp] = COLOURS[scene.colour]
        if ok:
            return image
    raise RuntimeError(f"could not lay out {scene.prompt!r}")  # the sizes above always fit


# -- reading --------------------------------------------------------------------------------

_PALETTE = np.array(list(COLOURS.values()), dtype=np.float32)


DARK, NO_COLOUR = -1, -2


def colour_map(image: np.ndarray) -> np.ndarray:
    """(16, 16) index of each lit pixel's palette colour; ``NO_COLOUR`` where a lit pixel is
    near none (white, grey), ``DARK`` where the pixel is not lit."""
    px = image.astype(np.float32)
    lit = px.max(axis=-1) >= 128
    distance = ((px[:, :, None, :] - _PALETTE[None, None]) ** 2).sum(-1)
    nearest = np.where(distance.min(-1) <= COLOUR_RADIUS ** 2, distance.argmin(-1), NO_COLOUR)
    return np.where(lit, nearest, DARK)


def blobs(mask: np.ndarray) -> list[list[tuple[int, int]]]:
    """4-connected components of a boolean mask, as lists of (y, x)."""
    seen = np.zeros_like(mask, dtype=bool)
    out = []
    for y, x in zip(*np.nonzero(mask), strict=True):
        if seen[y, x]:
            continue
        stack, blob = [(y, x)], []
        seen[y, x] = True
        while stack:
            cy, cx = stack.pop()
            blob.append((cy, cx))
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1] and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
        out.append(blob)
    return out


@dataclass(frozen=True)
class Form:
    """The measures a blob is judged by: its pixel count, bounding box and three ratios."""

    area: int
    height: int
    width: int
    fill: float
    """area / bounding-box area: a square 1, a disc π/4 (the drawn circle 37/49 = 0.76)."""
    solidity: float
    """area / the area of the convex hull of its pixels' corners: 1 for a square, 0.90 for the drawn
    circle; a notch or an arm (an L, a cross) lowers it."""
    symmetry: float
    """The least overlap (intersection over union) of the blob with its own mirror images, left to
    right and top to bottom, in its bounding box: 1 for a square or a circle, about 0.5 for an L."""

    @property
    def aspect(self) -> float:
        return min(self.height, self.width) / max(self.height, self.width)

    def kind(self) -> str | None:
        """``"square"``, ``"circle"`` or ``None`` (a blob that is neither: a bar, an L, a ring, a
        smear, a shape of the wrong size)."""
        if not (SHAPE_AREA[0] <= self.area <= SHAPE_AREA[1] and self.aspect >= MIN_ASPECT
                and self.solidity >= MIN_SOLIDITY and self.symmetry >= MIN_SYMMETRY):
            return None
        if self.fill >= SQUARE_FILL:
            return "square"
        return "circle" if self.fill >= CIRCLE_FILL else None


def form(blob: list[tuple[int, int]]) -> Form:
    ys, xs = (np.array(v) for v in zip(*blob, strict=True))
    y0, x0 = ys.min(), xs.min()
    h, w = int(ys.max() - y0 + 1), int(xs.max() - x0 + 1)
    box = np.zeros((h, w), dtype=bool)
    box[ys - y0, xs - x0] = True
    mirrors = (box[:, ::-1], box[::-1, :])
    symmetry = min(float((box & m).sum() / (box | m).sum()) for m in mirrors)
    corners = {(int(x) + dx, int(y) + dy) for y, x in blob for dx in (0, 1) for dy in (0, 1)}
    return Form(area=len(blob), height=h, width=w, fill=len(blob) / (h * w),
                solidity=len(blob) / _hull_area(sorted(corners)), symmetry=symmetry)


def _hull_area(points: list[tuple[int, int]]) -> float:
    """The area of the convex hull of sorted points (Andrew's monotone chain, then the shoelace)."""
    def half(pts):
        out: list[tuple[int, int]] = []
        for p in pts:
            while len(out) >= 2 and ((out[-1][0] - out[-2][0]) * (p[1] - out[-2][1])
                                     - (out[-1][1] - out[-2][1]) * (p[0] - out[-2][0])) <= 0:
                out.pop()
            out.append(p)
        return out[:-1]

    hull = half(points) + half(points[::-1])
    return 0.5 * abs(sum(a[0] * b[1] - b[0] * a[1] for a, b in zip(hull, hull[1:] + hull[:1], strict=True)))


def checks(scene: Scene, image: np.ndarray) -> dict[str, bool]:
    """Which of ``CHECKS`` ``image`` satisfies for ``scene``. The *shapes* are the blobs whose
    form is a square's or a circle's (``Form.kind``), of any colour: colour, count and position
    are read from them (so a circle drawn where a square is asked fails the shape check alone),
    and without any there is nothing to credit."""
    labels = colour_map(image)
    lit = labels != DARK
    n = int(lit.sum())
    every = blobs(lit)
    found = [b for b in every if len(b) >= MIN_BLOB]
    kinds = [form(b).kind() for b in found]
    shapes = [b for b, k in zip(found, kinds, strict=True) if k is not None]
    drawn = sum(len(b) for b in shapes)
    named = list(COLOURS).index(scene.colour)
    mine = sum(int(labels[y, x] == named) for b in shapes for y, x in b)
    colour = (bool(shapes) and mine >= COLOUR_SHARE * drawn
              and int((labels == named).sum()) >= COLOUR_SHARE * n)
    count = len(shapes) == len(found) == scene.count
    shape = bool(found) and all(k == scene.shape for k in kinds)
    x0, y0, x1, y1 = _half(scene.position)
    inside = sum(int(y0 <= y < y1 and x0 <= x < x1) for b in shapes for y, x in b)
    position = (bool(shapes) and inside >= POSITION_SHARE * drawn
                and int(lit[y0:y1, x0:x1].sum()) >= POSITION_SHARE * n)
    specks = sum(len(b) for b in every if len(b) < MIN_BLOB)
    dark = image.max(axis=-1)[~lit]
    background = (n >= MIN_PIXELS and specks <= MAX_SPECKS and dark.size >= DARK_SHARE * lit.size
                  and float(dark.mean()) <= DARK_MEAN)
    return {"colour": colour, "count": count, "shape": shape, "position": position, "background": background}


def score(scene: Scene, image: np.ndarray) -> float:
    """The reward in [0, 1]: 0 without a clean background, else the square of the share of the
    four words the image follows (colour, count, shape, position): 0, 1/16, ¼, 9/16, 1. The square
    keeps chance low: an image that ignores the prompt matches 1.5 of its 4 words on average, which
    earns (1.5/4)² ≈ 0.14 where a plain mean would give 0.375."""
    c = checks(scene, image)
    words = sum(c[k] for k in WORDS_CHECKED)
    return float(c["background"]) * (words / len(WORDS_CHECKED)) ** 2


def verify(prompt: str, image: np.ndarray, answer: str, fields: Mapping[str, Any]) -> float:
    """The ``shapes`` task's reward, in the image reward signature
    ``(prompt, image, answer, fields) -> float`` (``image``: (H, W, 3) uint8)."""
    return score(Scene.parse(answer or prompt), image)


def to_pixels(x) -> np.ndarray:
    """A model's (3, H, W) float image in [−1, 1] (a torch tensor) as (H, W, 3) uint8."""
    x = x.detach().float().clamp(-1, 1).cpu()
    return ((x.permute(1, 2, 0).numpy() + 1) * 127.5).round().astype(np.uint8)


def from_pixels(image: np.ndarray):
    """(H, W, 3) uint8 as the model's (3, H, W) float tensor in [−1, 1]."""
    import torch

    return torch.from_numpy(image.astype(np.float32) / 127.5 - 1).permute(2, 0, 1).contiguous()
