"""The rectified-flow (flow-matching) objective: the straight path, its velocity, its time distribution.

Conventions (those of Esser et al. 2024, "Scaling Rectified Flow Transformers for High-Resolution
Image Synthesis" (SD3), arXiv:2403.03206, and of diffusers' ``FlowMatchEulerDiscreteScheduler``):
``sigma`` in [0, 1] runs from data (0) to pure noise (1); the path is
x_sigma = (1 - sigma) x0 + sigma eps; the model predicts the velocity d x_sigma / d sigma = eps - x0;
it is conditioned on ``timestep = sigma * num_train_timesteps`` (a float, not an index); sampling
integrates the ODE from sigma = 1 down to 0. The loss is the plain MSE on the velocity, with the
weighting carried by the distribution sigma is drawn from (SD3 §3.1: logit-normal).

Pure functions of tensors. Randomness comes from an explicit ``torch.Generator`` only, never from
the global RNG, so that a trainer can resume bit-exactly. Compute in float32 (as the eps/v
objective does): pass float32 latents.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from latentforge.errors import ConfigError

__all__ = [
    "FLOW_MATCHING",
    "TIME_SAMPLINGS",
    "flow_noisy",
    "flow_target",
    "flow_pred_x0",
    "flow_timestep",
    "shift_sigma",
    "resolution_shift",
    "sample_flow_sigmas",
]

FLOW_MATCHING = "flow_matching"  # the NoiseScheduleConfig.prediction_type that selects this objective
TIME_SAMPLINGS = ("logit_normal", "uniform")


def _per_sample(sigma: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """sigma (batch,) shaped (batch, 1, ..., 1) in ``like``'s dtype and device, to broadcast against it."""
    return sigma.to(device=like.device, dtype=like.dtype).reshape((-1,) + (1,) * (like.ndim - 1))


def flow_noisy(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """x_sigma = (1 - sigma) x0 + sigma eps (Liu et al. 2022, arXiv:2209.03003, eq. 1 with X_1 the noise;
    SD3 §2, a_t = 1 - t, b_t = t; diffusers' FlowMatchEulerDiscreteScheduler.scale_noise)."""
    s = _per_sample(sigma, x0)
    return (1 - s) * x0 + s * noise


def flow_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The velocity d x_sigma / d sigma = eps - x0 (Liu et al. 2022, eq. 1: X_1 - X_0; SD3 §2, the
    conditional vector field u_t(z | eps) for a_t = 1 - t, b_t = t)."""
    return noise - x0


def flow_pred_x0(velocity: torch.Tensor, x_sigma: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """x0 = x_sigma - sigma v (the path solved for x0; diffusers' flow_prediction ``x0_pred``)."""
    return x_sigma - _per_sample(sigma, x_sigma) * velocity


def flow_timestep(sigma: torch.Tensor, num_train_timesteps: int) -> torch.Tensor:
    """The model's timestep input, sigma * num_train_timesteps (float32), as diffusers' flow-matching
    schedulers hand it to the denoiser (``FlowMatchEulerDiscreteScheduler.timesteps``)."""
    return sigma.to(torch.float32) * num_train_timesteps


def shift_sigma(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """sigma' = a sigma / (1 + (a - 1) sigma), a = ``shift`` (SD3 §5.3.2, t_m = sqrt(m/n) t_n /
    (1 + (sqrt(m/n) - 1) t_n); diffusers' ``shift``): a > 1 spends more of training and sampling at high noise."""
    if shift <= 0:
        raise ConfigError(f"flow_shift: must be positive, got {shift}")
    return shift * sigma / (1 + (shift - 1) * sigma)


def resolution_shift(shift: float, base_size: int, height: int, width: int) -> float:
    """The shift at a latent of ``height`` x ``width``: ``shift`` times sqrt(m / n), m = height * width
    latent pixels and n = base_size^2 (SD3 §5.3.2: the shift grows with the square root of the pixel
    count); ``base_size`` 0 = ``shift`` at every size."""
    if base_size < 0:
        raise ConfigError(f"flow_shift_base_size: must be >= 0, got {base_size}")
    if base_size == 0:
        return float(shift)
    return float(shift) * math.sqrt(height * width) / base_size


def sample_flow_sigmas(
    batch: int,
    generator: torch.Generator,
    sampling: Literal["logit_normal", "uniform"] = "logit_normal",
    mean: float = 0.0,
    std: float = 1.0,
    shift: float = 1.0,
) -> torch.Tensor:
    """sigma per sample (float32, on the generator's device), then shifted by ``shift``:
    logit_normal: sigma = sigmoid(mean + std n), n ~ N(0, 1) (SD3 §3.1, the density
    pi_ln(t; m, s) = 1 / (s sqrt(2 pi)) 1 / (t (1 - t)) exp(-(logit(t) - m)^2 / (2 s^2)));
    uniform: sigma ~ U[0, 1) (Liu et al. 2022, eq. 1, t ~ U[0, 1])."""
    if sampling == "logit_normal":
        if std <= 0:
            raise ConfigError(f"flow_logit_std: must be positive, got {std}")
        n = torch.randn((batch,), generator=generator, device=generator.device, dtype=torch.float32)
        sigma = torch.sigmoid(mean + std * n)
    elif sampling == "uniform":
        sigma = torch.rand((batch,), generator=generator, device=generator.device, dtype=torch.float32)
    else:
        raise ConfigError(f"flow_time_sampling: unknown {sampling!r}; choose one of {', '.join(TIME_SAMPLINGS)}")
    return shift_sigma(sigma, shift) if shift != 1.0 else sigma
