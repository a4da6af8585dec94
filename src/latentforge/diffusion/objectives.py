"""Training objectives: noising, targets (epsilon or v), loss weights and the loss itself.

Pure functions of tensors. ``alphas_cumprod`` is :func:`latentforge.diffusion.schedule.alphas_cumprod`
(float32, indexed by integer timestep). Randomness always comes from an explicit
``torch.Generator`` and never from the global RNG, so that a trainer can checkpoint one generator
per rank and resume bit-exactly. As in diffusers, the schedule coefficients are taken in the
dtype of the latents they multiply: pass float32 latents (bf16 would round alpha-bar near 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.utils.torch_utils import randn_tensor

from latentforge.errors import ConfigError

__all__ = [
    "PREDICTION_TYPES",
    "add_noise",
    "training_target",
    "pred_x0",
    "offset_noise",
    "min_snr_weight",
    "sample_timesteps",
    "importance_density",
    "importance_weight",
    "per_sample_mse",
    "diffusion_loss",
]

PREDICTION_TYPES = ("epsilon", "v_prediction")


def _check_prediction_type(prediction_type: str) -> None:
    if prediction_type not in PREDICTION_TYPES:
        raise ConfigError(f"prediction_type: unknown {prediction_type!r}; choose one of {', '.join(PREDICTION_TYPES)}")


def _coefficients(alphas_cumprod: torch.Tensor, t: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sqrt(alpha-bar_t) and sqrt(1 - alpha-bar_t), shaped (batch, 1, ..., 1) to broadcast against ``like``."""
    a = alphas_cumprod.to(device=like.device, dtype=like.dtype)[t.to(like.device)]
    shape = (-1,) + (1,) * (like.ndim - 1)
    return (a**0.5).reshape(shape), ((1 - a) ** 0.5).reshape(shape)


def add_noise(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """x_t = sqrt(a_t) x0 + sqrt(1 - a_t) eps (Ho et al. 2020, eq. 4; diffusers' DDPMScheduler.add_noise)."""
    signal, sigma = _coefficients(alphas_cumprod, t, x0)
    return signal * x0 + sigma * noise


def training_target(
    x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, alphas_cumprod: torch.Tensor, prediction_type: str
) -> torch.Tensor:
    """eps, or v = sqrt(a_t) eps - sqrt(1 - a_t) x0 (Salimans & Ho 2022, arXiv:2202.00512; diffusers' get_velocity)."""
    _check_prediction_type(prediction_type)
    if prediction_type == "epsilon":
        return noise
    signal, sigma = _coefficients(alphas_cumprod, t, x0)
    return signal * noise - sigma * x0


def pred_x0(
    model_pred: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, alphas_cumprod: torch.Tensor, prediction_type: str
) -> torch.Tensor:
    """x0 from an eps (Song et al. 2021, DDIM eq. 12) or v prediction (x0 = sqrt(a_t) x_t - sqrt(1 - a_t) v, Salimans & Ho 2022)."""
    _check_prediction_type(prediction_type)
    signal, sigma = _coefficients(alphas_cumprod, t, x_t)
    if prediction_type == "epsilon":
        return (x_t - sigma * model_pred) / signal
    return signal * x_t - sigma * model_pred


def offset_noise(noise: torch.Tensor, strength: float, generator: torch.Generator) -> torch.Tensor:
    """noise + strength * N(0, 1) per (sample, channel), constant over space (Guttenberg 2023, "Diffusion with Offset Noise")."""
    offset_shape = tuple(noise.shape[:2]) + (1,) * (noise.ndim - 2)
    # Draws batch*channels normals from ``generator`` (on its own device, then moved).
    offset = randn_tensor(offset_shape, generator=generator, device=noise.device, dtype=noise.dtype)
    return noise + strength * offset


def min_snr_weight(snr: torch.Tensor, gamma: float, prediction_type: str, floor: float = 0.0) -> torch.Tensor:
    """Min-SNR-gamma loss weight: min(SNR, gamma)/SNR for eps, min(SNR, gamma)/(SNR+1) for v (Hang et al. 2023, arXiv:2303.09556).

    ``floor`` > 0 raises the weights of the noisy timesteps (SNR < gamma) to at least ``floor``:
    for v-prediction the weight falls to SNR/(SNR+1), about 0, at the high-noise timesteps, where
    the layout of the image is decided, and a floor keeps a share of the loss there; the quiet
    side (SNR >= gamma) keeps the paper's gamma/(SNR+1). Epsilon weights are 1 at SNR < gamma, so
    a floor changes nothing there. 0 = the paper's weighting."""
    _check_prediction_type(prediction_type)
    if gamma <= 0:
        raise ConfigError(f"snr_gamma: must be positive (5 is the paper's default), got {gamma}")
    if prediction_type == "epsilon":
        # Written as min(gamma/SNR, 1), which is the same for SNR > 0 and gives the limit 1 at SNR = 0
        # (the last step of a zero-terminal-SNR schedule) instead of 0/0.
        weight = torch.clamp(gamma / snr, max=1.0)
    else:
        weight = torch.clamp(snr, max=gamma) / (snr + 1.0)
    return torch.where(snr < gamma, torch.clamp(weight, min=floor), weight) if floor > 0 else weight


def sample_timesteps(
    batch: int, num_train_timesteps: int, generator: torch.Generator, device: torch.device | str | None = None
) -> torch.Tensor:
    """t ~ Uniform{0, ..., T-1}, int64, one per sample (Ho et al. 2020, Algorithm 1)."""
    t = torch.randint(0, num_train_timesteps, (batch,), generator=generator, device=generator.device)
    return t.to(device) if device is not None else t


def importance_density(weights: torch.Tensor, power: float) -> torch.Tensor:
    """The density to draw training timesteps from: p(t) proportional to ``weights[t] ** power``.

    ``weights``: the loss weight of every timestep (e.g. :func:`min_snr_weight` of all T of them).
    Drawing t from p and weighting its loss by :func:`importance_weight` keeps the expected loss
    (and gradient) of uniform timesteps weighted by ``weights``, with less variance when the
    weights are uneven (importance sampling; SD3, Esser et al. 2024, sec. 3.1, read a weighting as
    a density). power 0: uniform; 1: every drawn sample weighs the same (the mean weight)."""
    if not 0 <= power <= 1:
        raise ConfigError(f"timestep_importance: must be in [0, 1], got {power}; 0 = uniform timesteps")
    if weights.ndim != 1 or not bool((weights >= 0).all()) or not bool(weights.sum() > 0):
        raise ConfigError("importance_density: needs one weight >= 0 per timestep, not all 0")
    p = weights.double() ** power
    return p / p.sum()


def importance_weight(weights: torch.Tensor, density: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The loss weight of timesteps ``t`` drawn from ``density``: weights[t] / (T density[t]), so that
    E_{t ~ density}[weight * loss_t] = mean over all T timesteps of weights[t] * loss_t."""
    num = weights.numel()
    return (weights.double()[t] / (num * density[t])).float()


def per_sample_mse(model_pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """MSE per sample, in float32 (Ho et al. 2020, eq. 14, L_simple, before the batch mean)."""
    return F.mse_loss(model_pred.float(), target.float(), reduction="none").mean(dim=tuple(range(1, model_pred.ndim)))


def diffusion_loss(model_pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over the batch of (weighted) per-sample MSE, in float32 (Ho et al. 2020, eq. 14, L_simple)."""
    per_sample = per_sample_mse(model_pred, target)
    if weights is not None:
        per_sample = per_sample * weights.to(per_sample.device, torch.float32)
    return per_sample.mean()
