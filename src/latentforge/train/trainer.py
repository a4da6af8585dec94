"""The training loop of the latent diffusion denoiser (U-Net or transformer): one readable loop over phases and steps.

The :class:`Trainer` is handed an already-built model and a loader factory; it knows nothing of
how processes were launched (one process, torchrun or Ray) beyond a :class:`World` with rank and
world size and an optional gradient all-reduce wrapper (the parallel wrapper's job, not the
model's). Everything that changes during training is checkpointed: model, EMA, optimizer, LR
schedule, data cursor, RNG states, step, phase index and the count of skipped steps.

Diffusion noise and timesteps are drawn per sample from a generator seeded by
(seed, global sample position) (:func:`sample_noise`), so they do not depend on the number of
ranks and need no state of their own: a resumed run, or a run on another number of ranks, draws
exactly the same noise for the same sample. This is also the per-rank randomness of data-parallel
training: ranks see different positions, hence different noise, without a per-rank generator
whose state would have to be checkpointed and could not be re-split when the rank count changes.

With patch masking (``train.masking``, the transformer only) a step keeps a random subset of each
sample's patch tokens, drawn from (seed, position) the same way (``train/masking.py``), and takes
the loss on those patches only.

Under FSDP2 (``parallel.strategy=fsdp``) the model's parameters are sharded DTensors: checkpoints
are then written by every rank through ``distributed/dcp.py`` (DCP shards plus consolidated
safetensors), and the same directory scheme and completion marker apply.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from latentforge import checkpoint as ckpt
from latentforge.data.loader import StreamConfig, TrainLoader
from latentforge.data.order import hash64, splitmix64
from latentforge.diffusion.flow_matching import (
    FLOW_MATCHING,
    flow_noisy,
    flow_target,
    flow_timestep,
    resolution_shift,
    sample_flow_sigmas,
)
from latentforge.diffusion.objectives import (
    add_noise, diffusion_loss, importance_density, importance_weight, min_snr_weight, training_target,
)
from latentforge.diffusion.schedule import NoiseScheduleConfig, alphas_cumprod, snr
from latentforge.distributed.env import World
from latentforge.distributed.parallelize import ParallelConfig
from latentforge.errors import ConfigError, Problem, Problems, UserError
from latentforge.interrupt import InterruptConfig, StopOnSignal
from latentforge.models.denoiser import denoiser_of
from latentforge.models.dit import PRESETS, DiTConfig, dit_diffusers_config, gather_tokens, patchify
from latentforge.models.unet import UNetConfig
from latentforge.train.ema import EMA, EMAConfig, evaluation_weights
from latentforge.train.finetune import LoRAConfig, load_trainable_state_dict, trainable_state_dict
from latentforge.train.masking import MaskingConfig, num_kept_tokens, sample_keep
from latentforge.train.loggers import MetricLogger, close_loggers, open_loggers
from latentforge.train.optim import OptimConfig, build_lr_scheduler, build_optimizer, clip_grad_norm, hidden_matrices
from latentforge.train.rng import rng_state, set_rng_state
from latentforge.train.validation import VAL_LOG, ValidationSet, ValLossConfig, validation_times

log = logging.getLogger(__name__)

EVAL_LOG = "eval.jsonl"  # one line per evaluation during training (latentforge report reads it)


@dataclass
class PhaseConfig:
    """One phase of a multi-phase run (e.g. 256 px, then 512 px)."""

    name: str = field(default="", metadata={"help": "a label for logs"})
    datasets: list[StreamConfig] = field(default_factory=list, metadata={
        "help": "latent datasets of this phase, with mixing weights"})
    resolution: int = field(default=0, metadata={"help": "image side the datasets must have been encoded at; 0 = any"})
    steps: int = field(default=0, metadata={"help": "optimizer steps in this phase (or set samples)"})
    samples: int = field(default=0, metadata={"help": "training samples in this phase; steps = ceil(samples / global batch)"})
    micro_batch_size: int = field(default=0, metadata={"help": "samples per rank per forward pass; 0 = train.micro_batch_size"})
    global_batch_size: int = field(default=0, metadata={"help": "samples per optimizer step; 0 = train.global_batch_size"})
    lr: float = field(default=0.0, metadata={"help": "peak learning rate of this phase; 0 = optim.lr"})
    masking_ratio: float | None = field(default=None, metadata={
        "help": "fraction of the latent patches dropped in this phase's training samples (train.model: dit); "
                "null = train.masking.ratio, 0 = unmasked (e.g. a final unmasked phase, as MicroDiT ends)"})
    min_snr_floor: float | None = field(default=None, metadata={
        "help": "the least min-SNR loss weight of the noisy timesteps in this phase; null = train.min_snr_floor "
                "(e.g. a first phase at 0, where the shapes are learned, then a floor for the layout)"})

    def validate(self) -> None:
        problems = Problems()
        for name, zero in (("steps", "0 = set samples"), ("samples", "0 = set steps"),
                           ("micro_batch_size", "0 = train.micro_batch_size"),
                           ("global_batch_size", "0 = train.global_batch_size")):
            if getattr(self, name) < 0:
                problems.add(f"{name}: must be >= 0, got {getattr(self, name)}; {zero}")
        if self.steps >= 0 and self.samples >= 0 and (self.steps > 0) == (self.samples > 0):
            problems.add("steps: set exactly one of steps and samples (> 0)")
        if self.resolution < 0:
            problems.add(f"resolution: must be >= 0, got {self.resolution}; 0 = the resolution of the latents")
        if self.lr < 0:
            problems.add(f"lr: must be >= 0, got {self.lr}; 0 = train.optim.lr")
        if self.masking_ratio is not None and not 0 <= self.masking_ratio < 1:
            problems.add(f"masking_ratio: must be >= 0 and < 1, got {self.masking_ratio}; the fraction of patches "
                         "dropped in this phase (0 = unmasked, null = train.masking.ratio)")
        if self.min_snr_floor is not None and not 0 <= self.min_snr_floor <= 1:
            problems.add(f"min_snr_floor: must be in [0, 1], got {self.min_snr_floor}; null = train.min_snr_floor")
        for i, ds in enumerate(self.datasets):
            problems.nested(f"datasets[{i}]", ds)
        problems.raise_if_any()


@dataclass
class CheckpointConfig:
    every_steps: int = field(default=500, metadata={"help": "steps between checkpoints (and one at the end)"})
    keep_last: int = field(default=3, metadata={"help": "complete checkpoints kept (older ones are deleted)"})
    keep_every: int = field(default=0, metadata={"help": "also keep every checkpoint whose step is a multiple of this"})

    def validate(self) -> None:
        problems = Problems()
        if self.every_steps < 1:
            problems.add(f"every_steps: must be >= 1, got {self.every_steps}; a checkpoint every N steps "
                         "(and at the end)")
        if self.keep_last < 1:
            problems.add(f"keep_last: must be >= 1, got {self.keep_last}; the newest complete checkpoints kept")
        if self.keep_every < 0:
            problems.add(f"keep_every: must be >= 0, got {self.keep_every}; 0 = keep no extra checkpoints")
        problems.raise_if_any()


@dataclass
class SampleConfig:
    """Periodic sample grids with fixed prompts and seeds."""

    every_steps: int = field(default=0, metadata={"help": "steps between sample grids; 0 = only at the end"})
    prompts: list[str] = field(default_factory=list, metadata={"help": "prompts of the grid (empty = no grids)"})
    seed: int = field(default=0, metadata={"help": "seed of the grid's initial noise"})
    num_steps: int = field(default=20, metadata={"help": "sampler steps"})
    sampler: Literal["ddim", "dpm++", "euler", "ddpm"] = field(default="ddim", metadata={"help": "sampler"})
    guidance_scale: float = field(default=4.0, metadata={"help": "classifier-free guidance scale (1 = off)"})


@dataclass
class TrainEvalConfig:
    """Evaluation during training: the recipe's ``eval`` section (prompts, reference images, metric
    models, guidance scales) run on the checkpoint of every ``every_steps``-th step and of the last
    step, logged against step, training images, GPU-hours and dollars (``RUN/eval.jsonl``)."""

    every_steps: int = field(default=0, metadata={"help": "steps between evaluations; 0 = off"})
    num_images: int = field(default=0, metadata={
        "help": "images per guidance scale of each evaluation (a fixed prompt subset); 0 = eval.num_images"})
    price_per_gpu_hour: float = field(default=2.0, metadata={
        "help": "dollars per GPU-hour (per device-hour on CPU), for the logged cost of training and evaluation"})

    def validate(self) -> None:
        problems = Problems()
        if self.every_steps < 0:
            problems.add(f"every_steps: must be >= 0, got {self.every_steps}; 0 = no evaluation during training")
        if self.num_images < 0:
            problems.add(f"num_images: must be >= 0, got {self.num_images}; 0 = eval.num_images")
        if not self.price_per_gpu_hour >= 0:
            problems.add(f"price_per_gpu_hour: must be >= 0, got {self.price_per_gpu_hour}; dollars per GPU-hour")
        problems.raise_if_any()


@dataclass
class TrainConfig:
    """``latentforge train``: the denoiser, the objective, the optimizer and the phases."""

    seed: int = field(default=0, metadata={"help": "seed of the initialisation and of the diffusion noise"})
    model: Literal["unet", "dit"] = field(default="unet", metadata={
        "help": "the denoiser: unet (train.unet, SD's U-Net) or dit (train.dit, PixArt-alpha's diffusion transformer)"})
    unet: UNetConfig = field(default_factory=UNetConfig, metadata={"help": "the U-Net (train.model: unet)"})
    dit: DiTConfig = field(default_factory=DiTConfig, metadata={
        "help": "the diffusion transformer (train.model: dit)"})
    noise: NoiseScheduleConfig = field(default_factory=NoiseScheduleConfig, metadata={"help": "the noise schedule"})
    masking: MaskingConfig = field(default_factory=MaskingConfig, metadata={
        "help": "patch masking of the transformer's training steps (MaskDiT, MicroDiT); off by default"})
    min_snr_gamma: float = field(default=0.0, metadata={"help": "min-SNR-gamma loss weighting; 0 = off (5 is usual)"})
    min_snr_floor: float = field(default=0.0, metadata={
        "help": "the least min-SNR loss weight of the noisy timesteps (SNR < min_snr_gamma): v-prediction "
                "weighs the noisiest ones, which place the shapes, about 0; 0 = the paper's weighting"})
    timestep_importance: float = field(default=0.0, metadata={
        "help": "draw training timesteps with density proportional to min-SNR weight ** this, each loss divided "
                "by its density (the same expected loss, weights less uneven); 0 = uniform timesteps, 1 = every "
                "sample weighs the same. The demo lost position words with 0.5 and 1 (docs/demo.md, run 27)"})
    offset_noise: float = field(default=0.0, metadata={"help": "offset-noise strength; 0 = off (0.05-0.1 is usual)"})
    text_noise: float = field(default=0.0, metadata={
        "help": "Gaussian noise added to each training caption's text states, its std this fraction of the "
                "states' RMS (dropped captions stay exact; sampling never adds it); 0 = off. The demo lost its "
                "new-wording prompts with 0.25 (docs/demo.md, run 31)"})
    sample_posterior: bool = field(default=True, metadata={
        "help": "latents = mean + std * N(0, 1) of the VAE posterior (SD); false = the mean"})
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"help": "AdamW and the LR schedule"})
    ema: EMAConfig | None = field(default_factory=EMAConfig, metadata={"help": "EMA of the U-Net; null = off"})
    phases: list[PhaseConfig] = field(default_factory=list, metadata={"help": "the phases, run in order"})
    micro_batch_size: int | Literal["auto"] = field(default=8, metadata={
        "help": "samples per rank per forward pass; auto = the largest that fits in the device's memory (memory "
                "planner), the global batch kept by accumulation"})
    global_batch_size: int = field(default=0, metadata={
        "help": "samples per optimizer step = micro batch x accumulation x world size; 0 = micro x world"})
    precision: Literal["auto", "fp32", "bf16"] = field(default="auto", metadata={
        "help": "auto = bf16 autocast on CUDA, fp32 on CPU"})
    device: Literal["auto", "cpu", "cuda"] = field(default="auto", metadata={"help": "auto = cuda if available"})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"help": "checkpointing"})
    sampling: SampleConfig = field(default_factory=SampleConfig, metadata={"help": "periodic sample grids"})
    eval: TrainEvalConfig = field(default_factory=TrainEvalConfig, metadata={
        "help": "evaluation during training (FID/KID/FD/CLIP score of the recipe's eval section)"})
    val: ValLossConfig = field(default_factory=ValLossConfig, metadata={
        "help": "the validation loss during training: held-out latents at fixed times and noise (train/validation.py)"})
    log_every: int = field(default=20, metadata={"help": "steps between log lines (each costs a host sync)"})
    nonfinite: Literal["stop", "skip"] = field(default="stop", metadata={
        "help": "on a NaN/inf loss or gradient norm: stop (the last checkpoint stays intact) or skip the step "
                "(no update) and count it"})
    max_skipped_steps: int = field(default=10, metadata={
        "help": "with nonfinite=skip: the most steps skipped in a run; one more stops it"})
    max_seconds: float = field(default=0.0, metadata={
        "help": "stop (with a checkpoint) after this much training time; 0 = off. A rerun continues."})
    interrupt: InterruptConfig = field(default_factory=InterruptConfig, metadata={
        "help": "on SIGINT / SIGTERM / a scheduler's warning signal: finish the step, checkpoint, exit 75"})
    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = field(default_factory=lambda: ["tensorboard"],
                                                                      metadata={"help": "metric loggers"})
    init_from: str = field(default="", metadata={
        "help": "fine-tune: a local diffusers pipeline directory (Stable Diffusion, or a PixArtAlphaPipeline with "
                "train.model: dit); the denoiser and the noise schedule come from it (train.unet / train.dit are "
                "unused), the data must be encoded with its VAE and text encoder"})
    lora: LoRAConfig | None = field(default=None, metadata={
        "help": "with init_from: train LoRA adapters on a frozen denoiser instead of all its weights; null = full"})
    frozen_dtype: Literal["float32", "bfloat16"] = field(default="float32", metadata={
        "help": "dtype of the frozen base weights of a LoRA run (bfloat16 halves them; needs precision bf16)"})
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={
        "help": "data parallelism (DDP / FSDP2), activation checkpointing, compilation"})

    def validate(self) -> None:
        problems = Problems()
        if self.micro_batch_size == "auto":
            if not self.global_batch_size and not all(p.global_batch_size for p in self.phases):
                problems.add("micro_batch_size: auto keeps the global batch by accumulation: set global_batch_size")
        elif self.micro_batch_size < 1:
            problems.add(f"micro_batch_size: must be >= 1, got {self.micro_batch_size}; samples per rank per "
                         "forward pass, or auto")
        if self.global_batch_size < 0:
            problems.add(f"global_batch_size: must be >= 0, got {self.global_batch_size}; 0 = micro batch x world size")
        if self.log_every < 1:
            problems.add(f"log_every: must be >= 1, got {self.log_every}; steps between log lines, e.g. 20")
        if self.min_snr_gamma < 0:
            problems.add(f"min_snr_gamma: must be >= 0, got {self.min_snr_gamma}; 0 = off, 5 is usual")
        if not 0 <= self.min_snr_floor <= 1:
            problems.add(f"min_snr_floor: must be in [0, 1], got {self.min_snr_floor}; 0 = plain min-SNR")
        elif self.min_snr_floor and not self.min_snr_gamma:
            problems.add(f"min_snr_floor: {self.min_snr_floor} raises min-SNR weights, but min_snr_gamma is 0 "
                         "(off): set min_snr_gamma (e.g. 5) or min_snr_floor: 0")
        for i, phase in enumerate(self.phases):
            if phase.min_snr_floor and not self.min_snr_gamma:
                problems.add(f"phases[{i}].min_snr_floor: {phase.min_snr_floor} raises min-SNR weights, but "
                             "min_snr_gamma is 0 (off): set min_snr_gamma (e.g. 5) or remove the phase's floor")
        if not 0 <= self.timestep_importance <= 1:
            problems.add(f"timestep_importance: must be in [0, 1], got {self.timestep_importance}; 0 = uniform "
                         "timesteps, 1 = drawn in proportion to their min-SNR weight")
        elif self.timestep_importance and not self.min_snr_gamma and self.noise.prediction_type != FLOW_MATCHING:
            problems.add(f"timestep_importance: {self.timestep_importance} draws timesteps by their min-SNR weight, "
                         "but min_snr_gamma is 0 (off): set min_snr_gamma (e.g. 5) or timestep_importance: 0")
        if self.offset_noise < 0:
            problems.add(f"offset_noise: must be >= 0, got {self.offset_noise}; 0 = off, 0.05-0.1 is usual")
        if not 0 <= self.text_noise <= 1:
            problems.add(f"text_noise: must be in [0, 1], got {self.text_noise}; a fraction of the text states' RMS, "
                         "0 = off")
        if self.max_skipped_steps < 0:
            problems.add(f"max_skipped_steps: must be >= 0, got {self.max_skipped_steps}; the most steps skipped "
                         "with nonfinite=skip before the run stops")
        if not self.max_seconds >= 0:
            problems.add(f"max_seconds: must be >= 0, got {self.max_seconds}; 0 = no time limit")
        if self.noise.prediction_type == FLOW_MATCHING:
            # docs/decisions.md §8: what these mean under flow matching, and why they are refused.
            if self.min_snr_gamma:
                problems.add("min_snr_gamma: not used with flow_matching, whose loss weighting is the density sigma "
                             "is drawn from (noise.flow_time_sampling, SD3 sec. 3.1): set 0")
            if self.timestep_importance:
                problems.add("timestep_importance: not used with flow_matching, which draws sigma from its own "
                             "density (noise.flow_time_sampling): set 0")
            if self.offset_noise:
                problems.add("offset_noise: flow_matching already ends at pure noise (SNR 0 at sigma = 1), the "
                             "flaw offset noise works around, and sampling starts from N(0, I), not from the "
                             "offset noise it would train on: set 0")
            if self.sampling.prompts and self.sampling.sampler == "ddpm":
                problems.add("sampling.sampler: ddpm has no flow-matching form here; use ddim, dpm++ or euler")
        # The nested sections are validated by from_dict already (a check reached twice is reported once);
        # here again for a TrainConfig built in code.
        for name in ("unet", "dit", "noise", "masking", "optim", "checkpoint", "eval", "val", "interrupt", "parallel"):
            problems.nested(name, getattr(self, name))
        for name in ("ema", "lora"):
            if getattr(self, name) is not None:
                problems.nested(name, getattr(self, name))
        for i, p in enumerate(self.phases):
            problems.nested(f"phases[{i}]", p)
        if self.lora is not None:
            # init_from may come from `finetune --from DIR`: a recipe without it is valid, train() refuses the run
            problems.items.extend(lora_parallel_problems(self.parallel))
        elif self.parallel.strategy == "fsdp" and self.optim.name == "adamw8bit":
            # bitsandbytes' update kernel takes plain tensors; on FSDP2's DTensor parameters (CPU-offloaded
            # or not) it fails with "got mixed torch.Tensor and DTensor" (bitsandbytes 0.50).
            problems.add("optim.name: adamw8bit does not run on FSDP2's sharded (DTensor) parameters: use adamw "
                         "(with parallel.cpu_offload its fp32 state lives in host memory) or strategy ddp/none")
        elif self.parallel.strategy == "fsdp" and self.optim.name == "muon":
            # Newton-Schulz needs each whole matrix; FSDP2 holds a shard of it on every rank.
            problems.add("optim.name: muon orthogonalises whole matrices and FSDP2 shards them: use adamw or "
                         "strategy ddp/none")
        if self.frozen_dtype != "float32":
            if self.lora is None:
                problems.add(f"frozen_dtype: {self.frozen_dtype} is for the frozen base weights of a LoRA run and "
                             "train.lora is not set; remove frozen_dtype (a full fine-tune trains every weight in fp32)")
            elif self.precision != "bf16":
                problems.add(f"frozen_dtype: bfloat16 base weights need precision bf16 (autocast), got precision "
                             f"{self.precision}; set train.precision: bf16")
        # Patch masking needs the transformer's patch tokens, and blocks left to mask after the mixer.
        if self.model != "dit":
            if self.masking.ratio > 0:
                problems.add(f"masking.ratio: {self.masking.ratio} masks the transformer's patch tokens, and "
                             f"train.model is {self.model}: set train.model: dit, or 0")
            for i, p in enumerate(self.phases):
                if p.masking_ratio:
                    problems.add(f"phases[{i}].masking_ratio: {p.masking_ratio} masks the transformer's patch "
                                 f"tokens, and train.model is {self.model}: set train.model: dit, or remove it")
        elif self.masking.mixer_blocks > 0 and self.dit.preset in PRESETS:
            num_layers = dit_diffusers_config(self.dit, validate=False)["num_layers"]
            if self.masking.mixer_blocks >= num_layers:
                problems.add(f"masking.mixer_blocks: {self.masking.mixer_blocks} of the transformer's {num_layers} "
                             "blocks leaves none to run on the kept patches only: use fewer")
        problems.raise_if_any()


    def min_snr_floor_of(self, phase: int) -> float:
        """The min-SNR floor of phase ``phase``'s loss: the phase's min_snr_floor, else min_snr_floor."""
        own = self.phases[phase].min_snr_floor if phase < len(self.phases) else None
        return self.min_snr_floor if own is None else own

    def masking_ratio_of(self, phase: int) -> float:
        """The fraction of patches the training steps of phase ``phase`` drop: the phase's
        masking_ratio, else masking.ratio."""
        own = self.phases[phase].masking_ratio if phase < len(self.phases) else None
        return self.masking.ratio if own is None else own


def lora_parallel_problems(parallel: ParallelConfig) -> list[Problem]:
    """What a LoRA run cannot use of ``parallel`` (field paths relative to ``train``): FSDP2 and
    the settings that only FSDP2 has. All of them at once, so that one edit of the recipe fixes
    them; settings that need FSDP2 without LoRA are reported by ``ParallelConfig`` itself."""
    problems = Problems()
    if parallel.strategy != "fsdp":
        return []
    problems.add("parallel.strategy: fsdp does not shard LoRA runs (their trained weights are small); use ddp on "
                 "several ranks or none on one (auto picks it)")
    # With strategy fsdp ParallelConfig accepts these; once it is changed they would be refused one by one.
    if parallel.mixed_precision != "fp32":
        problems.add(f"parallel.mixed_precision: {parallel.mixed_precision} is FSDP2's parameter dtype, which a LoRA "
                     "run does not use; remove it and set train.precision: bf16 (autocast; train.frozen_dtype: "
                     "bfloat16 also stores the frozen base in bf16)")
    if parallel.cpu_offload:
        problems.add("parallel.cpu_offload: is FSDP2's CPU offload, which a LoRA run does not use; remove it (a LoRA "
                     "run's gradients and optimizer state are the adapters' only; train.frozen_dtype: bfloat16 "
                     "halves the frozen base)")
    if parallel.reshard_after_forward:
        problems.add("parallel.reshard_after_forward: only applies to parallel.strategy=fsdp, which a LoRA run does "
                     "not use; remove it")
    return problems.items


def batch_plan(micro: int, global_: int, world_size: int, field_name: str = "train.global_batch_size") -> int:
    """Gradient-accumulation steps so that global = micro x accumulation x world size;
    ``field_name`` is the config field the global batch size came from."""
    if global_ == 0:
        return 1
    per_step = micro * world_size
    if global_ % per_step:
        raise ConfigError(
            f"{field_name}: {global_} is not divisible by world_size*micro_batch_size = "
            f"{world_size}*{micro} = {per_step}: change it or the micro batch size")
    return global_ // per_step


def phase_batches(cfg: TrainConfig, world_size: int) -> list[tuple[int, int, int]]:
    """(micro batch, accumulation steps, global batch) of every phase, all checked up front so that
    a bad batch size of a later phase fails before any training."""
    out = []
    for i, p in enumerate(cfg.phases):
        micro = p.micro_batch_size or cfg.micro_batch_size
        if p.global_batch_size:
            global_, field_name = p.global_batch_size, f"train.phases[{i}].global_batch_size"
        else:
            global_, field_name = cfg.global_batch_size or micro * world_size, "train.global_batch_size"
        out.append((micro, batch_plan(micro, global_, world_size, field_name), global_))
    return out


def phase_num_steps(cfg: TrainConfig, batches: list[tuple[int, int, int]]) -> list[int]:
    """Optimizer steps of every phase: ``steps``, or ``ceil(samples / global batch)``."""
    return [p.steps or math.ceil(p.samples / global_) for p, (_, _, global_) in zip(cfg.phases, batches)]


def sample_noise(seed: int, positions: list[int], latent_shape: tuple[int, ...], num_timesteps: int,
                 offset_noise: float, posterior: bool,
                 draw_time: Callable[[torch.Generator], torch.Tensor] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(timesteps, noise, posterior noise) for the samples at global ``positions``, each drawn from
    its own CPU generator seeded by hash(seed, position): independent of rank count and resume.
    ``draw_time(generator)``: the time of one sample (flow matching: its sigma, shape (1,)); by
    default an integer timestep uniform on 0 .. num_timesteps - 1."""
    keys = splitmix64(np.asarray(positions, dtype=np.uint64) ^ splitmix64(seed))
    ts, noises, posts = [], [], []
    for key in keys.tolist():
        g = torch.Generator().manual_seed(int(key) & 0x7FFF_FFFF_FFFF_FFFF)
        ts.append(draw_time(g) if draw_time else torch.randint(0, num_timesteps, (1,), generator=g))
        n = torch.randn(latent_shape, generator=g)
        if offset_noise:
            # Guttenberg 2023, "Diffusion with Offset Noise": a per-channel constant shift.
            n = n + offset_noise * torch.randn((latent_shape[0], 1, 1), generator=g)
        noises.append(n)
        posts.append(torch.randn(latent_shape, generator=g) if posterior else torch.zeros(()))
    post = torch.stack(posts) if posterior else None
    return torch.cat(ts), torch.stack(noises), post


# Mixed into the (seed, position) key (as train/masking.py's mask stream) so that the text-noise draws are a
# stream apart from the diffusion noise and the masks.
_TEXT_STREAM = 0x74657874  # "text"


def text_state_noise(seed: int, positions: list[int], shape: tuple[int, ...]) -> torch.Tensor:
    """N(0, 1) draws of ``shape`` (one caption's text states) for the samples at global
    ``positions``, each from its own CPU generator seeded by hash(seed, text stream, position):
    like :func:`sample_noise`, independent of rank count and resume."""
    keys = hash64(np.uint64(seed), np.asarray(positions, dtype=np.int64), np.uint64(_TEXT_STREAM))
    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(int(k) & 0x7FFF_FFFF_FFFF_FFFF))
                        for k in keys.tolist()])


def perturb_text(hidden: torch.Tensor, noise: torch.Tensor, strength: float, spare: torch.Tensor) -> torch.Tensor:
    """``hidden`` (B, L, D) plus ``noise`` scaled to ``strength`` times each caption's RMS over its
    states; rows where ``spare`` (B,) is true (the dropped, empty captions) are returned unchanged."""
    rms = hidden.float().pow(2).mean(dim=(1, 2), keepdim=True).sqrt()
    scale = torch.where(spare.view(-1, 1, 1), torch.zeros_like(rms), strength * rms)
    return hidden + (scale * noise).to(hidden.dtype)


def noised(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, schedule: NoiseScheduleConfig,
           alphas_cumprod: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_t, the training target, the time as the denoiser takes it) of the objective of
    ``schedule``: flow matching (``t`` its sigma in [0, 1], the model given sigma * T, diffusers'
    convention; ``alphas_cumprod`` unused) or eps / v (``t`` integer timesteps)."""
    if schedule.prediction_type == FLOW_MATCHING:
        return flow_noisy(x0, noise, t), flow_target(x0, noise), flow_timestep(t, schedule.num_train_timesteps)
    return (add_noise(x0, noise, t, alphas_cumprod),
            training_target(x0, noise, t, alphas_cumprod, schedule.prediction_type), t)


class Trainer:
    """Runs the phases of ``cfg`` on ``model``; see the module docstring."""

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module, make_loader: Callable[[int, int], TrainLoader],
                 run_dir: str | Path, latent_meta: dict[str, Any], world: World | None = None,
                 device: torch.device | None = None, train_model: torch.nn.Module | None = None,
                 sample_fn: Callable[["Trainer", int], None] | None = None, progress: bool = True,
                 flops_per_image: list[float] | None = None, peak_flops: float | None = None,
                 on_checkpoint: Callable[[Path, int], None] | None = None,
                 eval_fn: Callable[["Trainer", Path], dict[str, Any] | None] | None = None,
                 stop: StopOnSignal | None = None, val_set: ValidationSet | None = None):
        """``model``: the plain U-Net (its state dict is what is saved); ``train_model``: what the
        forward pass calls (the same module, or a compiled / DDP / FSDP wrapper of it);
        ``make_loader(phase_index, micro_batch_size)``: the rank's loader of a phase;
        ``latent_meta``: the latent dataset's meta (scale factor, text encoder);
        ``flops_per_image`` (per phase) and ``peak_flops`` (per device): for the logged MFU;
        ``on_checkpoint(path, step)``: called on every rank once a checkpoint is complete (a
        launcher reports it at once, so that a restart resumes from it);
        ``eval_fn(trainer, checkpoint)``: with ``cfg.eval.every_steps``, the evaluation of a
        checkpoint just written (every rank calls it; rank 0 gets the results, the others None);
        ``stop``: the stop request of an entered :class:`StopOnSignal` (None = signals are not
        handled here, only a stop requested by another rank is followed);
        ``val_set``: the held-out latents of ``cfg.val`` (validated every ``cfg.val.every_steps``)."""
        self.cfg = cfg
        self.model = model
        self.train_model = train_model or model
        self.make_loader = make_loader
        self.run_dir = Path(run_dir)
        self.world = world or World()
        self.device = device or next(model.parameters()).device
        self.sample_fn = sample_fn
        self.progress = progress and self.world.is_main
        self.flops_per_image = flops_per_image
        self.peak_flops = peak_flops
        self.on_checkpoint = on_checkpoint
        self.eval_fn = eval_fn if cfg.eval.every_steps else None
        self.val_set = val_set if cfg.val.every_steps else None
        # Wall time of the training loop (evaluation excluded) and of the evaluations, over every
        # session of the run (checkpointed): the GPU-hours and dollars that evaluations are logged against.
        self.eval_seconds = 0.0
        self._clock_start = time.perf_counter()
        self._session_eval_seconds = 0.0
        self._seconds_at_start = 0.0
        self.stop = stop or StopOnSignal(cfg.interrupt)
        self.checkpoint_seconds: list[float] = []  # of this process's saves, for the logs
        vae = latent_meta["vae"]
        self.scaling_factor = float(vae["scaling_factor"])
        self.shift_factor = float(vae.get("shift_factor") or 0.0)
        self.flow = cfg.noise.prediction_type == FLOW_MATCHING
        self.alphas_cumprod = None if self.flow else alphas_cumprod(cfg.noise).to(self.device)
        self._importance_cache: tuple[float, tuple[torch.Tensor, torch.Tensor]] | None = None  # by min-SNR floor
        # A LoRA run checkpoints and averages only what it trains: the base is the init_from directory.
        self.trainable_only = cfg.lora is not None
        self.denoiser = denoiser_of(model)  # how this backbone is called (train_model may wrap it)
        # The parameters, listed once: not a walk of the module tree every step (0.4 ms a walk on the
        # demo's U-Net, about 1% of its step with the EMA's; the EMA keeps its own list).
        self.params = list(model.parameters())
        self.optimizer = build_optimizer(self.params, cfg.optim, self.device.type,
                                         hidden=hidden_matrices(model, self.denoiser.edge_layers)
                                         if cfg.optim.name == "muon" else ())
        self.phase_batches = phase_batches(cfg, self.world.world_size)
        self.phase_steps = phase_num_steps(cfg, self.phase_batches)
        self.total_steps = sum(self.phase_steps)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.optim, self.total_steps)
        self.ema = EMA(model, cfg.ema, trainable_only=self.trainable_only) if cfg.ema is not None else None
        # FSDP2 shards the parameters into DTensors in place: checkpoints then go through DCP.
        self.sharded = any(isinstance(p, DTensor) for p in self.params)
        self.step = 0
        self.phase = 0
        self.skipped_steps = 0
        self.loader: TrainLoader | None = None
        self.autocast_dtype = self._autocast_dtype()
        self._loggers: list[MetricLogger] = []

    # ------------------------------------------------------------------ set-up helpers

    def _autocast_dtype(self) -> torch.dtype | None:
        if self.cfg.precision == "bf16" or (self.cfg.precision == "auto" and self.device.type == "cuda"):
            return torch.bfloat16
        return None

    # ------------------------------------------------------------------ state

    def state(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any], dict[str, Any]]:
        """(tensor groups, plain state, meta) of a single-file checkpoint; when sharded the model,
        optimizer and EMA tensors are left out (they go through DCP)."""
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        state: dict[str, Any] = {"lr_scheduler": self.lr_scheduler.state_dict(), "rng": rng_state()}
        if not self.sharded:
            weights = trainable_state_dict(self.model) if self.trainable_only else self.model.state_dict()
            tensors["model"] = ckpt.clean_state_dict_keys(weights)
            state["optimizer"] = self.optimizer.state_dict()
        if self.ema is not None:
            if not self.sharded:
                tensors["ema"] = self.ema.state_dict()["params"]
            state["ema_num_updates"] = self.ema.num_updates
        meta = {  # save_checkpoint adds the step
            "phase": self.phase,
            "skipped_steps": self.skipped_steps,
            "loader": self.loader.state_dict() if self.loader is not None else None,
            "world_size": self.world.world_size,
            "train_seconds": self.elapsed_train_seconds(),
            "eval_seconds": self.eval_seconds,
        }
        return tensors, state, meta

    def save(self) -> Path:
        """Write the checkpoint of this step (every rank calls it); the time it took is kept and
        compared with the interrupt grace period."""
        started = time.perf_counter()
        self.stop.saving = True
        try:
            path = self._save()
        finally:
            self.stop.saving = False
        seconds = time.perf_counter() - started
        self.checkpoint_seconds.append(seconds)
        if self.world.is_main:
            log.info("checkpoint of step %d written in %.2f s", self.step, seconds)
            self.stop.warn_if_slow(seconds, f"the checkpoint of step {self.step}")
        return path

    def _save(self) -> Path:
        tensors, state, meta = self.state()
        if self.sharded:
            from latentforge.distributed.dcp import save_sharded

            path = save_sharded(self.run_dir, self.step, self.model, self.optimizer, self.ema, state, meta,
                                self.world, keep_last=self.cfg.checkpoint.keep_last,
                                keep_every=self.cfg.checkpoint.keep_every)
        else:
            path = ckpt.save_checkpoint(self.run_dir, self.step, tensors, state, meta,
                                        keep_last=self.cfg.checkpoint.keep_last,
                                        keep_every=self.cfg.checkpoint.keep_every, is_writer=self.world.is_main)
        if self.world.barrier is not None:
            self.world.barrier()
        if self.on_checkpoint is not None:
            self.on_checkpoint(path, self.step)
        return path

    def load(self, path: Path) -> dict[str, Any]:
        from latentforge.distributed.dcp import is_sharded_checkpoint, load_sharded

        sharded = self.sharded or is_sharded_checkpoint(path)
        if sharded:
            # Model, optimizer and EMA come from the DCP shards, re-sharded to this run's layout
            # (any rank count, or unsharded); only the plain state is read here. The sha256 check
            # rereads every file: done once, by rank 0 (the other ranks wait in load_sharded's
            # collectives, and a failure on rank 0 ends the job).
            c = ckpt.load_checkpoint(path, map_location="cpu", groups=(), verify=self.world.is_main)
            load_sharded(path, self.model, self.optimizer, self.ema)
        else:
            c = ckpt.load_checkpoint(path, map_location="cpu")
            if self.trainable_only:
                load_trainable_state_dict(self.model, c.tensors["model"], str(path))
            else:
                ckpt.load_weights(self.model, c.tensors["model"], str(path), "this run's model",
                                  "resume with the train.model / train.unet / train.dit settings that wrote it")
            self.optimizer.load_state_dict(c.state["optimizer"])
        self.lr_scheduler.load_state_dict(c.state["lr_scheduler"])
        set_rng_state(c.state["rng"])
        if self.ema is not None:
            if not sharded:  # (load_sharded loaded the EMA shards)
                if "ema" not in c.tensors:
                    raise UserError(f"{path}: has no EMA weights but train.ema is set")
                self.ema.load_state_dict({"params": c.tensors["ema"], "num_updates": c.state["ema_num_updates"]})
            self.ema.num_updates = int(c.state["ema_num_updates"])
        self.step = int(c.meta["step"])
        self.phase = int(c.meta["phase"])
        self.skipped_steps = int(c.meta.get("skipped_steps", 0))
        self._seconds_at_start = float(c.meta.get("train_seconds", 0.0))  # older checkpoints: not recorded
        self.eval_seconds = float(c.meta.get("eval_seconds", 0.0))
        return c.meta

    # ------------------------------------------------------------------ the step

    def latents_from_batch(self, batch: dict[str, Any], post_noise: torch.Tensor | None) -> torch.Tensor:
        mean = batch["latent_mean"].to(self.device, torch.float32, non_blocking=True)
        if post_noise is not None:
            std = batch["latent_std"].to(self.device, torch.float32, non_blocking=True)
            mean = mean + std * post_noise.to(self.device, non_blocking=True)
        return (mean - self.shift_factor) * self.scaling_factor

    def loss_on(self, batch: dict[str, Any]) -> torch.Tensor:
        """The diffusion loss of one micro batch (mean over its samples)."""
        cfg = self.cfg
        shape = tuple(batch["latent_mean"].shape[1:])
        importance = self._importance() if cfg.timestep_importance and not self.flow else None
        draw = self._flow_time(shape) if self.flow else None
        if importance is not None:
            draw = lambda g: torch.multinomial(importance[1], 1, generator=g)  # noqa: E731
        t, noise, post = sample_noise(cfg.seed, batch["_position"], shape, cfg.noise.num_train_timesteps,
                                      cfg.offset_noise, cfg.sample_posterior and "latent_std" in batch, draw)
        # The weights of drawn timesteps follow from the density; the others' from their min-SNR weight, below.
        weights = None if importance is None else importance_weight(*importance, t).to(self.device)
        x0 = self.latents_from_batch(batch, post)
        x_t, target, t = self.noisy(x0, noise.to(self.device), t.to(self.device))
        hidden = batch["text_hidden"].to(self.device, non_blocking=True)
        mask = batch["text_mask"].to(self.device, non_blocking=True) if self.denoiser.uses_text_mask else None
        hidden = hidden.to(self.autocast_dtype or torch.float32)
        if cfg.text_noise:
            dropped = torch.as_tensor(batch["_caption_dropped"], dtype=torch.bool)
            noise_h = text_state_noise(cfg.seed, batch["_position"], tuple(hidden.shape[1:]))
            hidden = perturb_text(hidden, noise_h.to(self.device), cfg.text_noise, dropped.to(self.device))
        ratio = self.masking_ratio()
        with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            if ratio:
                # Patch masking (train/masking.py): the prediction and the loss of the kept patches only.
                p = self.denoiser.patch_size()
                num_tokens = (shape[-2] // p) * (shape[-1] // p)
                keep = sample_keep(cfg.seed, batch["_position"], num_tokens, num_kept_tokens(num_tokens, ratio))
                keep = keep.to(self.device)
                pred = self.denoiser.forward_tokens(self.train_model, x_t, t, hidden, mask, keep,
                                                    cfg.masking.mixer_blocks)
                target = gather_tokens(patchify(target, p), keep)
            else:
                pred = self.denoiser.forward(self.train_model, x_t, t, hidden, mask)
        if weights is None and cfg.min_snr_gamma:
            weights = min_snr_weight(snr(self.alphas_cumprod, t), cfg.min_snr_gamma, cfg.noise.prediction_type,
                                     cfg.min_snr_floor_of(self.phase))
        return diffusion_loss(pred, target, weights)

    def _importance(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the min-SNR weight of every timestep, the density training timesteps are drawn from) of
        this phase (its floor), on the CPU where the noise generators are; see train.timestep_importance."""
        cfg = self.cfg
        floor = cfg.min_snr_floor_of(self.phase)
        if self._importance_cache is None or self._importance_cache[0] != floor:
            ac = self.alphas_cumprod.cpu()
            weights = min_snr_weight(snr(ac, torch.arange(ac.numel())), cfg.min_snr_gamma,
                                     cfg.noise.prediction_type, floor)
            self._importance_cache = (floor, (weights, importance_density(weights, cfg.timestep_importance)))
        return self._importance_cache[1]

    def noisy(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x_t, the training target, the time as the denoiser takes it) of the run's objective;
        ``t``: integer timesteps, or flow matching's sigma in [0, 1] (the model is then given
        sigma * T, diffusers' convention)."""
        return noised(x0, noise, t, self.cfg.noise, self.alphas_cumprod)

    def masking_ratio(self) -> float:
        """The fraction of patches this phase's training steps drop."""
        return self.cfg.masking_ratio_of(self.phase)

    def _flow_time(self, latent_shape: tuple[int, ...]) -> Callable[[torch.Generator], torch.Tensor]:
        """The draw of one sample's sigma, shifted for this latent size (SD3 sec. 3.1 and 5.3.2)."""
        n = self.cfg.noise
        shift = resolution_shift(n.flow_shift, n.flow_shift_base_size, latent_shape[-2], latent_shape[-1])
        return lambda g: sample_flow_sigmas(1, g, n.flow_time_sampling, n.flow_logit_mean, n.flow_logit_std, shift)

    def train_step(self, batches: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """One optimizer step over ``batches`` (the accumulation micro batches)."""
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            sync = contextlib.nullcontext() if last or self.world.no_sync is None else self.world.no_sync()
            with sync:
                loss = self.loss_on(batch) / len(batches)
                loss.backward()
            total += loss.detach()
        grad_norm = clip_grad_norm(self.params, self.cfg.optim.grad_clip)
        # A finite loss can still give inf/NaN gradients (an overflow in the backward pass), and
        # gradients are averaged across ranks, so checking their norm too makes every rank take
        # the same decision. Host sync: needed to decide whether to step.
        finite = bool(torch.isfinite(total) & torch.isfinite(grad_norm))
        if finite:
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        return total, grad_norm, finite

    # ------------------------------------------------------------------ the loop

    def fit(self, resume_from: Path | None = None) -> dict[str, Any]:
        meta = self.load(resume_from) if resume_from else None
        if self.world.is_main:
            self._open_loggers()
        t_start = time.perf_counter()
        self._clock_start, self._session_eval_seconds = t_start, 0.0
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step",
                   disable=not self.progress, dynamic_ncols=True)
        history_path = self.run_dir / "metrics.jsonl"
        if self.world.is_main:
            _truncate_history(history_path, self.step)
            _truncate_history(self.run_dir / EVAL_LOG, self.step)
            _truncate_history(self.run_dir / VAL_LOG, self.step)
        stopped_early = False
        interrupted = None  # the signal that stopped the run
        # A stop asked for before the first step (while the run was being set up): nothing new to save.
        if self.phase < len(self.cfg.phases) and self.stop.agreed(self.world.any_rank, 0):
            stopped_early, interrupted = True, self.stop.signal_name
        if (not stopped_early and resume_from is not None and self._eval_due()
                and not _logged_step(self.run_dir / EVAL_LOG, self.step)):
            self._evaluate(Path(resume_from))  # the run stopped between that checkpoint and its evaluation
        try:
            while self.phase < len(self.cfg.phases) and not stopped_early:
                phase_start = sum(self.phase_steps[: self.phase])
                phase_end = phase_start + self.phase_steps[self.phase]
                micro, accum, global_batch = self.phase_batches[self.phase]
                self._set_phase_lr()
                self.loader = self.make_loader(self.phase, micro)
                if meta is not None and meta.get("loader") and meta["phase"] == self.phase:
                    self.loader.load_state_dict(meta["loader"])
                else:
                    # A phase reads on where the earlier phases stopped: restarting the order would, on the
                    # same data, repeat each (sample, timestep, noise) of the first phase and never reach
                    # the samples past its end (a bucketed loader: the rounds after the earlier phases').
                    self.loader.start_at(self.samples_at(phase_start))
                meta = None
                batches: Iterator[dict[str, Any]] = iter(self.loader)
                t_log, samples_since_log = time.perf_counter(), 0
                while self.step < phase_end:
                    lr = self.optimizer.param_groups[0]["lr"]  # of this step (the scheduler moves it on)
                    loss, grad_norm, finite = self.train_step([next(batches) for _ in range(accum)])
                    self.step += 1
                    samples_since_log += global_batch
                    if not finite:
                        self._on_nonfinite(loss, grad_norm)
                    if self.ema is not None and finite:
                        self.ema.update(self.model, self.step - 1)  # EMA steps are 0-based
                    bar.update(1)
                    if self.step % self.cfg.log_every == 0 or self.step == phase_end:
                        now = time.perf_counter()
                        rate = samples_since_log / (now - t_log)
                        record = {"step": self.step, "phase": self.phase, "loss": self._mean(loss),
                                  "grad_norm": float(grad_norm), "lr": lr,
                                  "img_per_s": rate, "samples_seen": self.samples_at(self.step),
                                  "skipped_steps": self.skipped_steps}
                        if self.flops_per_image and self.peak_flops:
                            per_device = rate / self.world.world_size
                            record["mfu"] = per_device * self.flops_per_image[self.phase] / self.peak_flops
                        self._log(record, history_path)
                        mfu = f"{100 * record['mfu']:.1f}%" if "mfu" in record else "n/a"
                        bar.set_postfix(loss=f"{record['loss']:.4f}", img_s=f"{rate:.0f}", mfu=mfu)
                        t_log, samples_since_log = now, 0
                    if self._val_due():  # before the save: a run resumed from this step has it logged
                        self._validate()
                    end_of_phase = self.step == phase_end
                    out_of_time = (bool(self.cfg.max_seconds) and self.step < self.total_steps
                                   and time.perf_counter() - t_start >= self.cfg.max_seconds)
                    if end_of_phase:
                        self.phase += 1
                        self.loader.close()
                        self.loader = None
                    evaluate = self._eval_due()
                    saved = (self.step % self.cfg.checkpoint.every_steps == 0 or end_of_phase or out_of_time
                             or evaluate)
                    path = self.save() if saved else None
                    # After the periodic save, so that a signal received during it stops here. Every
                    # rank takes part in the agreement at every step (a collective).
                    stop = self.stop.agreed(self.world.any_rank, self.step) and self.step < self.total_steps
                    if stop and not saved:
                        self.save()
                    if stop:  # an evaluation due at this step runs when the run resumes from it
                        stopped_early, interrupted = True, self.stop.signal_name
                        break
                    if evaluate:
                        self._evaluate(path)
                    if (self.sample_fn and self.cfg.sampling.every_steps
                            and self.step % self.cfg.sampling.every_steps == 0):
                        self.sample_fn(self, self.step)
                    if out_of_time:
                        stopped_early = True
                        break
                if stopped_early:
                    break
        finally:
            bar.close()
            if self.loader is not None:
                self.loader.close()
            self._close_loggers()
        if not stopped_early and self.sample_fn is not None:
            self.sample_fn(self, self.step)
        return {"step": self.step, "finished": not stopped_early, "seconds": time.perf_counter() - t_start,
                "skipped_steps": self.skipped_steps, "interrupted": interrupted,
                "checkpoint_seconds": max(self.checkpoint_seconds, default=None)}

    # ------------------------------------------------------------------ evaluation during training

    def elapsed_train_seconds(self) -> float:
        """Wall time of the training loop over every session of the run, evaluations excluded."""
        session = time.perf_counter() - self._clock_start - self._session_eval_seconds
        return self._seconds_at_start + session

    def samples_at(self, step: int) -> int:
        """Training images seen after ``step`` optimizer steps (repeats included)."""
        seen, start = 0, 0
        for steps, (_, _, global_batch) in zip(self.phase_steps, self.phase_batches):
            seen += max(0, min(step - start, steps)) * global_batch
            start += steps
        return seen

    def _due(self, every: int) -> bool:
        """Whether this step is every ``every``-th, or the last."""
        return self.step > 0 and (self.step % every == 0 or self.step == self.total_steps)

    def _eval_due(self) -> bool:
        return self.eval_fn is not None and self._due(self.cfg.eval.every_steps)

    def _val_due(self) -> bool:
        return self.val_set is not None and self._due(self.cfg.val.every_steps)

    @torch.no_grad()
    def _validate(self) -> None:
        """The validation loss of this step's weights (the EMA's with ``val.use_ema``), logged to
        ``RUN/val.jsonl`` and the metric loggers; its time counts as evaluation, not training."""
        assert self.val_set is not None
        started = time.perf_counter()
        use_ema = self.cfg.val.use_ema and self.ema is not None
        uses_mask = self.denoiser.uses_text_mask
        dtype = self.autocast_dtype or torch.float32

        def forward(x_t: torch.Tensor, t: torch.Tensor, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            # The plain handle (FSDP2 shards it in place; a compiled or DDP wrapper is not needed without gradients).
            with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
                return self.denoiser.forward(self.model, x_t, t, hidden.to(dtype), mask if uses_mask else None)

        with evaluation_weights(self.model, self.ema if use_ema else None):
            times = validation_times(self.cfg.val.num_timesteps, self.cfg.noise.num_train_timesteps, self.flow)
            result = self.val_set.losses(forward, self.noisy, times, self.device, self.world.rank,
                                         self.world.world_size, self.world.all_reduce_mean)
        seconds = time.perf_counter() - started
        self._session_eval_seconds += seconds
        self.eval_seconds += seconds
        if not self.world.is_main:
            return
        record = {"step": self.step, "samples_seen": self.samples_at(self.step),
                  "train_seconds": self.elapsed_train_seconds(), "seconds": seconds,
                  "num_samples": self.val_set.num_samples, "ema": use_ema, **result}
        with open(self.run_dir / VAL_LOG, "a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = {f"val/{k}": v for k, v in result.items() if isinstance(v, float)}
        for lg in self._loggers:
            lg.log(scalars, self.step)
        log.info("validation loss at step %d in %.1f s: %s", self.step, seconds,
                 ", ".join(f"{k}={v:.4g}" for k, v in scalars.items()))

    def _evaluate(self, checkpoint: Path) -> None:
        """Run ``eval_fn`` on ``checkpoint`` (this step's) and log its metrics against training
        images, GPU-hours and dollars; the evaluation's own cost is logged beside."""
        started = time.perf_counter()
        results = self.eval_fn(self, checkpoint)
        seconds = time.perf_counter() - started
        self._session_eval_seconds += seconds
        self.eval_seconds += seconds
        if not self.world.is_main or results is None:
            return
        ws, price = self.world.world_size, self.cfg.eval.price_per_gpu_hour
        train_seconds = self.elapsed_train_seconds()
        gpu_hours = train_seconds * ws / 3600
        eval_gpu_hours = self.eval_seconds * ws / 3600
        record = {"step": self.step, "samples_seen": self.samples_at(self.step),
                  "train_seconds": train_seconds, "world_size": ws, "gpu_hours": gpu_hours,
                  "price_per_gpu_hour": price, "dollars": gpu_hours * price, "eval_seconds": seconds,
                  "eval_gpu_hours": eval_gpu_hours, "eval_dollars": eval_gpu_hours * price,
                  "checkpoint": checkpoint.name, "rows": results["rows"]}
        with open(self.run_dir / EVAL_LOG, "a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = {"eval/samples_seen": record["samples_seen"], "eval/gpu_hours": gpu_hours,
                   "eval/dollars": record["dollars"], "eval/seconds": seconds,
                   "eval/cost_share": eval_gpu_hours / (gpu_hours + eval_gpu_hours) if gpu_hours + eval_gpu_hours else 0.0}
        for row in results["rows"]:
            for k, v in row.items():
                if k not in ("guidance_scale", "num_images") and isinstance(v, (int, float)):
                    scalars[f"eval/{k}/cfg{row['guidance_scale']:g}"] = float(v)
        for lg in self._loggers:
            lg.log(scalars, self.step)
        log.info("evaluation of step %d in %.1f s: %s", self.step, seconds,
                 ", ".join(f"{k}={v:.4g}" for k, v in scalars.items() if k.count("/") == 2))

    def _set_phase_lr(self) -> None:
        lr = self.cfg.phases[self.phase].lr or self.cfg.optim.lr
        self.lr_scheduler.base_lrs = [lr for _ in self.optimizer.param_groups]
        mult = self.lr_scheduler.lr_lambdas[0](self.lr_scheduler.last_epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * mult

    def _mean(self, loss: torch.Tensor) -> float:
        if self.world.all_reduce_mean is not None:
            loss = self.world.all_reduce_mean(loss.detach().clone())
        return float(loss)

    def _on_nonfinite(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.skipped_steps += 1
        what = f"loss {float(loss)}, gradient norm {float(grad_norm)}"
        if self.cfg.nonfinite == "stop" or self.skipped_steps > self.cfg.max_skipped_steps:
            latest = ckpt.find_latest(self.run_dir)
            where = f"the last good checkpoint is {latest}" if latest else "no checkpoint was written yet"
            if self.cfg.nonfinite == "stop":
                hint = "lower optim.lr, check the data, or set train.nonfinite=skip"
            else:
                hint = (f"that makes {self.skipped_steps} non-finite steps, over train.max_skipped_steps="
                        f"{self.cfg.max_skipped_steps}: lower optim.lr or check the data")
            raise TrainingDiverged(f"non-finite loss or gradients at step {self.step} ({what}); {where}; {hint}")
        log.warning("non-finite step %d (%s): skipped (%d so far)", self.step, what, self.skipped_steps)

    # ------------------------------------------------------------------ logging

    def _open_loggers(self) -> None:
        from latentforge.config import to_dict

        self._loggers = open_loggers(list(self.cfg.loggers), self.run_dir, self.step, to_dict(self.cfg))

    def _log(self, record: dict[str, Any], history_path: Path) -> None:
        if not self.world.is_main:
            return
        with open(history_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = {k: v for k, v in record.items() if k != "step"}
        for lg in self._loggers:
            lg.log(scalars, record["step"])

    def _close_loggers(self) -> None:
        close_loggers(self._loggers)
        self._loggers = []


class TrainingDiverged(UserError):
    """The loss became NaN/inf; the message says which checkpoint is the last good one."""


def _logged_step(path: Path, step: int) -> bool:
    return path.exists() and any(line and json.loads(line)["step"] == step for line in path.read_text().splitlines())


def _truncate_history(path: Path, step: int) -> None:
    """Drop log lines past ``step`` (written after the checkpoint a resumed run starts from)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in keep))
