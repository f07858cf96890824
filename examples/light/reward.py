"""A pixel reward for prompts that say where the light comes from ("a kite lit from the left"):
how much brighter the named half of the image is than the opposite half.

    0.5 + (mean brightness of the named half − of the opposite half) / 510

in [0, 1]: 0.5 for an evenly lit image, 1 for a white named half beside a black one. It is
batched (``@tether.batched``): one call scores a whole rollout batch, as a reward model would.
"""

import numpy as np

import tether

SIDES = ("left", "right", "top", "bottom")


def named_side(prompt: str) -> str:
    for word in prompt.replace(",", " ").split():
        if word in SIDES:
            return word
    raise ValueError(f"prompt {prompt!r} names none of the sides {SIDES}")


def halves(brightness: np.ndarray, side: str) -> tuple[np.ndarray, np.ndarray]:
    """(the named half, the opposite half) of an (H, W) image."""
    h, w = brightness.shape
    if side in ("left", "right"):
        a, b = brightness[:, : w // 2], brightness[:, w - w // 2:]
    else:
        a, b = brightness[: h // 2], brightness[h - h // 2:]
    return (a, b) if side in ("left", "top") else (b, a)


@tether.batched
def light_side(prompts, images, answers, fields):
    out = []
    for prompt, image in zip(prompts, images, strict=True):
        lit, dark = halves(image.astype(np.float64).mean(-1), named_side(prompt))
        out.append(float(0.5 + (lit.mean() - dark.mean()) / 510))
    return out
