"""The denoising U-Net: ``diffusers.UNet2DConditionModel`` built from a preset plus overrides.

Presets (parameter counts at the preset's own defaults, counted on the meta device):

=========  ============  ========================================================================
preset     parameters    what it is for
=========  ============  ========================================================================
sd2-base   865,910,724   exactly stabilityai/stable-diffusion-2-base ``unet/config.json``
                         (512 px images, 64x64x4 latents, 1024-d OpenCLIP-H text states).
small      38,800,580    sd2-base's layout at one fifth of the width (64-d heads, 1024-d text):
                         CPU benchmarks and quick GPU trials at 32x32 latents (256 px / 8x VAE).
tiny       343,476       two blocks, 16 and 32 channels, attention only at the inner level,
                         384-d text (all-MiniLM-L6-v2): tests and the CPU demo at 4x4 to 16x16
                         latents. One fp32 AdamW training step at batch 64 of 8x8x4 latents with
                         77 text tokens took 70-90 ms on 2 vCPUs (16 tokens: 50-65 ms). Its
                         first conv maps the latents to 16 channels: widen block_out_channels
                         for latents with many channels (e.g. 48).
custom     -             no preset: the architecture fields named in ``CUSTOM_REQUIRED`` must be
                         set; the others take sd2-base's values.
=========  ============  ========================================================================

Any preset field can be overridden, e.g. ``cross_attention_dim`` to the text encoder's hidden size
or ``in_channels``/``out_channels`` to the autoencoder's latent channels. The parameter count
changes with them (tiny with 16 latent channels: 346,944; with ``block_out_channels: [32, 64]``, 1,165,668
at roughly twice the step time).

A naming trap kept from diffusers: ``attention_head_dim`` is the number of attention *heads*
per block (SD2's ``[5, 10, 20, 20]`` over ``[320, 640, 1280, 1280]`` channels gives 64-d heads).
The name is kept so that the resolved config is the diffusers ``config.json`` unchanged.

The U-Net's spatial size is halved once per block after the first, so latent sides should be
divisible by ``2 ** (len(block_out_channels) - 1)`` (tiny: 2, small and sd2-base: 8).

This module knows nothing about training or parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from diffusers import UNet2DConditionModel

from latentforge.errors import ConfigError
from latentforge.models.pretrained import load_pretrained

__all__ = [
    "PRESETS",
    "CUSTOM_REQUIRED",
    "UNetConfig",
    "unet_diffusers_config",
    "build_unet",
    "unet_num_params",
    "load_unet",
]

# Shared by every preset: the SD 1.x/2.x family's fixed choices (diffusers defaults, written out
# so that a change of diffusers' defaults cannot change our models).
_SD_FAMILY: dict[str, Any] = {
    "act_fn": "silu",
    "center_input_sample": False,
    "downsample_padding": 1,
    "dual_cross_attention": False,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "num_class_embeds": None,
    "only_cross_attention": False,
}

_SD2_BASE: dict[str, Any] = {
    **_SD_FAMILY,
    "attention_head_dim": [5, 10, 20, 20],  # heads per block, see the module docstring
    "block_out_channels": [320, 640, 1280, 1280],
    "cross_attention_dim": 1024,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "in_channels": 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "out_channels": 4,
    "sample_size": 64,
    "transformer_layers_per_block": 1,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    "use_linear_projection": True,
}

PRESETS: dict[str, dict[str, Any]] = {
    "sd2-base": _SD2_BASE,
    "small": {
        **_SD2_BASE,
        "attention_head_dim": [1, 2, 4, 4],  # 64-d heads, as in sd2-base
        "block_out_channels": [64, 128, 256, 256],
        "sample_size": 32,
    },
    # Measured on 2 vCPUs: 16/32 channels with attention only at the half-resolution level is
    # about 3x faster per step than 32/64 channels with attention at full resolution (0.9M
    # params, about 160 ms), which matters for a demo that needs thousands of steps.
    "tiny": {
        **_SD_FAMILY,
        "attention_head_dim": [1, 1],
        "block_out_channels": [16, 32],
        "cross_attention_dim": 384,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
        "in_channels": 4,
        "layers_per_block": 1,
        "norm_num_groups": 8,
        "out_channels": 4,
        "sample_size": 8,
        "transformer_layers_per_block": 1,
        "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
        "use_linear_projection": True,
    },
}

# Fields a "custom" U-Net must set: their lengths and sizes must agree with each other, so
# borrowing some of them from a preset would rarely be what was meant.
CUSTOM_REQUIRED = (
    "block_out_channels",
    "layers_per_block",
    "attention_head_dim",
    "cross_attention_dim",
    "down_block_types",
    "up_block_types",
)

_DOWN_BLOCKS = ("CrossAttnDownBlock2D", "DownBlock2D")
_UP_BLOCKS = ("CrossAttnUpBlock2D", "UpBlock2D")


@dataclass
class UNetConfig:
    """A U-Net preset and overrides of its architecture fields (``None`` keeps the preset's)."""

    preset: Literal["sd2-base", "small", "tiny", "custom"] = field(
        default="tiny", metadata={"help": "sd2-base (866M), small (39M), tiny (0.34M) or custom"}
    )
    in_channels: int | None = field(
        default=None, metadata={"help": "latent channels going in (the autoencoder's latent_channels)"}
    )
    out_channels: int | None = field(
        default=None, metadata={"help": "channels predicted (equal to in_channels for text-to-image)"}
    )
    sample_size: int | None = field(
        default=None, metadata={"help": "default latent side; an exported pipeline's default image side is this times the VAE factor"}
    )
    block_out_channels: list[int] | None = field(
        default=None, metadata={"help": "channels per resolution level, e.g. [320, 640, 1280, 1280]"}
    )
    layers_per_block: int | None = field(
        default=None, metadata={"help": "ResNet layers per down block (up blocks get one more)"}
    )
    attention_head_dim: int | list[int] | None = field(
        default=None,
        metadata={"help": "NUMBER OF HEADS per block (diffusers' historical name): SD2's [5, 10, 20, 20] gives 64-d heads"},
    )
    cross_attention_dim: int | None = field(
        default=None, metadata={"help": "hidden size of the text encoder states (1024 OpenCLIP-H, 768 CLIP-L, 384 MiniLM)"}
    )
    transformer_layers_per_block: int | list[int] | None = field(
        default=None, metadata={"help": "transformer layers in each cross-attention block"}
    )
    use_linear_projection: bool | None = field(
        default=None, metadata={"help": "linear (SD2) instead of 1x1-conv (SD1) projections around attention"}
    )
    norm_num_groups: int | None = field(
        default=None, metadata={"help": "GroupNorm groups; must divide every entry of block_out_channels"}
    )
    down_block_types: list[str] | None = field(
        default=None, metadata={"help": f"one per level, each one of {', '.join(_DOWN_BLOCKS)}"}
    )
    up_block_types: list[str] | None = field(
        default=None, metadata={"help": f"one per level, coarsest first, each one of {', '.join(_UP_BLOCKS)}"}
    )
    addition_embed_type: Literal["text"] | None = field(
        default=None, metadata={"help": "text: the caption's states, attention-pooled, projected and added to the "
                                        "timestep embedding (diffusers' TextTimeEmbedding), so that every ResNet "
                                        "block sees the caption, not only the cross-attention ones; the pooling "
                                        "takes every token, padding included (diffusers' takes no mask); null = off"}
    )
    addition_embed_type_num_heads: int | None = field(
        default=None, metadata={"help": "heads of that attention pooling; must divide cross_attention_dim "
                                        "(diffusers' default: 64)"}
    )

    def overrides(self) -> dict[str, Any]:
        """The fields set explicitly (not ``None``), as diffusers config entries."""
        return {k: v for k, v in vars(self).items() if k != "preset" and v is not None}

    def validate(self) -> None:
        if self.preset not in (*PRESETS, "custom"):
            raise ConfigError(f"preset: unknown {self.preset!r}; choose one of {', '.join(PRESETS)}, custom")
        if self.preset == "custom":
            for name in CUSTOM_REQUIRED:
                if getattr(self, name) is None:
                    raise ConfigError(f"{name}: required when preset is 'custom' (or pick a preset to start from)")
        c = unet_diffusers_config(self, validate=False)
        num_levels = len(c["block_out_channels"])
        if num_levels < 1:
            raise ConfigError("block_out_channels: needs at least one level")
        for name in ("in_channels", "out_channels", "sample_size", "layers_per_block", "cross_attention_dim", "norm_num_groups"):
            if c[name] < 1:
                raise ConfigError(f"{name}: must be a positive integer, got {c[name]}")
        for name in ("down_block_types", "up_block_types", "attention_head_dim", "transformer_layers_per_block"):
            value = c[name]
            if isinstance(value, list) and len(value) != num_levels:
                raise ConfigError(
                    f"{name}: has {len(value)} entries but block_out_channels has {num_levels} levels; give one per level"
                )
        for name, allowed in (("down_block_types", _DOWN_BLOCKS), ("up_block_types", _UP_BLOCKS)):
            for block in c[name]:
                if block not in allowed:
                    raise ConfigError(f"{name}: unknown block {block!r}; use {' or '.join(allowed)}")
        heads = c["attention_head_dim"]
        heads = heads if isinstance(heads, list) else [heads] * num_levels
        for channels, num_heads in zip(c["block_out_channels"], heads):
            if channels < 1 or channels % c["norm_num_groups"]:
                raise ConfigError(
                    f"block_out_channels: {channels} is not a positive multiple of norm_num_groups "
                    f"{c['norm_num_groups']}; change one of them"
                )
            if num_heads < 1 or channels % num_heads:
                raise ConfigError(
                    f"attention_head_dim: {num_heads} heads do not divide {channels} channels "
                    "(it is the number of heads per block, not their size)"
                )
        layers = c["transformer_layers_per_block"]
        if any(n < 1 for n in (layers if isinstance(layers, list) else [layers])):
            raise ConfigError(f"transformer_layers_per_block: must be positive, got {layers}")
        kind = c.get("addition_embed_type")  # None or "text": the field's type already checked it
        pool_heads = c.get("addition_embed_type_num_heads")
        if pool_heads is not None and kind is None:
            raise ConfigError("addition_embed_type_num_heads: set without addition_embed_type; "
                              "set addition_embed_type: text or drop it")
        if kind == "text":
            pool_heads = 64 if pool_heads is None else pool_heads
            if pool_heads < 1 or c["cross_attention_dim"] % pool_heads:
                raise ConfigError(f"addition_embed_type_num_heads: {pool_heads} heads do not divide "
                                  f"cross_attention_dim {c['cross_attention_dim']}")


def unet_diffusers_config(cfg: UNetConfig, validate: bool = True) -> dict[str, Any]:
    """The complete ``UNet2DConditionModel`` keyword arguments (= its ``config.json``) for ``cfg``."""
    if validate:
        cfg.validate()
    base = PRESETS["sd2-base" if cfg.preset == "custom" else cfg.preset]
    resolved = {**base, **cfg.overrides()}
    # Copies, so that a caller editing the result cannot change the presets.
    return {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in resolved.items()}


def build_unet(cfg: UNetConfig) -> UNet2DConditionModel:
    """A freshly initialised U-Net on the current default device (use ``torch.device("meta")``
    as a context manager to build one without allocating its weights)."""
    return UNet2DConditionModel(**unet_diffusers_config(cfg))


def unet_num_params(cfg: UNetConfig) -> int:
    """The number of parameters of ``cfg``'s U-Net, counted on the meta device (no weights allocated)."""
    with torch.device("meta"):
        model = build_unet(cfg)
    return sum(p.numel() for p in model.parameters())


def load_unet(path_or_id: str, subfolder: str | None = None) -> UNet2DConditionModel:
    """A U-Net saved by ``save_pretrained`` (a directory or a hub id); safetensors weights only."""
    where = f"{path_or_id}/{subfolder}" if subfolder else path_or_id
    return load_pretrained(UNet2DConditionModel, path_or_id, subfolder, label=f"load_unet {where}")
