"""The noise schedule: one config, turned into diffusers schedulers for training and sampling.

Training (``DDPMScheduler``), every sampler (DDIM, DPM-Solver++, Euler, DDPM) and an exported
diffusers pipeline's ``scheduler_config.json`` are all made from the one dict that
:func:`scheduler_config` returns, so they cannot disagree about betas, prediction type or
timestep spacing. The defaults are stabilityai/stable-diffusion-2-base's scheduler: 1000 steps,
``scaled_linear`` betas from 0.00085 to 0.012, epsilon prediction, ``leading`` spacing with
``steps_offset`` 1, no sample clipping.

``prediction_type: flow_matching`` replaces the DDPM process by the rectified flow
(:mod:`latentforge.diffusion.flow_matching`): no betas, a velocity target, sigma drawn from a
logit-normal, the SD3 timestep shift. Its samplers are diffusers' flow-matching schedulers, made
from :func:`flow_scheduler_config` (see :data:`FLOW_SAMPLERS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from diffusers import (
    DDIMScheduler,
    DDPMScheduler,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
)
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from latentforge.diffusion.flow_matching import FLOW_MATCHING, resolution_shift
from latentforge.errors import ConfigError

__all__ = [
    "NoiseScheduleConfig",
    "SAMPLERS",
    "FLOW_SAMPLERS",
    "scheduler_config",
    "flow_scheduler_config",
    "sampling_shift",
    "check_scheduler_objective",
    "check_sampler_name",
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
    prediction_type: Literal["epsilon", "v_prediction", "flow_matching"] = field(
        default="epsilon",
        metadata={
            "help": "the objective: predict the noise (epsilon) or v (Salimans & Ho) of the DDPM process, or "
            "flow_matching: the rectified flow x = (1 - s) x0 + s eps with the velocity eps - x0 as target "
            "(SD3; the beta settings are then unused and must stay at their defaults)"
        },
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
    flow_time_sampling: Literal["logit_normal", "uniform"] = field(
        default="logit_normal",
        metadata={"help": "flow_matching: how training draws sigma: logit_normal (SD3 sec. 3.1) or uniform (Liu et al.)"},
    )
    flow_logit_mean: float = field(
        default=0.0, metadata={"help": "flow_matching: mean m of logit(sigma) ~ N(m, s^2) (SD3's best: 0)"}
    )
    flow_logit_std: float = field(
        default=1.0, metadata={"help": "flow_matching: std s of logit(sigma) ~ N(m, s^2) (SD3's best: 1)"}
    )
    flow_shift: float = field(
        default=1.0,
        metadata={
            "help": "flow_matching: timestep shift a, sigma' = a sigma / (1 + (a - 1) sigma), in training and "
            "sampling (SD3 sec. 5.3.2; 3.0 at 1024 px in SD3); 1 = none"
        },
    )
    flow_shift_base_size: int = field(
        default=0,
        metadata={
            "help": "flow_matching: latent side at which flow_shift holds; at another latent size h x w the shift "
            "is flow_shift * sqrt(h w) / base (SD3 sec. 5.3.2); 0 = flow_shift at every size"
        },
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
        if not self.flow_logit_std > 0:
            raise ConfigError(f"flow_logit_std: must be positive, got {self.flow_logit_std}")
        if not self.flow_shift > 0:
            raise ConfigError(f"flow_shift: must be positive (1 = no shift), got {self.flow_shift}")
        if self.flow_shift_base_size < 0:
            raise ConfigError(f"flow_shift_base_size: must be >= 0 (0 = off), got {self.flow_shift_base_size}")
        defaults = NoiseScheduleConfig.__dataclass_fields__
        if self.prediction_type == FLOW_MATCHING:
            if self.rescale_zero_terminal_snr:
                raise ConfigError(
                    "rescale_zero_terminal_snr: flow_matching ends at pure noise (sigma = 1, SNR 0) by construction; "
                    "there are no betas to rescale: remove it"
                )
            # A setting that flow matching never reads would be silently ignored: refuse it instead.
            for name in ("beta_schedule", "beta_start", "beta_end", "timestep_spacing", "steps_offset"):
                if getattr(self, name) != defaults[name].default:
                    raise ConfigError(
                        f"{name}: not used by flow_matching (its path is linear in sigma, its samplers space sigma "
                        "themselves): remove it"
                    )
        else:
            for name in ("flow_time_sampling", "flow_logit_mean", "flow_logit_std", "flow_shift", "flow_shift_base_size"):
                if getattr(self, name) != defaults[name].default:
                    raise ConfigError(f"{name}: only used with prediction_type flow_matching, not {self.prediction_type}")
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
    """The diffusers scheduler config shared by training, every sampler and exported pipelines
    (of the DDPM family: epsilon and v; flow matching has :func:`flow_scheduler_config`)."""
    cfg.validate()
    if cfg.prediction_type == FLOW_MATCHING:
        raise ConfigError("prediction_type: flow_matching has no DDPM schedule (betas); its samplers come from "
                          "flow_scheduler_config")
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


# Flow-matching samplers by name (the same names as SAMPLERS, so recipes and the CLI keep theirs):
# "euler" is SD3's sampler, FlowMatchEulerDiscreteScheduler. StableDiffusionPipeline cannot run it
# (diffusers 0.42: its prepare_latents multiplies by scheduler.init_noise_sigma, which that scheduler
# lacks), so an exported U-Net pipeline uses DPMSolverMultistepScheduler on flow sigmas: "ddim" is
# its first order, which on the path x = (1 - s) x0 + s eps is DDIM (Song et al. 2021, eq. 12) and
# equals the Euler step x + (s_next - s) v; "dpm++" its second order (Lu et al. 2022, DPM-Solver++(2M)).
FLOW_SAMPLERS: dict[str, tuple[type[SchedulerMixin], dict[str, Any]]] = {
    "euler": (FlowMatchEulerDiscreteScheduler, {}),
    "ddim": (DPMSolverMultistepScheduler, {"solver_order": 1}),
    "dpm++": (DPMSolverMultistepScheduler, {"solver_order": 2}),
}


def sampling_shift(cfg: NoiseScheduleConfig, latent_size: int | None) -> float:
    """The flow shift a at a square latent of side ``latent_size`` (see ``flow_shift_base_size``)."""
    if cfg.flow_shift_base_size and not latent_size:
        raise ConfigError("flow_shift_base_size: the shift depends on the latent size, which is not known here")
    return resolution_shift(cfg.flow_shift, cfg.flow_shift_base_size, latent_size or 0, latent_size or 0)


def check_sampler_name(name: str, cfg: NoiseScheduleConfig) -> None:
    """Refuse a sampler name that has no form for this objective (before any model is loaded)."""
    if cfg.prediction_type == FLOW_MATCHING and name not in FLOW_SAMPLERS:
        raise ConfigError(f"sampler: {name!r} has no flow-matching form here; a flow_matching model samples with "
                          f"{', '.join(FLOW_SAMPLERS)}")
    if name not in SAMPLERS:
        raise ConfigError(f"sampler: unknown {name!r}; choose one of {', '.join(SAMPLERS)}")


def flow_scheduler_config(cfg: NoiseScheduleConfig, sampler: str, latent_size: int | None = None) -> dict[str, Any]:
    """The diffusers config of flow-matching sampler ``sampler`` (a key of FLOW_SAMPLERS) for latents of
    side ``latent_size``: the same shift as training at that size, sigma * num_train_timesteps as the
    model's timestep."""
    cfg.validate()
    if cfg.prediction_type != FLOW_MATCHING:
        raise ConfigError(f"prediction_type: {cfg.prediction_type} is not flow_matching; use scheduler_config")
    check_sampler_name(sampler, cfg)
    shift = sampling_shift(cfg, latent_size)
    if FLOW_SAMPLERS[sampler][0] is FlowMatchEulerDiscreteScheduler:
        return {"num_train_timesteps": cfg.num_train_timesteps, "shift": shift}
    return {
        "num_train_timesteps": cfg.num_train_timesteps,
        "use_flow_sigmas": True,
        "prediction_type": "flow_prediction",
        "flow_shift": shift,
        "algorithm_type": "dpmsolver++",
        "final_sigmas_type": "zero",  # the last step lands on sigma = 0, the data
        # Unused on flow sigmas; StableDiffusionPipeline rewrites any other value to 1, with a warning.
        "steps_offset": 1,
        **FLOW_SAMPLERS[sampler][1],
    }


def check_scheduler_objective(scheduler: SchedulerMixin, cfg: NoiseScheduleConfig) -> None:
    """Refuse a sampler that would integrate another objective than the model's (one line naming the field)."""
    config = scheduler.config
    is_flow = isinstance(scheduler, FlowMatchEulerDiscreteScheduler) or (
        bool(config.get("use_flow_sigmas")) and config.get("prediction_type") == "flow_prediction")
    name = type(scheduler).__name__
    if cfg.prediction_type == FLOW_MATCHING and not is_flow:
        raise ConfigError(f"train.noise.prediction_type: the model is flow_matching but {name} is a DDPM-family "
                          "scheduler (epsilon/v): sample or export it with a flow-matching scheduler")
    if cfg.prediction_type != FLOW_MATCHING and is_flow:
        raise ConfigError(f"train.noise.prediction_type: the model is {cfg.prediction_type} but {name} is a "
                          "flow-matching scheduler: sample or export it with ddim, dpm++, euler or ddpm")
    if not is_flow and config.get("prediction_type") != cfg.prediction_type:
        raise ConfigError(f"train.noise.prediction_type: the model predicts {cfg.prediction_type}, {name} expects "
                          f"{config.get('prediction_type')}")


def make_train_scheduler(cfg: NoiseScheduleConfig) -> DDPMScheduler:
    """The training-time forward process (Ho et al. 2020), as a diffusers ``DDPMScheduler``."""
    return DDPMScheduler.from_config(scheduler_config(cfg))


def make_sampler(name: str, cfg: NoiseScheduleConfig, latent_size: int | None = None) -> SchedulerMixin:
    """A fresh sampler (ddim, dpm++, euler or ddpm) for the same noise schedule (samplers are stateful:
    use one per sampling loop at a time). A flow_matching model gets the flow form of ``name``
    (:data:`FLOW_SAMPLERS`), shifted for latents of side ``latent_size``."""
    if cfg.prediction_type == FLOW_MATCHING:
        config = flow_scheduler_config(cfg, name, latent_size)  # refuses a name without a flow form
        return FLOW_SAMPLERS[name][0].from_config(config)
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
