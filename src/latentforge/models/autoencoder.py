"""The VAE (diffusers ``AutoencoderKL``): load a pretrained one, fingerprint it, or build a fresh one.

The latent scale factor is read from the VAE's config (``scaling_factor``, ``shift_factor``) and
carried into the dataset meta by :func:`vae_meta`; nothing in latentforge hard-codes it.
Weights are only read from safetensors files (``use_safetensors=True``): nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL

from latentforge.errors import ConfigError, UserError
from latentforge.models.hub import hub_source, offline_hint, quiet_hub_calls

__all__ = [
    "AutoencoderConfig",
    "build_vae",
    "load_vae",
    "first_line",
    "load_error",
    "locate_pretrained",
    "absolute_if_local",
    "state_fingerprint",
    "vae_fingerprint",
    "vae_meta",
    "vae_downsample_factor",
]


@dataclass
class AutoencoderConfig:
    """A fresh (untrained) ``AutoencoderKL``; the defaults are the Stable Diffusion VAE's shape."""

    block_out_channels: tuple[int, ...] = field(
        default=(128, 256, 512, 512),
        metadata={"help": "channels of each encoder/decoder level; the image is downsampled 2x "
                          "between levels, so the latent is 2**(levels-1) times smaller per side"},
    )
    layers_per_block: int = field(default=2, metadata={"help": "resnet layers per level"})
    latent_channels: int = field(default=4, metadata={"help": "channels of the latent"})
    norm_num_groups: int = field(
        default=32, metadata={"help": "GroupNorm groups; must divide every entry of block_out_channels"}
    )
    sample_size: int = field(default=256, metadata={"help": "training image size in pixels (per side)"})
    mid_block_attention: bool = field(default=True, metadata={
        "help": "self-attention in the encoder's and decoder's middle block (diffusers' "
                "mid_block_add_attention; the SD VAE has it)"})
    scaling_factor: float = field(
        default=1.0,
        metadata={"help": "latent scale (1 / std of the latents); measure it after training and "
                          "store it in the VAE config, which the encode step copies into the dataset meta"},
    )

    def validate(self) -> None:
        if not self.block_out_channels or any(c <= 0 for c in self.block_out_channels):
            raise ConfigError("block_out_channels: needs at least one positive channel count")
        if self.norm_num_groups <= 0 or any(c % self.norm_num_groups for c in self.block_out_channels):
            raise ConfigError(f"norm_num_groups: {self.norm_num_groups} must divide every entry of "
                              f"block_out_channels {list(self.block_out_channels)}")
        if self.layers_per_block < 1:
            raise ConfigError("layers_per_block: must be at least 1")
        if self.latent_channels < 1:
            raise ConfigError("latent_channels: must be at least 1")
        factor = 2 ** (len(self.block_out_channels) - 1)
        if self.sample_size <= 0 or self.sample_size % factor:
            raise ConfigError(f"sample_size: {self.sample_size} must be a positive multiple of the "
                              f"downsample factor {factor}")
        if self.scaling_factor <= 0:
            raise ConfigError("scaling_factor: must be positive")


def build_vae(cfg: AutoencoderConfig) -> AutoencoderKL:
    """A randomly initialised ``AutoencoderKL`` of the shape described by ``cfg``."""
    cfg.validate()
    levels = len(cfg.block_out_channels)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=tuple(cfg.block_out_channels),
        layers_per_block=cfg.layers_per_block,
        latent_channels=cfg.latent_channels,
        norm_num_groups=cfg.norm_num_groups,
        sample_size=cfg.sample_size,
        scaling_factor=cfg.scaling_factor,
        mid_block_add_attention=cfg.mid_block_attention,
    )


def locate_pretrained(path_or_id: str, subfolder: str,
                      markers: tuple[str, ...] = ("config.json",)) -> tuple[str, str | None]:
    """Where ``from_pretrained`` should look: ``(path or hub id, subfolder or None)``.

    A local directory is either the model itself (it holds one of ``markers``) or a full
    pipeline directory holding the model in ``subfolder`` (``vae``, ``text_encoder``,
    ``tokenizer``). Anything that does not exist locally and does not look like a path is a hub
    id; ``org/name/sub`` names a subfolder of a hub repository.
    """
    path = Path(path_or_id).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"{path_or_id}: is a file; expected a saved model directory")
        for where, sub in ((path, None), (path / subfolder, subfolder)):
            if any((where / m).is_file() for m in markers):
                return str(path), sub
        raise UserError(f"{path_or_id}: no {' or '.join(markers)} (nor in {subfolder}/): "
                        f"not a saved {subfolder} directory")
    if path_or_id.startswith(("/", ".", "~")) or "\\" in path_or_id or not path_or_id.strip():
        raise UserError(f"{path_or_id}: no such directory")
    parts = path_or_id.split("/")
    return "/".join(parts[:2]), "/".join(parts[2:]) or None


def absolute_if_local(path_or_id: str) -> str:
    """An existing local path made absolute (what a dataset's meta records, so that a run started
    from another directory finds it again); a hub id as given."""
    path = Path(path_or_id).expanduser()
    return str(path.resolve()) if path_or_id and path.exists() else path_or_id


def first_line(exc: BaseException) -> str:
    """The first line of an exception message (library errors span several lines)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_error(path_or_id: str, what: str, exc: BaseException) -> UserError:
    """A one-line error for a failed ``from_pretrained``."""
    if not Path(path_or_id).expanduser().exists():
        hint = offline_hint(path_or_id)
        return UserError(f"{path_or_id}: no such local directory, and loading it as a hub id failed"
                         + (hint if hint else f": {first_line(exc)}"))
    return UserError(f"{path_or_id}: cannot load the {what}: {first_line(exc)}")


def load_vae(path_or_id: str, dtype: torch.dtype | None = None,
             device: str | torch.device | None = None) -> AutoencoderKL:
    """A pretrained ``AutoencoderKL`` in eval mode with gradients off, from a local diffusers
    directory (or a pipeline directory with a ``vae/`` subfolder) or a hub id."""
    where, subfolder = locate_pretrained(path_or_id, "vae")
    try:
        with quiet_hub_calls():
            where = hub_source(where)
            config = AutoencoderKL.load_config(where, subfolder=subfolder)
    except (OSError, ValueError) as e:
        raise load_error(path_or_id, "VAE config", e) from None
    cls = config.get("_class_name")
    if cls != "AutoencoderKL":
        raise UserError(f"{path_or_id}: holds a {cls or 'non-diffusers model'}, not a diffusers AutoencoderKL")
    try:
        # low_cpu_mem_usage=False: the fast path needs `accelerate`, which is not a dependency.
        # dtype None = float32 (an exact upcast of float16/bfloat16 weights).
        with quiet_hub_calls():
            vae = AutoencoderKL.from_pretrained(where, subfolder=subfolder, use_safetensors=True,
                                                low_cpu_mem_usage=False, torch_dtype=dtype)
    except (OSError, ValueError) as e:
        raise load_error(path_or_id, "VAE (safetensors weights required)", e) from None
    vae.requires_grad_(False).eval()
    return vae if device is None else vae.to(device)


def state_fingerprint(config: dict[str, Any], module: torch.nn.Module) -> str:
    """sha256 of a model's config and weights (as float32, so it does not depend on the dtype the
    weights were stored or loaded in, as long as that cast was exact). Costs one pass over the
    weights: about 0.3 s per 100M parameters."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().to("cpu")
        if t.is_floating_point():
            t = t.to(torch.float32)
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def vae_fingerprint(vae_or_path: AutoencoderKL | str) -> str:
    """sha256 of the VAE's config and weights; a path or hub id is loaded first."""
    vae = load_vae(vae_or_path) if isinstance(vae_or_path, str) else vae_or_path
    config = {k: v for k, v in dict(vae.config).items() if not k.startswith("_")}
    return state_fingerprint(config, vae)


def vae_downsample_factor(vae: AutoencoderKL) -> int:
    """Pixels per latent cell along each side: the encoder halves the size between levels."""
    return 2 ** (len(vae.config.block_out_channels) - 1)


def vae_meta(vae: AutoencoderKL) -> dict[str, Any]:
    """What a latent dataset needs to know about the VAE that made it.

    Training scales latents as ``(z - shift_factor) * scaling_factor`` (``shift_factor`` None = 0);
    sampling inverts that before decoding.
    """
    return {
        "class": type(vae).__name__,
        "scaling_factor": float(vae.config.scaling_factor),
        "shift_factor": None if vae.config.shift_factor is None else float(vae.config.shift_factor),
        "latent_channels": int(vae.config.latent_channels),
        "downsample_factor": vae_downsample_factor(vae),
    }
