"""The tensor shapes a recipe's phases train on, read from the recipe alone (no dataset opened).

``plan`` and ``bench --synthetic`` need the latent and text shapes of each phase before any data
exists: the image resolution of the phase (``phases[i].resolution``, else the ingest resolution),
the VAE's down-sampling factor (8 for a pretrained SD VAE named in ``encode.vae``; 2^(levels-1)
for the VAE ``train-vae`` builds from ``vae.model`` when ``encode.vae`` is empty), the latent
channels and text width the denoiser (``train.model``) expects, and the caption length
``encode.max_length``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from latentforge.errors import ConfigError
from latentforge.models.denoiser import denoiser_for
from latentforge.models.dit import DiTConfig
from latentforge.models.unet import UNetConfig
from latentforge.plan.cost import Phase

if TYPE_CHECKING:
    from latentforge.recipe import Recipe

SD_VAE_FACTOR = 8  # the SD 1.x/2.x AutoencoderKL: 512 px -> 64x64x4 latents


@dataclass(frozen=True)
class PhaseShapes:
    name: str
    resolution: int  # image side, px
    latent_channels: int
    latent_size: int  # latent side
    text_len: int  # caption tokens
    text_dim: int  # text hidden size


def vae_factor(recipe: "Recipe") -> int:
    if recipe.encode.vae:
        return SD_VAE_FACTOR
    return 2 ** (len(recipe.vae.model.block_out_channels) - 1)


def phase_shapes(recipe: "Recipe") -> list[PhaseShapes]:
    train = recipe.train
    if not train.phases:
        raise ConfigError("train.phases: empty: add at least one phase")
    den = denoiser_for(train)
    channels = den.latent_channels if den.cfg.in_channels or recipe.encode.vae else recipe.vae.model.latent_channels
    factor = vae_factor(recipe)
    out = []
    for i, p in enumerate(train.phases):
        res = p.resolution or recipe.ingest.image.resolution
        if res % factor:
            raise ConfigError(f"train.phases[{i}].resolution: {res} px is not divisible by the VAE factor {factor}")
        den.check_latent_size(res // factor, f"latent side of train.phases[{i}] ({res} px)")
        out.append(PhaseShapes(p.name or f"phase{i}", res, channels, res // factor,
                               recipe.encode.max_length or 77, den.text_dim))
    return out


def unet_for(recipe: "Recipe", shapes: PhaseShapes) -> UNetConfig | DiTConfig:
    """The config of the recipe's denoiser (``train.model``; the name is historical) with its
    data-determined fields filled in from ``shapes``."""
    return denoiser_for(recipe.train).with_data(shapes.latent_channels, shapes.latent_size, shapes.text_dim).cfg


def recipe_phases(recipe: "Recipe", with_flops: bool = True) -> list[Phase]:
    """The recipe's phases with their sample counts (``samples``, or ``steps`` x global batch) and
    model FLOPs per training image (counted on the meta device; those of the patch-masked forward
    in a phase that masks)."""
    from latentforge.plan.flops import train_flops_per_image

    train = recipe.train
    out = []
    for i, (p, s) in enumerate(zip(train.phases, phase_shapes(recipe))):
        if p.samples:
            samples = p.samples
        else:
            global_ = p.global_batch_size or train.global_batch_size
            if not global_:
                raise ConfigError(f"train.phases[{i}].global_batch_size: needed to turn {p.steps} steps into "
                                  "images: set it or train.global_batch_size (or give the phase's samples)")
            samples = p.steps * global_
        flops = float(train_flops_per_image(unet_for(recipe, s), s.latent_size, s.text_len, train.masking_ratio_of(i),
                                            train.masking.mixer_blocks)) if with_flops else 0.0
        out.append(Phase(s.name, s.resolution, samples, flops))
    return out
