"""The diffusion transformer: ``diffusers.PixArtTransformer2DModel`` built from a preset plus overrides.

PixArt-alpha (Chen et al. 2023, arXiv:2310.00426) is a DiT (Peebles & Xie 2023, arXiv:2212.09748)
with cross-attention to the text states in every block and one shared adaLN ("adaLN-single")
for the timestep. Its text projection takes states of any width (``caption_channels``), so the
same class serves T5-XXL (4096), CLIP or the demo's 384-wide MiniLM, and an exported run loads
as a ``PixArtAlphaPipeline`` (see docs/decisions.md for why this class and not SD3, Sana or PRX).

Presets (parameter counts at the preset's own defaults, counted on the meta device):

=========  ============  ========================================================================
preset     parameters    what it is for
=========  ============  ========================================================================
xl-2       610,856,096   exactly PixArt-alpha/PixArt-XL-2-512x512 ``transformer/config.json``
                         (28 blocks of 1152 = 16 heads x 72, patch 2, T5-XXL text, 64x64x4
                         latents, 4+4 output channels for the learned variance); the published
                         "0.6B". The 1024-MS model adds the size conditioning (611,349,152).
small      5,174,224     8 blocks of 192 (3 heads x 64), patch 2, 384-d text: the demo's size
                         on CPU (run 13's tiny-cpu U-Net had 4.6M), quick GPU trials.
tiny       210,128       2 blocks of 64 (2 heads x 32), patch 2, 384-d text: tests and the CPU
                         demo at 16x16 latents.
=========  ============  ========================================================================

(the counts above are at each preset's published text width and output channels; a run fills
``in_channels``/``out_channels`` from the latents and ``caption_channels`` from the text encoder,
which changes them: xl-2 on 384-d text with 4 output channels has 606,561,424.)

Training here predicts eps or v with a fixed variance, so a run's ``out_channels`` is the latent
channels; a PixArtAlphaPipeline uses all of them (it splits off a learned variance only when
``out_channels`` is twice the latent channels).

The latent side must be a multiple of ``patch_size``: each ``patch_size``-square patch is one token
(16x16 latents with patch 2: 64 tokens). The 2D sin-cos position table is recomputed for other
latent sizes, so one model trains on several resolutions.

:func:`dit_forward_tokens` runs the same model on a subset of its patch tokens (what patch masking
trains on, ``train/masking.py``); :func:`patchify` lays a latent out as those tokens.

This module knows nothing about training or parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from diffusers import PixArtTransformer2DModel

from latentforge.errors import ConfigError

__all__ = ["PRESETS", "DiTConfig", "dit_diffusers_config", "build_dit", "dit_num_params", "patchify", "gather_tokens",
           "dit_forward_tokens"]

# The PixArt family's fixed choices (diffusers' defaults for this class, written out so that a
# change of diffusers' defaults cannot change our models).
_PIXART: dict[str, Any] = {
    "activation_fn": "gelu-approximate",
    "attention_bias": True,
    "attention_type": "default",
    "dropout": 0.0,
    "norm_elementwise_affine": False,
    "norm_eps": 1e-6,
    "norm_num_groups": 32,  # unused by the class; kept as in the published config.json
    "norm_type": "ada_norm_single",
    "num_embeds_ada_norm": 1000,
    "upcast_attention": False,
    "interpolation_scale": None,  # None = max(sample_size // 64, 1), as PixArt
}

PRESETS: dict[str, dict[str, Any]] = {
    # PixArt-alpha/PixArt-XL-2-512x512, transformer/config.json.
    "xl-2": {
        **_PIXART,
        "num_attention_heads": 16,
        "attention_head_dim": 72,
        "num_layers": 28,
        "patch_size": 2,
        "in_channels": 4,
        "out_channels": 8,
        "sample_size": 64,
        "caption_channels": 4096,
        "use_additional_conditions": False,
    },
    # About run 13's demo U-Net's size (4.6M): 8 blocks of 192 = 3 heads x 64. DiT-S/2's trunk (12 x 384,
    # 29.8M here) trained at 25-37 s per step of 8 at 16x16 latents on the 2 shared vCPUs.
    "small": {
        **_PIXART,
        "num_attention_heads": 3,
        "attention_head_dim": 64,
        "num_layers": 8,
        "patch_size": 2,
        "in_channels": 4,
        "out_channels": 4,
        "sample_size": 32,
        "caption_channels": 384,
        "use_additional_conditions": False,
    },
    "tiny": {
        **_PIXART,
        "num_attention_heads": 2,
        "attention_head_dim": 32,
        "num_layers": 2,
        "patch_size": 2,
        "in_channels": 4,
        "out_channels": 4,
        "sample_size": 16,
        "caption_channels": 384,
        "use_additional_conditions": False,
    },
}


@dataclass
class DiTConfig:
    """A diffusion-transformer preset and overrides of its architecture fields (``None`` keeps the preset's)."""

    preset: Literal["xl-2", "small", "tiny"] = field(
        default="tiny", metadata={"help": "xl-2 (PixArt-alpha XL/2, 0.6B), small (5.2M) or tiny (0.21M)"})
    in_channels: int | None = field(default=None, metadata={
        "help": "latent channels going in (the autoencoder's latent_channels); null = from the latents"})
    out_channels: int | None = field(default=None, metadata={
        "help": "channels predicted; null = the latent channels (no learned variance)"})
    sample_size: int | None = field(default=None, metadata={
        "help": "default latent side; an exported pipeline's default image side is this times the VAE factor"})
    patch_size: int | None = field(default=None, metadata={
        "help": "latent pixels per patch side (one token per patch); must divide the latent side"})
    num_layers: int | None = field(default=None, metadata={"help": "transformer blocks"})
    num_attention_heads: int | None = field(default=None, metadata={"help": "attention heads per block"})
    attention_head_dim: int | None = field(default=None, metadata={
        "help": "size of each head (width = heads x head size; 16 x 72 = 1152 for XL)"})
    caption_channels: int | None = field(default=None, metadata={
        "help": "hidden size of the text encoder states (4096 T5-XXL, 384 MiniLM); null = from the data"})

    def overrides(self) -> dict[str, Any]:
        """The fields set explicitly (not ``None``), as diffusers config entries."""
        return {k: v for k, v in vars(self).items() if k != "preset" and v is not None}

    def validate(self) -> None:
        if self.preset not in PRESETS:
            raise ConfigError(f"preset: unknown {self.preset!r}; choose one of {', '.join(PRESETS)}")
        c = dit_diffusers_config(self, validate=False)
        for name in ("in_channels", "out_channels", "sample_size", "patch_size", "num_layers", "num_attention_heads",
                     "attention_head_dim", "caption_channels"):
            if c[name] < 1:
                raise ConfigError(f"{name}: must be a positive integer, got {c[name]}")
        check_patch_size(c["patch_size"], c["sample_size"], "sample_size")


def check_patch_size(patch_size: int, latent_size: int, what: str) -> None:
    """One token per ``patch_size``-square patch: the latent side must be a multiple of it."""
    if latent_size % patch_size:
        raise ConfigError(f"patch_size: {patch_size} does not divide the {what} {latent_size} (latent pixels); "
                          f"choose a patch size that divides it")


def dit_diffusers_config(cfg: DiTConfig, validate: bool = True) -> dict[str, Any]:
    """The complete ``PixArtTransformer2DModel`` keyword arguments (= its ``config.json``) for ``cfg``."""
    if validate:
        cfg.validate()
    resolved = {**PRESETS[cfg.preset], **cfg.overrides()}
    # The caption projection maps the text states to the transformer's width, which is then the
    # cross-attention's key/value width.
    resolved["cross_attention_dim"] = resolved["num_attention_heads"] * resolved["attention_head_dim"]
    return dict(resolved)


def build_dit(cfg: DiTConfig) -> PixArtTransformer2DModel:
    """A freshly initialised transformer on the current default device (``torch.device("meta")``
    as a context manager builds one without allocating its weights)."""
    return PixArtTransformer2DModel(**dit_diffusers_config(cfg))


def dit_num_params(cfg: DiTConfig) -> int:
    """The number of parameters of ``cfg``'s transformer, counted on the meta device."""
    with torch.device("meta"):
        model = build_dit(cfg)
    return sum(p.numel() for p in model.parameters())


def patchify(x: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, p*p*C) with N = (H/p)(W/p): token n is the patch at row n // (W/p),
    column n % (W/p) (the order of the patch embedding's tokens), its values ordered (row in patch,
    column in patch, channel): the inverse of PixArtTransformer2DModel's unpatchify of ``proj_out``."""
    b, c, h, w = x.shape
    p = patch_size
    x = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(b, (h // p) * (w // p), p * p * c)


def gather_tokens(tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """tokens (B, N, D) at the indices ``keep`` (B, K) of each sample: (B, K, D)."""
    return torch.gather(tokens, 1, keep.to(tokens.device)[..., None].expand(-1, -1, tokens.shape[-1]))


def dit_forward_tokens(model: PixArtTransformer2DModel, latents: torch.Tensor, timestep: torch.Tensor,
                       text: torch.Tensor, text_mask: torch.Tensor | None = None, keep: torch.Tensor | None = None,
                       mixer_blocks: int = 0) -> torch.Tensor:
    """The transformer's prediction of the patches ``keep`` (B, K) of ``latents`` (B, C, H, W), as
    tokens (B, K, p*p*out_channels) in :func:`patchify`'s layout, computed on those tokens only:
    every patch is embedded (with its position), the first ``mixer_blocks`` blocks run on all of them,
    then only the kept tokens go on through the remaining blocks and the output layer (MaskDiT,
    arXiv:2306.09305, sec. 3; MicroDiT's deferred masking, arXiv:2407.15811, sec. 3.2). ``keep``
    None = every token in order: then the result is the model's own forward, patchified.

    Called as ``model.forward`` (see ``DiTDenoiser.forward_tokens``) so that the wrappers around
    ``model`` (DDP, FSDP2's root hooks) run as for its own forward; the blocks are called as modules."""
    b = latents.shape[0]
    # The caption padding mask as the additive bias the blocks' cross-attention takes (as PixArt's forward).
    bias = None if text_mask is None else ((1 - text_mask.to(latents.dtype)) * -10000.0).unsqueeze(1)
    tokens = model.pos_embed(latents)  # (B, N, D): patch embedding plus the 2D sin-cos position
    t_mod, t_emb = model.adaln_single(timestep, {"resolution": None, "aspect_ratio": None}, batch_size=b,
                                      hidden_dtype=tokens.dtype)
    if model.caption_projection is not None:
        text = model.caption_projection(text).view(b, -1, tokens.shape[-1])
    blocks = list(model.transformer_blocks)
    for i, block in enumerate(blocks):
        if i == mixer_blocks and keep is not None:
            tokens = gather_tokens(tokens, keep)
        tokens = block(tokens, encoder_hidden_states=text, encoder_attention_mask=bias, timestep=t_mod)
    if mixer_blocks >= len(blocks) and keep is not None:
        tokens = gather_tokens(tokens, keep)
    # The final adaLN: one (shift, scale) per sample from the timestep embedding (PixArt-alpha, Fig. 4).
    shift, scale = (model.scale_shift_table[None] + t_emb[:, None].to(model.scale_shift_table.device)).chunk(2, dim=1)
    tokens = model.norm_out(tokens) * (1 + scale) + shift
    return model.proj_out(tokens)
