"""The noise schedule: one config, turned into diffusers schedulers for training and sampling.

Training (``DDPMScheduler``), every sampler (DDIM, DPM-Solver++, Euler, DDPM) and an exported
diffusers pipeline's ``scheduler_config.json`` are all made from the one dict that
:func:`scheduler_config` returns, so they cannot disagree about betas, prediction type or
timestep spacing. The defaults are stabilityai/stable-diffusion-2-base's scheduler: 1000 steps,
``scaled_linear`` betas from 0.00085 to 0.012, epsilon prediction, ``leading`` spacing with
``steps_offset`` 1, no sample clipping.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from diffusers import DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from latentforge.errors import ConfigError

__all__ = [
    "NoiseScheduleConfig",
    "SAMPLERS",
    "scheduler_config",
    "make_train_scheduler",
    "make_sampler",
    "alphas_cumprod",
    "snr",
]


@dataclass
class NoiseScheduleConfig:
    """The forward (noising) process and the quantity the U-Net predicts."""

    num_train_timesteps: int = field(default=1000, metadata={"help": "number of discrete noise levels t = 0 .. T-1"})
    beta_schedule: Literal["scaled_linear", "linear", "squaredcos_cap_v2"] = field(
        default="scaled_linear",
        metadata={"help": "scaled_linear: SD 1.x/2.x (linear in sqrt(beta)); squaredcos_cap_v2: cosine (ignores beta_start/end)"},
    )
    beta_start: float = field(default=0.00085, metadata={"help": "beta at t = 0"})
    beta_end: float = field(default=0.012, metadata={"help": "beta at t = T-1"})
    prediction_type: Literal["epsilon", "v_prediction"] = field(
        default="epsilon", metadata={"help": "what the U-Net predicts: the noise (epsilon) or the velocity v"}
    )
    rescale_zero_terminal_snr: bool = field(
        default=False,
        metadata={
            "help": "rescale betas so that the last step is pure noise (Lin et al. 2023, arXiv:2305.08891, "
            "Algorithm 1); needs v_prediction and trailing or linspace spacing"
        },
    )
    timestep_spacing: Literal["leading", "trailing", "linspace"] = field(
        default="leading",
        metadata={"help": "how samplers pick their timesteps; trailing and linspace start at t = T-1, leading (SD's) does not"},
    )
    steps_offset: int = field(
        default=1, metadata={"help": "added to every sampling timestep with leading spacing (SD uses 1)"}
    )

    def validate(self) -> None:
        if self.num_train_timesteps < 2:
            raise ConfigError(f"num_train_timesteps: must be at least 2, got {self.num_train_timesteps}")
        if self.beta_schedule != "squaredcos_cap_v2" and not 0.0 < self.beta_start < self.beta_end < 1.0:
            raise ConfigError(
                f"beta_start: need 0 < beta_start < beta_end < 1, got beta_start={self.beta_start}, beta_end={self.beta_end}"
            )
        if self.steps_offset < 0:
            raise ConfigError(f"steps_offset: must be >= 0, got {self.steps_offset}")
        if self.rescale_zero_terminal_snr:
            # At SNR 0 the input holds no signal, so an epsilon target is trivially the input and
            # x0 cannot be recovered from it (Lin et al. 2023, fix 2: train with v prediction).
            if self.prediction_type != "v_prediction":
                raise ConfigError(
                    "prediction_type: rescale_zero_terminal_snr needs v_prediction (epsilon is degenerate at SNR 0)"
                )
            # Leading spacing never samples t = T-1, the one step trained on pure noise (Lin et al. 2023, fix 3).
            if self.timestep_spacing == "leading":
                raise ConfigError(
                    "timestep_spacing: rescale_zero_terminal_snr needs trailing (or linspace) so that sampling starts at t = T-1"
                )


# Samplers by name, with the arguments they add to the shared config.
SAMPLERS: dict[str, tuple[type[SchedulerMixin], dict[str, Any]]] = {
    "ddim": (DDIMScheduler, {}),
    "dpm++": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++", "solver_order": 2}),
    "euler": (EulerDiscreteScheduler, {}),
    "ddpm": (DDPMScheduler, {}),
}


def scheduler_config(cfg: NoiseScheduleConfig) -> dict[str, Any]:
    """The diffusers scheduler config shared by training, every sampler and exported pipelines."""
    cfg.validate()
    return {
        "num_train_timesteps": cfg.num_train_timesteps,
        "beta_schedule": cfg.beta_schedule,
        "beta_start": cfg.beta_start,
        "beta_end": cfg.beta_end,
        "prediction_type": cfg.prediction_type,
        "rescale_betas_zero_snr": cfg.rescale_zero_terminal_snr,
        "timestep_spacing": cfg.timestep_spacing,
        "steps_offset": cfg.steps_offset,
        # Latents are not bounded to [-1, 1]: never clip the predicted x0 (SD's configs agree).
        "clip_sample": False,
        # DDIM's final step: use alphas_cumprod[0], not 1 (SD's configs agree).
        "set_alpha_to_one": False,
    }


def make_train_scheduler(cfg: NoiseScheduleConfig) -> DDPMScheduler:
    """The training-time forward process (Ho et al. 2020), as a diffusers ``DDPMScheduler``."""
    return DDPMScheduler.from_config(scheduler_config(cfg))


def make_sampler(name: str, cfg: NoiseScheduleConfig) -> SchedulerMixin:
    """A fresh sampler (ddim, dpm++, euler or ddpm) for the same noise schedule (samplers are stateful:
    use one per sampling loop at a time)."""
    if name not in SAMPLERS:
        raise ConfigError(f"sampler: unknown {name!r}; choose one of {', '.join(SAMPLERS)}")
    cls, extra = SAMPLERS[name]
    return cls.from_config(scheduler_config(cfg), **extra)


def alphas_cumprod(cfg: NoiseScheduleConfig) -> torch.Tensor:
    """alpha-bar_t for t = 0 .. T-1 (float32, as diffusers' DDPMScheduler holds it; Ho et al. 2020, eq. 4)."""
    return make_train_scheduler(cfg).alphas_cumprod.clone()


def snr(alphas_cumprod: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """SNR(t) = alpha-bar_t / (1 - alpha-bar_t) (Kingma et al. 2021, VDM; diffusers' training_utils.compute_snr)."""
    a = alphas_cumprod.to(device=t.device, dtype=torch.float32)[t]
    return a / (1.0 - a)
