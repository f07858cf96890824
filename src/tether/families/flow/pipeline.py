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

import contextlib
import inspect
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tether.errors import ConfigError

FROZEN = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")
"""The pipeline components that are never trained."""

SUPPORTED = ("StableDiffusion3Pipeline",)
"""The pipeline classes (``model_index.json``'s ``_class_name``) the flow family serves."""

PARTS = {"transformer": "config.json", "vae": "config.json", "scheduler": "scheduler_config.json",
         "text_encoder": "config.json", "tokenizer": "tokenizer_config.json",
         "text_encoder_2": "config.json", "tokenizer_2": "tokenizer_config.json"}
"""The parts such a pipeline needs, each with the file that configures it (T5's, ``text_encoder_3``
and ``tokenizer_3``, are optional: both or neither)."""

T5 = {"text_encoder_3": "config.json", "tokenizer_3": "tokenizer_config.json"}

WEIGHTS = ("*.safetensors", "*.bin")

VAE_BLOCKS = [64]
"""AutoencoderKL's ``block_out_channels`` when its config does not say (one level: no shrinking)."""


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
    from transformers.utils import logging as hf_logging

    # a bar per part per process at every load (the text encoders' are transformers'), as
    # tether.modeling does for a language model: Tether reports its own progress
    diffusers.utils.logging.disable_progress_bar()
    hf_logging.disable_progress_bar()
    return diffusers


@contextlib.contextmanager
def importing_quietly() -> Iterator[None]:
    """Import a pipeline's classes without transformers' note, once a process, that their image
    processors fall back from torchvision to PIL where torchvision is not installed: the flow
    family never calls an image processor (no image goes to a text encoder)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


@contextlib.contextmanager
def saving_quietly() -> Iterator[None]:
    """Save a pipeline without diffusers' warning for each part it leaves out on purpose (SD3's
    third text encoder and tokenizer: ``self.text_encoder_3=None ... cannot be saved``)."""
    from diffusers.utils import logging as diffusers_logging

    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        yield
    finally:
        diffusers_logging.set_verbosity(level)


def check_pipeline(base: str | Path) -> dict[str, Any]:
    """``base``'s ``model_index.json``, read before diffusers loads anything; refused, naming
    every missing or unreadable part, unless it is a supported class with each part it needs present
    with its config (and, for a model, its weights) and the few settings Tether reads sane."""
    base = Path(base)
    index = _read_json(base / "model_index.json", base)
    name = index.get("_class_name")
    if name not in SUPPORTED:
        raise ConfigError(f"{base}/model_index.json names the pipeline class {name!r}; the flow family "
                          f"trains {' and '.join(SUPPORTED)} folders (SD3, SD3.5), not UNet pipelines "
                          "(Stable Diffusion 1-2, XL) or FLUX: point model.path at one (docs/flow.md)")
    wanted = dict(PARTS)
    present = [part for part in T5 if _named(index.get(part))]
    if present:  # T5 is optional, but its encoder needs its tokenizer
        wanted.update(T5)
    problems: list[str] = []
    configs: dict[str, dict] = {}
    for part, config in wanted.items():
        if not _named(index.get(part)):
            problems.append(f"model_index.json names no {part}")
        elif not (base / part).is_dir():
            problems.append(f"{part}/ is missing")
        elif not (base / part / config).is_file():
            problems.append(f"{part}/{config} is missing")
        else:
            try:
                configs[part] = _read_json(base / part / config, base)
            except ConfigError as exc:
                problems.append(str(exc).removeprefix(f"{base}: "))
                continue
            if not part.startswith(("tokenizer", "scheduler")) and \
                    not any(f for pattern in WEIGHTS for f in (base / part).glob(pattern)):
                problems.append(f"{part}/ holds no weights (*.safetensors or *.bin)")
    problems += _bad_settings(index, configs)
    if problems:
        raise ConfigError(f"{base} is not a whole {name} folder: {'; '.join(problems)}. It needs "
                          f"{', '.join(wanted)}, each a folder with its config, as diffusers' "
                          "save_pretrained writes them: mend what is named, or copy the whole pipeline "
                          "folder again")
    return index


def vae_factor(vae_config: dict[str, Any]) -> int:
    """How many times the VAE of ``vae_config`` (its config.json) shrinks an image on a side."""
    return 2 ** (len(vae_config.get("block_out_channels", VAE_BLOCKS)) - 1)


def check_resolution(resolution: int, factor: int, base: str | Path) -> None:
    """Refuse a ``flow.resolution`` the VAE of ``base`` (shrinking by ``factor``) cannot make."""
    if resolution % factor:
        raise ConfigError(f"flow.resolution={resolution} is not a multiple of {factor}, the factor by which "
                          f"{base}'s VAE shrinks an image: use a multiple of {factor}, or 0 for the "
                          "transformer's own size")


def base_of(folder: str | Path) -> Path:
    """The pipeline folder of a pipeline, or of a checkpoint of one's transformer (its record's)."""
    folder = Path(folder)
    if (folder / "model_index.json").is_file():
        return folder
    return Path(json.loads((folder / "config.json").read_text())["base"])


def own_settings(folder: str | Path) -> tuple[float, int] | None:
    """(its scheduler's shift, its VAE's factor) of a pipeline folder or of a checkpoint of one's
    transformer (its base's), read from the configs ``check_pipeline`` passes: what the settings
    checked at load (``flow.noise_level`` at ``flow.shift: 0``, ``flow.resolution``) depend on.
    None for a checkpoint whose base is gone (loading it says so)."""
    base = base_of(folder)
    if not (base / "model_index.json").is_file():
        return None
    scheduler = _read_json(base / "scheduler" / "scheduler_config.json", base)
    return float(scheduler.get("shift", 1.0)), vae_factor(_read_json(base / "vae" / "config.json", base))


def _named(entry: Any) -> bool:
    """A model_index.json entry that names a part (``[library, class]``, not ``[null, null]``)."""
    return isinstance(entry, list) and len(entry) == 2 and bool(entry[1])


def _read_json(path: Path, base: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{base}: {path.relative_to(base)} cannot be read as JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{base}: {path.relative_to(base)} is not a JSON object")
    return data


def _bad_settings(index: dict[str, Any], configs: dict[str, dict]) -> list[str]:
    """What is wrong with the few settings Tether itself reads from the parts' configs."""
    problems = []
    vae, transformer = configs.get("vae"), configs.get("transformer")
    if vae is not None:
        blocks = vae.get("block_out_channels", VAE_BLOCKS)
        if not (isinstance(blocks, list) and blocks and all(isinstance(b, int) and b > 0 for b in blocks)):
            problems.append(f"vae/config.json's block_out_channels is {blocks!r}, not a list of channels")
    if transformer is not None:
        for key in ("in_channels", "sample_size"):
            value = transformer.get(key, 1)
            if not (isinstance(value, int) and value > 0):
                problems.append(f"transformer/config.json's {key} is {value!r}, not a positive integer")
    if vae is not None and transformer is not None and \
            "latent_channels" in vae and "in_channels" in transformer and \
            vae["latent_channels"] != transformer["in_channels"]:
        problems.append(f"the VAE's latents have {vae['latent_channels']} channels (vae/config.json's "
                        f"latent_channels) and the transformer takes {transformer['in_channels']} (its "
                        "in_channels)")
    if "scheduler" in configs:
        name = index["scheduler"][1]
        if name != "FlowMatchEulerDiscreteScheduler":
            problems.append(f"the scheduler is {name}, not the FlowMatchEulerDiscreteScheduler of a "
                            "flow-matching pipeline")
        elif configs["scheduler"].get("use_dynamic_shifting"):
            problems.append("the scheduler shifts by image size (use_dynamic_shifting), as FLUX's does")
    return problems


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
    base = base_of(folder)
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
        self.vae_scale = vae_factor(json.loads((base / "vae" / "config.json").read_text()))
        self._check_transformer()
        check_resolution(resolution, self.vae_scale, base)

    def _check_transformer(self) -> None:
        wanted = {"hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"}
        have = set(inspect.signature(self.transformer.forward).parameters)
        if not wanted <= have:
            raise ConfigError(f"{self.base}: the transformer {type(self.transformer).__name__} does not take "
                              f"{sorted(wanted - have)}; the flow family serves SD3-class pipelines "
                              "(StableDiffusion3Pipeline's SD3Transformer2DModel)")

    def layers(self) -> list[nn.Module]:
        """The transformer's blocks (FSDP2 units; recomputed with train.activation_checkpointing)."""
        return list(self.transformer.transformer_blocks)

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
            for name, buffer in _persistent_buffers(self.transformer).items():  # SD3's position table:
                own.setdefault(name, buffer.detach().cpu().contiguous())  # never trained, the same on
            # every rank, but without it diffusers loads this folder saying it "newly initialized" it
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
        base, transformer_dir = resolve(folder)
        _, name = check_pipeline(base)["transformer"]
        diffusers = _diffusers()
        with _loading(base, f"its transformer ({transformer_dir})"):
            transformer = getattr(diffusers, name).from_pretrained(transformer_dir, low_cpu_mem_usage=False)
        pipe = _pipeline(base, transformer) if whole else None
        return cls(transformer, base, pipe=pipe, max_prompt_tokens=max_prompt_tokens, resolution=resolution)


@contextlib.contextmanager
def _loading(base: Path, what: str):
    """Diffusers' own errors in loading parts whose files do not fit together (a config whose sizes
    are not its weights'), as one ConfigError naming the folder and the first lines of the cause."""
    try:
        yield
    except ConfigError:
        raise
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
        cause = " ".join(lines[:2]) + (" …" if len(lines) > 2 else "")
        raise ConfigError(f"{base}: diffusers cannot load {what} ({type(exc).__name__}: {cause}); its "
                          "configs do not fit its weights (edited, or copied from another pipeline?): copy "
                          "the whole pipeline folder again") from exc


def _persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``module``'s state dict holds (those a model folder must hold), by name."""
    return {f"{prefix}.{name}" if prefix else name: buffer
            for prefix, sub in module.named_modules() for name, buffer in sub.named_buffers(recurse=False)
            if name not in sub._non_persistent_buffers_set}


def _pipeline(base: Path, transformer: nn.Module) -> Any:
    """The pipeline at ``base`` around ``transformer``, its other parts frozen."""
    diffusers = _diffusers()
    index = json.loads((base / "model_index.json").read_text())
    absent = {k: None for k, v in index.items() if isinstance(v, list) and v[0] is None}
    with importing_quietly():
        pipeline_cls = getattr(diffusers, index["_class_name"])
    if not hasattr(pipeline_cls, "encode_prompt"):
        raise ConfigError(f"{base}: {index['_class_name']} has no encode_prompt; the flow family serves "
                          "SD3-class pipelines")
    with _loading(base, "its text encoders, tokenizers, VAE or scheduler"):
        pipe = pipeline_cls.from_pretrained(base, transformer=transformer, low_cpu_mem_usage=False, **absent)
    pipe.set_progress_bar_config(disable=True)
    for module in (getattr(pipe, n, None) for n in FROZEN):
        if module is not None:
            module.requires_grad_(False).eval()
    return pipe
