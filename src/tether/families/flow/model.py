"""A tiny conditional flow-matching model: a DiT over small RGB images, conditioned on a
four-word prompt.

The image is cut into p × p patches, each a token; the prompt's words are four more tokens in
the same sequence (joint attention over words and patches, as SD3's MM-DiT does in one stream);
the time enters every block through adaptive LayerNorm (scale, shift and gate from an embedding
of t, DiT's adaLN-Zero, shared by all blocks as PixArt-α does to keep it small). The output is
the velocity v(x_t, t, prompt) ≈ E[x₁ − x₀ | x_t] of rectified flow (noise x₁, data x₀).

A model directory holds ``config.json`` (``"tether_family": "flow"``) and
``model.safetensors``; ``FlowModel.from_pretrained`` / ``save_pretrained`` read and write it, so
checkpoints, publication and ``tether eval`` treat it like a language model's directory.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from tether.errors import ConfigError

FAMILY_KEY = "tether_family"


@dataclass(frozen=True)
class FlowModelConfig:
    image_size: int = 16
    channels: int = 3
    patch: int = 2
    width: int = 64
    depth: int = 4
    heads: int = 4
    vocab: tuple[str, ...] = ()
    prompt_words: int = 4

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch) ** 2

    def check(self) -> None:
        if self.image_size % self.patch or self.width % self.heads or not self.vocab:
            raise ConfigError(f"flow model config is inconsistent: {self}")


def _time_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features of t ∈ [0, 1] (scaled by 1000 as diffusion models do)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    angles = 1000.0 * t.float()[:, None] * freqs[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.mod = nn.Parameter(torch.zeros(6, width))
        """This block's own offsets of the shared time modulation (PixArt-α's per-block table)."""

    def forward(self, h: torch.Tensor, mod: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = (mod + self.mod[None]).unbind(1)  # each (B, W)
        b, n, w = h.shape
        x = F.layer_norm(h, (w,)) * (1 + scale1[:, None]) + shift1[:, None]
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, w)
        h = h + gate1[:, None] * self.proj(a)
        x = F.layer_norm(h, (w,)) * (1 + scale2[:, None]) + shift2[:, None]
        return h + gate2[:, None] * self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class FlowModel(nn.Module):
    """v(x_t, t, words): x (B, C, H, W), t (B,) in [0, 1], words (B, prompt_words) ids."""

    def __init__(self, config: FlowModelConfig) -> None:
        super().__init__()
        config.check()
        self.config = config
        c, p, w = config.channels, config.patch, config.width
        self.patch_in = nn.Linear(c * p * p, w)
        self.pos = nn.Parameter(torch.randn(config.patches, w) * 0.02)
        self.words = nn.Embedding(len(config.vocab), w)
        self.word_pos = nn.Parameter(torch.randn(config.prompt_words, w) * 0.02)
        self.time = nn.Sequential(nn.Linear(w, w), nn.SiLU(), nn.Linear(w, 6 * w))
        self.blocks = nn.ModuleList(_Block(w, config.heads) for _ in range(config.depth))
        self.final_mod = nn.Linear(w, 2 * w)
        self.patch_out = nn.Linear(w, c * p * p)
        nn.init.zeros_(self.patch_out.weight)  # adaLN-Zero: start as the zero velocity
        nn.init.zeros_(self.patch_out.bias)
        nn.init.zeros_(self.time[2].weight)
        nn.init.zeros_(self.time[2].bias)

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor] | torch.Tensor
                ) -> torch.Tensor:
        """``cond``: the prompts' conditioning (``encode_prompts``), or their word ids."""
        words = cond["words"] if isinstance(cond, Mapping) else cond
        cfg = self.config
        b, c, size, p = x.shape[0], cfg.channels, cfg.image_size, cfg.patch
        g = size // p
        patches = x.view(b, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(b, g * g, c * p * p)
        temb = _time_features(t, cfg.width)
        mod = self.time(temb).view(b, 6, cfg.width)
        h = torch.cat([self.words(words) + self.word_pos[None], self.patch_in(patches) + self.pos[None]],
                      dim=1)
        for block in self.blocks:
            h = block(h, mod)
        shift, scale = self.final_mod(F.silu(temb)).chunk(2, dim=-1)
        out = F.layer_norm(h[:, cfg.prompt_words:], (cfg.width,)) * (1 + scale[:, None]) + shift[:, None]
        out = self.patch_out(out)  # (B, g·g, c·p·p)
        return out.view(b, g, g, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, size, size)

    # -- what the flow family asks of a model (``tether.families.flow.conditioning``) ------------

    def layers(self) -> list[nn.Module]:
        """The transformer's blocks (FSDP2 units; recomputed with train.activation_checkpointing)."""
        return list(self.blocks)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of what the SDE samples: here the image itself."""
        return (self.config.channels, self.config.image_size, self.config.image_size)

    def encode_prompts(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Each prompt's word ids (the empty prompt, the unconditional one, is all padding)."""
        from tether.families.flow import scenes

        ids = [scenes.encode(p) if p else [0] * self.config.prompt_words for p in prompts]
        return {"words": torch.tensor(ids, dtype=torch.long)}

    def decode(self, latents: torch.Tensor) -> list[np.ndarray]:
        """(H, W, 3) uint8 pixels of each sample: the latents are the image."""
        from tether.families.flow import scenes

        return [scenes.to_pixels(x) for x in latents]

    def times(self, steps: int, shift: float) -> torch.Tensor:
        """The ``steps`` + 1 times of a trajectory: uniform from 1 to 0, bent by ``shift`` (0: this
        model's own, 1)."""
        from tether.families.flow.sde import timesteps

        return timesteps(steps, shift=shift or 1.0)

    def attach_pipeline(self) -> FlowModel:
        """Whole already (a pipeline's transformer loaded alone loads its other parts here)."""
        return self

    # -- a model directory ----------------------------------------------------------------------

    def save_pretrained(self, folder: str | Path, **_: object) -> None:
        self.write_folder(folder, {n: p.detach() for n, p in self.named_parameters()})

    def write_folder(self, folder: str | Path, weights: dict[str, torch.Tensor] | None) -> None:
        """This model's directory with ``weights`` (name → tensor, e.g. gathered from ranks); None:
        its config alone."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = {FAMILY_KEY: "flow", **asdict(self.config)}
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if weights is not None:
            from safetensors.torch import save_file

            save_file({n: t.contiguous() for n, t in weights.items()}, str(folder / "model.safetensors"),
                      metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> FlowModel:
        from safetensors.torch import load_file

        folder = Path(folder)
        config = read_config(folder)
        model = cls(config)
        state = load_file(str(folder / "model.safetensors"))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ConfigError(f"{folder}: weights do not match the flow model's config: missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]}")
        return model


def is_flow_model(folder: str | Path) -> bool:
    path = Path(folder) / "config.json"
    return path.is_file() and json.loads(path.read_text()).get(FAMILY_KEY) == "flow"


def read_config(folder: str | Path) -> FlowModelConfig:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{folder} is not a flow model directory: it holds neither model_index.json (a "
                          "diffusers pipeline, as save_pretrained writes it) nor config.json (a model built "
                          "by Tether, or a checkpoint of either); point model.path at one, or set "
                          "model.create_if_missing=true to build one there")
    data = json.loads(path.read_text())
    if data.pop(FAMILY_KEY, None) != "flow":
        raise ConfigError(f"{folder} holds a language model, not a flow model; set model.family=text or "
                          "point model.path at a flow model directory")
    data["vocab"] = tuple(data["vocab"])
    return FlowModelConfig(**data)


def load_flow_model(folder: str | Path, cfg=None, *, whole: bool = True):
    """The flow model at ``folder``: the built-in DiT, or a diffusers pipeline (or a checkpoint of
    either). ``whole`` False: only what the learner trains (a pipeline's transformer). ``cfg``
    sets a pipeline's prompt length (``data.max_prompt_tokens``) and size (``flow.resolution``)."""
    from tether.families.flow.pipeline import DiffusersFlow, is_pipeline

    if is_pipeline(folder):
        extra = {} if cfg is None else {"max_prompt_tokens": cfg.data.max_prompt_tokens,
                                        "resolution": cfg.flow.resolution}
        return DiffusersFlow.from_pretrained(folder, whole=whole, **extra)
    return FlowModel.from_pretrained(folder)
