"""An image reward for flow tests: how red the image is, in [0, 1]. It varies within every
group (no two trajectories give the same image), so every update has a signal."""


def reward(prompt, image, answer, fields):
    return float(image[:, :, 0].mean()) / 255.0
