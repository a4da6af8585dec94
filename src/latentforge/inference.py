"""Generate images from a training run: the components, the sampling call, grids.

A checkpoint directory ``RUN/checkpoints/step-N/`` plus the run's ``train_config.yaml`` and
``data_meta.json`` say everything needed: the denoiser's architecture and weights (EMA by default),
the noise schedule, and which VAE and text encoder made the training latents (and so must
decode and encode here). Sampling follows diffusers' StableDiffusionPipeline step for step
(:func:`latentforge.diffusion.sampling.sample_latents`; PixArtAlphaPipeline's differences for the
transformer are listed there), so an exported pipeline reproduces these images for the same seed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw

from latentforge import checkpoint as ckpt
from latentforge.diffusion.sampling import sample_latents
from latentforge.diffusion.schedule import NoiseScheduleConfig, check_sampler_name, make_sampler
from latentforge.errors import UserError
from latentforge.models.autoencoder import load_vae, vae_fingerprint
from latentforge.models.text import encode_text, load_text_encoder, text_encoder_fingerprint
from latentforge.models.denoiser import denoiser_for, denoiser_of
from latentforge.train.ema import evaluation_weights
from latentforge.train.run_files import TRAIN_CONFIG, load_run_files


@dataclass
class Components:
    unet: torch.nn.Module  # the denoiser (a U-Net or a transformer; the name is kept for callers)
    vae: Any
    text_model: Any
    tokenizer: Any
    noise: NoiseScheduleConfig
    max_length: int
    device: torch.device
    weights: str  # which tensor group the denoiser holds: "ema" or "model"

    @property
    def model(self) -> torch.nn.Module:
        return self.unet


def run_dir_of(checkpoint_dir: Path) -> Path:
    return Path(checkpoint_dir).resolve().parent.parent


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory (its newest complete checkpoint).

    A checkpoint directory is returned even when incomplete: loading it then says what is wrong.
    """
    p = Path(path)
    if p.is_file():
        raise UserError(f"{path}: is a file; give the checkpoint directory that holds it, or the run directory")
    if not p.is_dir():
        raise UserError(f"{path}: no such directory; give a checkpoint directory or a run directory")
    if (p / ckpt.MARKER).exists() or (p / ckpt.META).exists():
        return p
    latest = ckpt.find_latest(p)
    if latest is None:
        raise UserError(f"{path}: neither a checkpoint directory nor a run directory with a complete checkpoint")
    return latest


def load_encoders(meta: dict[str, Any], device: torch.device) -> tuple[Any, Any, Any]:
    """The VAE, text encoder and tokenizer that encoded the training data (paths from its meta).

    Each is checked against the fingerprint the encode step recorded: a VAE or text encoder
    replaced at that path since would decode or condition wrongly without a word, so it is refused.
    """
    text = meta["text_encoder"]
    vae = load_vae(meta["vae"]["path"])
    _check_fingerprint("VAE", meta["vae"], vae_fingerprint(vae))
    # The encode step may have taken the tokenizer from elsewhere (e.g. a T5 without one).
    text_model, tokenizer = load_text_encoder(text["path"], tokenizer=text.get("tokenizer_path"))
    _check_fingerprint("text encoder", text, text_encoder_fingerprint(text_model, tokenizer))
    vae, text_model = vae.to(device), text_model.to(device)
    # Condition as the training data was encoded: with or without the padding mask (older data: with).
    text_model.config.use_attention_mask = bool(text.get("attention_mask", True))
    return vae, text_model, tokenizer


def _check_fingerprint(what: str, info: dict[str, Any], fingerprint: str) -> None:
    recorded = info.get("fingerprint")
    if recorded and recorded != fingerprint:  # data encoded before fingerprints were recorded: nothing to check
        raise UserError(f"{info['path']}: not the {what} the training data was encoded with (its weights or config "
                        "changed since): restore it, or re-encode the data and train again")


def load_components(checkpoint: str | Path, use_ema: bool = True, device: str | torch.device = "cpu",
                    sampler: str | None = None) -> Components:
    """The run's models and noise schedule; ``sampler``: a sampler name checked against the run's
    objective first, before any model is loaded."""
    path = resolve_checkpoint(checkpoint)
    run = run_dir_of(path)
    cfg, meta = load_run_files(run)
    if sampler is not None:
        check_sampler_name(sampler, cfg.train.noise)
    device = torch.device(device)
    c = ckpt.load_checkpoint(path)
    group = "ema" if use_ema and "ema" in c.tensors else "model"  # a run without EMA has only the raw weights
    if cfg.train.init_from:  # a fine-tuning run: the architecture (and a LoRA's base) is the base pipeline's
        from latentforge.train.finetune import model_for_run

        unet = model_for_run(cfg.train, c.tensors[group], str(path))
    else:
        unet = denoiser_for(cfg.train).build()
        ckpt.load_weights(unet, c.tensors[group], str(path), f"the model of {run / TRAIN_CONFIG}",
                          "the checkpoint and that file must come from the same run")
    unet.to(device).eval()
    vae, text_model, tokenizer = load_encoders(meta, device)
    return Components(unet, vae, text_model, tokenizer, cfg.train.noise, int(meta["text_encoder"]["max_length"]),
                      device, group)


@torch.no_grad()
def generate(unet: torch.nn.Module, vae: Any, text_model: Any, tokenizer: Any, noise: NoiseScheduleConfig,
             max_length: int, prompts: Sequence[str], seed: int = 0, num_steps: int = 30,
             guidance_scale: float = 5.0, sampler: str = "ddim", latent_size: int | None = None,
             progress: bool = False) -> list[Image.Image]:
    """Images for ``prompts`` (one each), the way StableDiffusionPipeline makes them for
    ``generator=torch.Generator(device).manual_seed(seed)`` and a list of prompts."""
    latents = generate_latents(unet, text_model, tokenizer, noise, max_length, prompts, seed, num_steps,
                               guidance_scale, sampler, latent_size, progress)
    return to_pil(decode_latents(vae, latents))


@torch.no_grad()
def generate_latents(unet: torch.nn.Module, text_model: Any, tokenizer: Any, noise: NoiseScheduleConfig,
                     max_length: int, prompts: Sequence[str], seed: int = 0, num_steps: int = 30,
                     guidance_scale: float = 5.0, sampler: str = "ddim",
                     latent_size: int | None = None, progress: bool = False) -> torch.Tensor:
    """The model-space latents of :func:`generate` (StableDiffusionPipeline's ``output_type="latent"``)."""
    if not prompts:
        raise UserError("generate: no prompts")
    if not 1 <= num_steps < noise.num_train_timesteps:
        raise UserError(f"sampling steps: {num_steps}; give 1 to {noise.num_train_timesteps - 1} (the model was "
                        f"trained on {noise.num_train_timesteps} noise levels; 20-50 is usual)")
    if not math.isfinite(guidance_scale):
        raise UserError(f"guidance scale: {guidance_scale} is not a finite number")
    device = next(unet.parameters()).device
    cond = encode_text(text_model, tokenizer, list(prompts), max_length)
    uncond = encode_text(text_model, tokenizer, [""] * len(prompts), max_length)
    # Condition as in training: with the caption mask exactly when the backbone trains with it.
    masks = (uncond["text_mask"], cond["text_mask"]) if denoiser_of(unet).uses_text_mask else None
    size = latent_size or unet.config.sample_size
    shape = (len(prompts), unet.config.in_channels, size, size)
    generator = torch.Generator(device=device).manual_seed(seed)
    return sample_latents(unet, make_sampler(sampler, noise, size), cond["text_hidden"], uncond["text_hidden"], shape,
                          num_steps, guidance_scale, generator, encoder_attention_mask=masks, device=device,
                          dtype=unet.dtype, progress=progress)


def decode_latents(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """Model-space latents -> images in [-1, 1]: undoes the training scaling
    ``(z - shift_factor) * scaling_factor`` (:func:`latentforge.models.autoencoder.vae_meta`).
    Without a shift this is StableDiffusionPipeline's ``vae.decode(latents / scaling_factor)``."""
    z = latents.to(vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
    return vae.decode(z, return_dict=False)[0]


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """[-1, 1] NCHW -> PIL, rounded as diffusers' image processor does."""
    arr = (images.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray((a * 255).round().astype(np.uint8)) for a in arr]


def make_grid(images: Sequence[Image.Image], labels: Sequence[str] | None = None, ncols: int | None = None,
              scale: int = 1) -> Image.Image:
    """Images in a grid, each scaled up ``scale`` times (nearest) with an optional label below."""
    if not images:
        raise ValueError("make_grid: no images")
    ncols = ncols or math.ceil(math.sqrt(len(images)))
    nrows = math.ceil(len(images) / ncols)
    w, h = images[0].width * scale, images[0].height * scale
    label_h = 12 if labels else 0
    grid = Image.new("RGB", (ncols * w, nrows * (h + label_h)), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    for i, img in enumerate(images):
        x, y = (i % ncols) * w, (i // ncols) * (h + label_h)
        grid.paste(img.resize((w, h), Image.Resampling.NEAREST), (x, y))
        if labels:
            draw.text((x + 2, y + h), labels[i][: max(4, w // 6)], fill=(0, 0, 0))
    return grid


def training_sampler(cfg: Any, meta: dict[str, Any], run: Path) -> Callable[[Any, int], None]:
    """A callback for the trainer: a grid of ``cfg.sampling.prompts`` with the EMA weights."""
    encoders: dict[str, Any] = {}

    def sample(trainer: Any, step: int) -> None:
        if not encoders:
            vae, text_model, tokenizer = load_encoders(meta, trainer.device)
            encoders.update(vae=vae, text_model=text_model, tokenizer=tokenizer)
        s = cfg.sampling
        with evaluation_weights(trainer.model, trainer.ema) as model:
            images = generate(model, encoders["vae"], encoders["text_model"], encoders["tokenizer"], cfg.noise,
                              int(meta["text_encoder"]["max_length"]), s.prompts, s.seed, s.num_steps,
                              s.guidance_scale, s.sampler)
        out = run / "samples"
        out.mkdir(parents=True, exist_ok=True)
        make_grid(images, s.prompts, scale=max(1, 128 // images[0].width)).save(out / f"step-{step:08d}.png")

    return sample
