"""Sampling: classifier-free guidance and the denoising loop of diffusers' StableDiffusionPipeline.

:func:`sample_latents` repeats ``StableDiffusionPipeline.__call__`` (diffusers 0.42,
``pipelines/stable_diffusion/pipeline_stable_diffusion.py``) from the prompt embeddings to the
final latents, step for step and in the same order of random draws, so that a pipeline exported
from a checkpoint reproduces our samples for the same seed:

1. guidance is on when ``guidance_scale > 1``; the U-Net then sees one batch
   ``cat([uncond, cond])`` (unconditional first);
2. ``scheduler.set_timesteps(num_steps, device=device)``;
3. initial latents ``randn_tensor(shape, generator, device, dtype) * scheduler.init_noise_sigma``
   (the first use of the generator);
4. per step: ``scale_model_input``, one U-Net call, guidance, ``scheduler.step`` with ``eta`` and
   ``generator`` passed only if that scheduler's ``step`` accepts them (DDPM and Euler draw from
   the generator at every step, DDIM with eta = 0 and DPM-Solver++ never do);
5. with the pipeline's default ``guidance_rescale=0`` no guidance rescaling (Lin et al. 2023) is
   done, and none is done here.

The same loop runs a flow-matching model with diffusers' flow schedulers (timesteps are then
sigma * num_train_timesteps; FlowMatchEulerDiscreteScheduler's are float32, the flow
DPM-Solver's int64; the model's output is the velocity, which the scheduler integrates).

One difference is deliberate and optional: the pipeline never passes an ``encoder_attention_mask``
to the U-Net (SD's CLIP states attend over all 77 positions, padding included). This loop passes
one only when given one. A model trained with masks is therefore sampled here with masks, but an
exported pipeline would sample it without them and give different images.

The diffusion transformer's pipeline (``PixArtAlphaPipeline``) runs the same loop with three
differences, all handled here: it passes the caption masks (uncond first, as the states), expands
the timestep to the batch (the denoiser's ``forward`` does), and with a single step it keeps the
scheduler's predicted clean latents (``scheduler.step(...)[1]``) rather than the next sample.
"""

from __future__ import annotations

import inspect
from typing import Sequence

import torch
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from diffusers.utils.torch_utils import randn_tensor
from tqdm.auto import tqdm

from latentforge.models.denoiser import denoiser_of

__all__ = ["cfg_combine", "sample_latents"]


def cfg_combine(uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
    """uncond + scale * (cond - uncond) (Ho & Salimans 2022, arXiv:2207.12598, eq. 6 with scale = 1 + w)."""
    return uncond + scale * (cond - uncond)


@torch.no_grad()
def sample_latents(
    unet: torch.nn.Module,
    scheduler: SchedulerMixin,
    cond_hidden: torch.Tensor,
    uncond_hidden: torch.Tensor | None,
    shape: Sequence[int],
    num_steps: int,
    guidance_scale: float,
    generator: torch.Generator,
    encoder_attention_mask: tuple[torch.Tensor | None, torch.Tensor] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    eta: float = 0.0,
    progress: bool = False,
) -> torch.Tensor:
    """Denoise from pure noise to latents (the loop of diffusers' StableDiffusionPipeline.__call__, see the module docstring).

    ``cond_hidden``/``uncond_hidden`` are text-encoder states of shape (batch, seq, dim); the
    unconditional ones are needed only when ``guidance_scale > 1``. ``shape`` is
    (batch, latent_channels, height, width) in latent pixels. ``encoder_attention_mask`` is
    ``(uncond_mask, cond_mask)``, each (batch, seq) with 1 for tokens to attend to.
    ``device``/``dtype`` default to the U-Net's. ``eta`` is DDIM's eta (0 = deterministic DDIM); ``progress``: a bar over the steps.
    ``unet`` is any denoiser of ``models/denoiser.py`` (a U-Net or a transformer), in eval mode. The scheduler is reset by ``set_timesteps``, so it can be reused
    for the next call, but not shared by two loops at once.
    """
    device = torch.device(device) if device is not None else unet.device
    dtype = dtype or unet.dtype
    do_guidance = guidance_scale > 1.0
    batch = shape[0]
    if cond_hidden.ndim != 3 or cond_hidden.shape[0] != batch:
        raise ValueError(f"cond_hidden: expected shape (batch={batch}, seq, dim), got {tuple(cond_hidden.shape)}")
    if do_guidance:
        if uncond_hidden is None:
            raise ValueError(f"uncond_hidden: needed for guidance_scale {guidance_scale} > 1")
        if uncond_hidden.shape != cond_hidden.shape:
            raise ValueError(
                f"uncond_hidden: shape {tuple(uncond_hidden.shape)} differs from cond_hidden's "
                f"{tuple(cond_hidden.shape)}; pad both to the same sequence length"
            )
    if getattr(unet.config, "time_cond_proj_dim", None) is not None:
        raise ValueError("unet: guidance-embedding U-Nets (time_cond_proj_dim set) are not supported here")

    # The pipeline casts the prompt embeddings to the text encoder's (or the U-Net's) dtype, and
    # makes the initial latents in that same dtype.
    hidden = torch.cat([uncond_hidden, cond_hidden]) if do_guidance else cond_hidden
    hidden = hidden.to(device=device, dtype=dtype)
    mask = None
    if encoder_attention_mask is not None:
        uncond_mask, cond_mask = encoder_attention_mask
        if do_guidance and uncond_mask is None:
            raise ValueError("encoder_attention_mask: give (uncond_mask, cond_mask) when guidance_scale > 1")
        mask = torch.cat([uncond_mask, cond_mask]) if do_guidance else cond_mask
        mask = mask.to(device=device)

    scheduler.set_timesteps(num_steps, device=device)
    latents = randn_tensor(tuple(shape), generator=generator, device=device, dtype=dtype)
    # Flow-matching schedulers start at sigma = 1, unit-variance noise. FlowMatchEulerDiscreteScheduler
    # has no init_noise_sigma (StableDiffusionPipeline fails on it there; the flow DPM-Solver has 1.0).
    latents = latents * getattr(scheduler, "init_noise_sigma", 1.0)

    step_params = set(inspect.signature(scheduler.step).parameters)
    step_kwargs = {}
    if "eta" in step_params:
        step_kwargs["eta"] = eta
    if "generator" in step_params:
        step_kwargs["generator"] = generator

    denoiser = denoiser_of(unet)
    last = 1 if denoiser.single_step_returns_x0 and num_steps == 1 else 0
    for t in tqdm(scheduler.timesteps, desc=f"sample {shape[0]} images", unit="step", disable=not progress):
        model_input = torch.cat([latents] * 2) if do_guidance else latents
        if hasattr(scheduler, "scale_model_input"):  # as the pipeline does: flow schedulers have none
            model_input = scheduler.scale_model_input(model_input, t)
        pred = denoiser.forward(unet, model_input, t, hidden, mask)
        if do_guidance:
            pred_uncond, pred_cond = pred.chunk(2)
            pred = cfg_combine(pred_uncond, pred_cond, guidance_scale)
        latents = scheduler.step(pred, t, latents, **step_kwargs, return_dict=False)[last]
    return latents
