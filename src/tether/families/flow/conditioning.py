"""What a flow model is conditioned on, and classifier-free guidance.

A prompt's conditioning is a dict of tensors whose first dimension is the row: the built-in
model's word ids (``words``), a diffusers pipeline's text embeddings (``prompt_embeds``,
``pooled_projections``). It is computed once per prompt by the engine (``FlowModel.encode_prompts``,
``DiffusersFlow.encode_prompts``) and carried with the rollout batch, so the learner never runs a
text encoder and both sides condition on the same numbers.

Classifier-free guidance mixes the conditional velocity with the unconditional one (the
negative prompt's): v = v_u + w·(v_c − v_u), ``w`` the guidance scale. Flow-GRPO's reference
applies it in sampling and in the training forward alike, both branches through the trained
transformer, so the policy whose ratio is taken is the guided one (its ``train.cfg``); Tether does
the same, in one forward over the two halves. Which branches carry gradients is
``flow.cfg_grad``: both (``full``, the default: the gradient of the guided velocity the sampler
used, as the reference's newer upstream), or the conditional one alone (``conditional``:
v = sg[v_u] + w·(v_c − sg[v_u]), the reference at ac4c86e).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

Conditioning = dict[str, torch.Tensor]


def rows(cond: Mapping[str, torch.Tensor], index: torch.Tensor) -> Conditioning:
    """The rows ``index`` of every tensor."""
    return {k: v[index.to(v.device)] for k, v in cond.items()}


def to(cond: Mapping[str, torch.Tensor], device: torch.device) -> Conditioning:
    return {k: v.to(device) for k, v in cond.items()}


def as_numpy(cond: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in cond.items()}


def as_tensors(arrays: Mapping[str, np.ndarray]) -> Conditioning:
    """Tensors of a batch's arrays (copies: Ray's arrays are read-only)."""
    return {k: torch.tensor(v) for k, v in arrays.items()}


def num_rows(cond: Mapping[str, torch.Tensor | np.ndarray]) -> int:
    sizes = {len(v) for v in cond.values()}
    if len(sizes) != 1:
        shown = {k: len(v) for k, v in cond.items()}
        raise ValueError(f"conditioning tensors disagree on their rows: {shown}")
    return sizes.pop()


def velocity(model, x: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
             negative: Mapping[str, torch.Tensor] | None = None, guidance: float = 1.0, *,
             detach_uncond: bool = False) -> torch.Tensor:
    """v(x, t | cond), guided by ``negative`` (one row, the unconditional prompt's) at scale
    ``guidance`` when that is not 1; float32 whatever the model computes in. ``detach_uncond``:
    no gradient through the unconditional branch (``flow.cfg_grad: conditional``); the value is
    the same."""
    if negative is None or guidance == 1.0:
        return model(x, t, cond).float()
    n = x.shape[0]
    both = {k: torch.cat([negative[k].to(v.device).expand(n, *v.shape[1:]), v]) for k, v in cond.items()}
    uncond, text = model(torch.cat([x, x]), torch.cat([t, t]), both).float().chunk(2)
    if detach_uncond:
        uncond = uncond.detach()
    return uncond + guidance * (text - uncond)
