"""A diffusers flow-matching pipeline of the SD3 class as the flow family's model (``model.path``).

``DiffusersFlow`` wraps a local pipeline directory (``model_index.json``: a transformer, a VAE,
text encoders and tokenizers, a ``FlowMatchEulerDiscreteScheduler``). Only the transformer is a
registered submodule: it is what the learner trains, the weight channel publishes, FSDP shards
and a checkpoint saves. The VAE and the text encoders are frozen and held beside it; they move
with ``.to()`` but are no parameters of the policy. The learner loads the transformer alone.

- **Conditioning**: the pipeline's own ``encode_prompt`` (CLIP hidden states and pooled
  embeddings; T5 when the pipeline has one), computed once per prompt by the engine and carried
  with the batch (``tether.families.flow.conditioning``).
- **Velocity**: SD3's transformer predicts noise − data at timestep 1000·σ, the convention of
  Tether's SDE (``tether.families.flow.sde``: x_σ = (1 − σ)·x₀ + σ·x₁), so its output is the
  velocity as it is.
- **Times**: the scheduler's own shifted sigmas (``set_timesteps``), the numbers the pipeline and
  Flow-GRPO's reference sample with; ``flow.shift`` replaces the scheduler's shift.
- **Decoding**: latents / scaling_factor + shift_factor through the VAE, for the reward only.

A checkpoint of such a model is ``config.json`` (``tether_family: flow``, ``backbone:
diffusers``, the base pipeline's path and fingerprint) and ``transformer/``; loading it reads
the frozen parts from the base, and refuses a base that changed since.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tether.errors import ConfigError

FROZEN = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")
"""The pipeline components that are never trained."""


def is_pipeline(folder: str | Path) -> bool:
    """A diffusers pipeline directory, or a checkpoint of one's transformer."""
    folder = Path(folder)
    if (folder / "model_index.json").is_file():
        return True
    config = folder / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("backbone") == "diffusers"


def _diffusers():
    try:
        import diffusers
    except ImportError as exc:
        raise ConfigError("model.path is a diffusers pipeline, which needs the `diffusers` package: "
                          "pip install -e '.[diffusers]'") from exc
    return diffusers


def fingerprint(base: Path) -> str:
    """What identifies a base pipeline without reading its weights (its trained transformer aside)."""
    from tether.modeling import fingerprint as of_folder

    return of_folder(base, skip=("transformer",))


def resolve(folder: str | Path) -> tuple[Path, Path]:
    """(the base pipeline, the folder holding the transformer) of a pipeline or a checkpoint."""
    folder = Path(folder)
    if (folder / "model_index.json").is_file():
        return folder, folder / "transformer"
    from tether.modeling import check_base

    record = json.loads((folder / "config.json").read_text())
    base = Path(record["base"])
    check_base(folder, base, record["fingerprint"], what="a transformer trained from the diffusers pipeline",
               skip=("transformer",))
    return base, folder / "transformer"


class DiffusersFlow(nn.Module):
    """v(x_t, t, cond) of a diffusers SD3-class transformer, with the pipeline's text encoders,
    VAE and scheduler beside it (absent when loaded for the learner)."""

    def __init__(self, transformer: nn.Module, base: Path, *, pipe: Any = None, max_prompt_tokens: int = 77,
                 resolution: int = 0) -> None:
        super().__init__()
        self.transformer = transformer
        self.base = base
        self.pipe = pipe  # not a Module: nothing of it is a parameter of the policy
        self.max_prompt_tokens = max_prompt_tokens
        self.resolution = resolution
        self.scheduler_config = json.loads((base / "scheduler" / "scheduler_config.json").read_text())
        self.vae_scale = 2 ** (len(json.loads((base / "vae" / "config.json").read_text())
                                   ["block_out_channels"]) - 1)
        self._check_transformer()
        if resolution % self.vae_scale:
            raise ConfigError(f"flow.resolution={resolution} is not a multiple of {self.vae_scale}, the "
                              f"factor by which {base}'s VAE shrinks an image")

    def _check_transformer(self) -> None:
        wanted = {"hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"}
        have = set(inspect.signature(self.transformer.forward).parameters)
        if not wanted <= have:
            raise ConfigError(f"{self.base}: the transformer {type(self.transformer).__name__} does not take "
                              f"{sorted(wanted - have)}; the flow family serves SD3-class pipelines "
                              "(StableDiffusion3Pipeline's SD3Transformer2DModel)")

    def _frozen(self) -> list[nn.Module]:
        if self.pipe is None:
            return []
        return [m for m in (getattr(self.pipe, name, None) for name in FROZEN) if m is not None]

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        for module in self._frozen():
            module._apply(fn, recurse)
        return self

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    def _need_pipe(self, what: str) -> Any:
        if self.pipe is None:
            raise RuntimeError(f"{what} needs the whole pipeline; this model was loaded with its transformer "
                               "only (attach_pipeline loads the rest)")
        return self.pipe

    def attach_pipeline(self) -> DiffusersFlow:
        """Load the frozen parts (text encoders, VAE) beside a transformer loaded alone, on its
        device: held-out evaluation in the learner needs them."""
        if self.pipe is None:
            self.pipe = _pipeline(self.base, self.transformer)
            device = self.device
            for module in self._frozen():
                module.to(device)
        return self

    # -- what the flow family asks of a model -------------------------------------------------

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        config = self.transformer.config
        size = (self.resolution // self.vae_scale) if self.resolution else config.sample_size
        return (config.in_channels, size, size)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        pipe = self._need_pipe("encoding prompts")
        embeds, _, pooled, _ = pipe.encode_prompt(prompt=list(prompts), prompt_2=None, prompt_3=None,
                                                  device=self.device, do_classifier_free_guidance=False,
                                                  max_sequence_length=self.max_prompt_tokens)
        return {"prompt_embeds": embeds.float(), "pooled_projections": pooled.float()}

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, chunk: int = 32) -> list[np.ndarray]:
        from tether.families.flow import scenes

        vae = self._need_pipe("decoding latents").vae
        out: list[np.ndarray] = []
        for i in range(0, len(latents), chunk):
            z = latents[i:i + chunk].to(self.device, vae.dtype) / vae.config.scaling_factor
            z = z + (vae.config.shift_factor or 0.0)
            out.extend(scenes.to_pixels(x) for x in vae.decode(z, return_dict=False)[0])
        return out

    def times(self, steps: int, shift: float) -> torch.Tensor:
        """The scheduler's ``steps`` + 1 sigmas (its own shift, or ``shift`` when not 0)."""
        diffusers = _diffusers()
        config = dict(self.scheduler_config)
        cls = getattr(diffusers, config.pop("_class_name", "FlowMatchEulerDiscreteScheduler"))
        config.pop("_diffusers_version", None)
        if shift:
            config["shift"] = shift
        scheduler = cls.from_config(config)
        if scheduler.config.get("use_dynamic_shifting"):
            raise ConfigError(f"{self.base}: the scheduler shifts by image size (use_dynamic_shifting), as "
                              "FLUX's does; the flow family serves SD3-class schedulers")
        scheduler.set_timesteps(steps)
        return scheduler.sigmas.detach().float().cpu()

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        dtype = next(self.transformer.parameters()).dtype
        return self.transformer(hidden_states=x.to(dtype), timestep=(1000 * t).to(dtype),
                                encoder_hidden_states=cond["prompt_embeds"].to(dtype),
                                pooled_projections=cond["pooled_projections"].to(dtype), return_dict=False)[0]

    # -- a model directory ----------------------------------------------------------------------

    def save_pretrained(self, folder: str | Path, **_: object) -> None:
        """The transformer, and the base pipeline it needs, by path and fingerprint."""
        self.write_folder(folder, {n: p.detach() for n, p in self.named_parameters()})

    def write_folder(self, folder: str | Path, weights: dict[str, torch.Tensor] | None) -> None:
        """A checkpoint's model folder with ``weights`` (this module's names, e.g. gathered from
        ranks); None: the configs alone."""
        from safetensors.torch import save_file

        folder = Path(folder)
        (folder / "transformer").mkdir(parents=True, exist_ok=True)
        self.transformer.save_config(folder / "transformer")
        if weights is not None:
            own = {n.removeprefix("transformer."): t.contiguous() for n, t in weights.items()}
            save_file(own, str(folder / "transformer" / "diffusion_pytorch_model.safetensors"),
                      metadata={"format": "pt"})
        record = {"tether_family": "flow", "backbone": "diffusers", "base": str(self.base.resolve()),
                  "fingerprint": fingerprint(self.base)}
        (folder / "config.json").write_text(json.dumps(record, indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, folder: str | Path, *, whole: bool = True, max_prompt_tokens: int = 77,
                        resolution: int = 0) -> DiffusersFlow:
        """The pipeline at ``folder`` (or the checkpoint's base with its transformer); ``whole``
        False loads the transformer alone (the learner's)."""
        diffusers = _diffusers()
        base, transformer_dir = resolve(folder)
        index = json.loads((base / "model_index.json").read_text())
        _, name = index.get("transformer") or (None, None)
        if name is None:
            raise ConfigError(f"{base}: the pipeline ({index.get('_class_name')}) has no transformer; the "
                              "flow family trains a flow-matching transformer (SD3-class pipelines)")
        transformer = getattr(diffusers, name).from_pretrained(transformer_dir, low_cpu_mem_usage=False)
        pipe = _pipeline(base, transformer) if whole else None
        return cls(transformer, base, pipe=pipe, max_prompt_tokens=max_prompt_tokens, resolution=resolution)


def _pipeline(base: Path, transformer: nn.Module) -> Any:
    """The pipeline at ``base`` around ``transformer``, its other parts frozen."""
    diffusers = _diffusers()
    index = json.loads((base / "model_index.json").read_text())
    absent = {k: None for k, v in index.items() if isinstance(v, list) and v[0] is None}
    pipeline_cls = getattr(diffusers, index["_class_name"])
    if not hasattr(pipeline_cls, "encode_prompt"):
        raise ConfigError(f"{base}: {index['_class_name']} has no encode_prompt; the flow family serves "
                          "SD3-class pipelines")
    pipe = pipeline_cls.from_pretrained(base, transformer=transformer, low_cpu_mem_usage=False, **absent)
    pipe.set_progress_bar_config(disable=True)
    for module in (getattr(pipe, n, None) for n in FROZEN):
        if module is not None:
            module.requires_grad_(False).eval()
    return pipe
