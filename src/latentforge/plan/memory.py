"""What ``latentforge plan --memory`` prints of the training-step memory estimate (train/memory.py),
and what a checkpoint of the run costs to write (for the interrupt grace period)."""

from __future__ import annotations

from typing import Any

from latentforge.models.denoiser import as_denoiser
from latentforge.train.memory import GIB, HOST_PARTS, MemoryConfig, device_bytes_needed, largest_micro_batch


def format_memory(cfg: MemoryConfig, est: dict[str, Any], device_gib: float | None, device_name: str) -> str:
    def gib(b: float) -> str:
        return f"{b / GIB:8.2f} GiB"

    what = {"unet": "U-Net", "dit": "transformer"}.get(as_denoiser(cfg.unet).kind, "denoiser")
    lines = [f"memory: {what} {getattr(cfg.unet, 'preset', 'from a pipeline')} ({est['parameters']:,} parameters), "
             f"latents {cfg.latent_size}x"
             f"{cfg.latent_size}, micro batch {cfg.micro_batch_size}, {cfg.precision}, {cfg.parallel} x "
             f"{cfg.world_size}, activation checkpointing {'on' if cfg.activation_checkpointing else 'off'}, "
             f"{cfg.optimizer}, EMA {cfg.ema}{', CPU offload' if cfg.cpu_offload else ''}"]
    if cfg.lora_rank:
        lines[0] += (f", LoRA rank {cfg.lora_rank} on {', '.join(cfg.lora_target_modules)} "
                     f"({est['trained_parameters']:,} trained parameters), frozen base {cfg.frozen_dtype}")
    for key in ("weights", "weight_copies", "gradients", "ddp_buckets", "optimizer", "ema", "activations",
                "fsdp_gather"):
        if est[key]:
            lines.append(f"  {key:14s} {gib(est[key])}")
    lines.append(f"  {'total':14s} {gib(est['total'])}  (max_memory_allocated)")
    need = device_bytes_needed(est["total"])
    lines.append(f"  {'+ allowance':14s} {gib(need - est['total'])}  (10% fragmentation + 1 GiB CUDA context)")
    if device_gib:
        verdict = "fits" if need <= device_gib * GIB else "does NOT fit"
        lines.append(f"  needs {need / GIB:.2f} GiB: {verdict} in {device_name} ({device_gib:g} GiB)")
        best = largest_micro_batch(cfg, int(device_gib * GIB))
        lines.append(f"  largest micro batch that fits: {best}")
    if cfg.cpu_offload:
        lines.append("  host memory (per rank, CPU offload):")
        for key in HOST_PARTS:
            if est[key]:
                lines.append(f"  {key:14s} {gib(est[key])}")
        lines.append(f"  {'host_total':14s} {gib(est['host_total'])}  (plus the pinned staging buffers, the data "
                     "loader and the process itself)")
    return "\n".join(lines)


# Checkpoint write time, for the interrupt grace period. A checkpoint is written once (fsynced) and
# read back once for its sha256 (checkpoint.py). CHECKPOINT_WRITE_BYTES_PER_S is an assumed
# sustained write rate with fsync: a local NVMe SSD does 1-3 GB/s, network filesystems and cloud
# block storage 0.1-1 GB/s, so 1 GB/s is a middle figure; measure yours (the trainer logs each
# checkpoint's time). SHA256_BYTES_PER_S was measured here (checkpoint._HASH_CHUNK's comment).
CHECKPOINT_WRITE_BYTES_PER_S = 1.0e9
SHA256_BYTES_PER_S = 1.7e9


def checkpoint_bytes(cfg: MemoryConfig, parameters: int) -> int:
    """Bytes of one training checkpoint of ``parameters`` trained U-Net parameters (a LoRA run's
    adapters only): fp32 model, EMA (unless off) and the optimizer state (AdamW: two fp32 moments;
    8-bit AdamW: two 1-byte moments), all ranks together. FSDP2 checkpoints add the consolidated
    fp32 model and EMA beside the DCP shards."""
    ema = 0 if cfg.ema == "off" else 4
    opt = 8 if cfg.optimizer == "adamw" else 2
    per_param = 4 + ema + opt
    if cfg.parallel != "ddp" and cfg.world_size > 1:
        per_param += 4 + ema
    return parameters * per_param


def checkpoint_seconds(num_bytes: int, write_bytes_per_s: float = CHECKPOINT_WRITE_BYTES_PER_S) -> float:
    """Estimated time to write and hash a checkpoint of ``num_bytes`` (see the constants above)."""
    return num_bytes / write_bytes_per_s + num_bytes / SHA256_BYTES_PER_S
