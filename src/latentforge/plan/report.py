"""``latentforge plan``: a recipe's plan settings with the command line's on top, rendered as the
cost table and chart or as the memory breakdown."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING

from latentforge.errors import UserError
from latentforge.plan import cost
from latentforge.train.memory import train_memory_setup

if TYPE_CHECKING:
    from latentforge.recipe import Recipe


def plan_config(cfg: cost.PlanConfig, *, gpu: str | None = None, gpus: str | None = None,
                price: float | None = None, throughput: str | None = None, img_per_sec_per_gpu: str | None = None,
                scaling_efficiency: str | None = None, goodput: float | None = None, num_images: int | None = None,
                encode_img_per_sec_per_gpu: float | None = None,
                mfu: float | None = None) -> tuple[cost.PlanConfig, str]:
    """``cfg`` with the flags given (None = keep) applied and validated, and where the training
    throughputs came from."""
    changes: dict = {}
    if gpu:
        changes["gpu"] = cost.check_gpu(gpu)
    if gpus:
        try:
            changes["gpus"] = [int(x) for x in gpus.split(",") if x.strip()]
        except ValueError:
            raise UserError(f"--gpus {gpus!r}: expected GPU counts like 8,16,32") from None
    if sum(bool(x) for x in (throughput, img_per_sec_per_gpu, mfu)) > 1:
        raise UserError("give one of --throughput, --img-per-sec-per-gpu and --mfu")
    source = "recipe plan.img_per_s_per_gpu"
    if throughput:
        from latentforge.plan.bench import load_bench_throughput

        changes["img_per_s_per_gpu"], source = load_bench_throughput(throughput)
    elif img_per_sec_per_gpu:
        changes["img_per_s_per_gpu"] = cost.parse_pairs(img_per_sec_per_gpu, "--img-per-sec-per-gpu")
        source = "--img-per-sec-per-gpu"
    if scaling_efficiency:
        changes["scaling_efficiency"] = cost.parse_pairs(scaling_efficiency, "--scaling-efficiency")
    if throughput or img_per_sec_per_gpu:
        changes["mfu"] = 0.0  # a throughput given on the command line wins over a recipe's plan.mfu
    for key, value in (("price_per_gpu_hour", price), ("goodput", goodput), ("num_images", num_images),
                       ("encode_img_per_s_per_gpu", encode_img_per_sec_per_gpu), ("mfu", mfu)):
        if value is not None:
            changes[key] = value
    cfg = replace(cfg, **changes)
    cfg.validate()
    if cfg.mfu:
        source = (f"an assumed MFU of {100 * cfg.mfu:g}% of the {cfg.gpu} {cfg.precision} peak and each phase's "
                  "FLOPs per image")
    return cfg, source


def cost_report(recipe: "Recipe", cfg: cost.PlanConfig, source: str, chart: str = "", json_path: str = "") -> str:
    """The cost table of ``recipe`` for every GPU count of ``cfg``; the chart and JSON if asked."""
    from latentforge.plan.shapes import recipe_phases

    for p in recipe_phases(recipe, with_flops=False) if not cfg.mfu else ():  # fails before the FLOP count
        cost.throughput_at({int(k): v for k, v in cfg.img_per_s_per_gpu.items()}, p.resolution, p.name)
    phases = recipe_phases(recipe)
    plans = [cost.plan_run(phases, cfg, n) for n in cfg.gpus]
    text = cost.format_plan(plans, cfg, f"recipe {recipe.name}, throughput from {source}")
    if chart:
        cost.plot_plans(plans, chart, f"{recipe.name} on {cfg.gpu} (${cfg.price_per_gpu_hour:g}/GPU-hour)")
        text += f"\nplan: chart -> {chart}"
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"phases": [vars(p) for p in phases], "plans": plans}, f, indent=1)
    return text


def memory_report(recipe: "Recipe", cfg: cost.PlanConfig, *, resolution: int | None = None,
                  micro_batch: int | None = None, gpu_memory: float | None = None, **setup) -> str:
    """The memory breakdown of ``recipe``'s U-Net at ``resolution`` (default: its last phase's) for
    the set-up ``setup`` (MemoryConfig fields; None = the recipe's, see :func:`recipe_memory_setup`),
    and whether it fits ``gpu_memory`` GB (default: the memory of ``cfg.gpu``)."""
    from latentforge.plan.memory import format_memory
    from latentforge.train.memory import MemoryConfig, estimate_memory
    from latentforge.plan.shapes import phase_shapes, unet_for, vae_factor

    shapes = phase_shapes(recipe)[-1]
    factor = vae_factor(recipe)
    resolution = resolution or shapes.resolution
    if resolution < 1 or resolution % factor:
        raise UserError(f"--resolution {resolution}: must be a positive multiple of the VAE factor {factor}")
    if gpu_memory is not None and not gpu_memory > 0:
        raise UserError(f"--gpu-memory: must be > 0 GB, got {gpu_memory}")
    train_micro = recipe.train.micro_batch_size if recipe.train.micro_batch_size != "auto" else 1
    given = {k: v for k, v in setup.items() if v is not None}
    setup = {**recipe_memory_setup(recipe, given.get("cpu_offload")), **given}
    mem = MemoryConfig(unet=unet_for(recipe, shapes), latent_size=resolution // factor, text_len=shapes.text_len,
                       micro_batch_size=micro_batch or train_micro, **setup)
    mem.validate()
    name = f"{gpu_memory:g} GB" if gpu_memory else cfg.gpu
    est = estimate_memory(mem)
    return (format_memory(mem, est, gpu_memory or cost.GPU_MEMORY_GB[cfg.gpu], name) + "\n"
            + checkpoint_line(mem, est["trained_parameters"], recipe.train.interrupt.grace_seconds))


def checkpoint_line(mem, parameters: int, grace_seconds: float) -> str:
    """How long a checkpoint of this set-up takes to write, against the interrupt grace period."""
    from latentforge.plan.memory import CHECKPOINT_WRITE_BYTES_PER_S, checkpoint_bytes, checkpoint_seconds

    num_bytes = checkpoint_bytes(mem, parameters)
    seconds = checkpoint_seconds(num_bytes)
    verdict = "within" if seconds <= grace_seconds else "LONGER than"
    return (f"checkpoint: {num_bytes / 1e9:.2f} GB, about {seconds:.1f} s to write at "
            f"{CHECKPOINT_WRITE_BYTES_PER_S / 1e9:g} GB/s and hash; {verdict} train.interrupt.grace_seconds="
            f"{grace_seconds:g} (the time a signal leaves to save)")


def recipe_memory_setup(recipe: "Recipe", cpu_offload: bool | None = None) -> dict:
    """The MemoryConfig fields that ``recipe.train`` determines (``cpu_offload`` overrides the
    recipe's); ``precision: auto`` counts as bf16 on the GPUs planned for."""
    return train_memory_setup(recipe.train, cpu_offload, autocast=recipe.train.precision != "fp32")
