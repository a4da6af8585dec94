"""Model FLOPs per training image and the device peak they are measured against (MFU).

FLOPs are counted by ``torch.utils.flop_counter`` on the meta device (no weights allocated):
matmuls, convolutions and attention (scores and values included), one multiply-add = 2 FLOPs.
A training step costs 3x the forward (forward + backward with its two matmuls per forward
matmul), as in the PaLM / MosaicML MFU convention; activation recomputation is not counted.
For sd2-base this gives 181.1 GFLOP forward per image at 256 px and 804.3 GFLOP at 512 px.
"""

from __future__ import annotations

import time
from functools import lru_cache

import torch

from latentforge.models.denoiser import Denoiser, as_denoiser
from latentforge.models.dit import DiTConfig
from latentforge.models.unet import UNetConfig

# Dense peak throughput per device, FLOP/s, from the vendors' data sheets (no sparsity).
GPU_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "a100-40g": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "a100-80g": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "h100-sxm": {"bf16": 989e12, "fp16": 989e12, "tf32": 495e12, "fp32": 67e12},
    "h100-pcie": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12},
    "l40s": {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12},
    "a10g": {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
    "rtx-4090": {"bf16": 165e12, "fp16": 165e12, "tf32": 82.6e12, "fp32": 82.6e12},
    "rtx-3090": {"bf16": 71e12, "fp16": 71e12, "tf32": 35.6e12, "fp32": 35.6e12},
    "v100": {"fp16": 125e12, "fp32": 15.7e12},
    "t4": {"fp16": 65e12, "fp32": 8.1e12},
}


def forward_flops(cfg: UNetConfig | DiTConfig | dict | Denoiser, latent_size: int, text_len: int,
                  mask_ratio: float = 0.0, mixer_blocks: int = 0) -> int:
    """Forward FLOPs of one image through the denoiser of ``cfg``, counted on the meta device;
    with ``mask_ratio`` > 0 (the transformer): of a patch-masked training forward (train/masking.py)."""
    den = as_denoiser(cfg)
    if not mask_ratio:
        return den.forward_flops(latent_size, text_len)
    from latentforge.train.masking import num_kept_tokens

    kept = num_kept_tokens(den.num_tokens(latent_size), mask_ratio)
    return den.forward_flops(latent_size, text_len, kept, mixer_blocks)


def unet_forward_flops(cfg: UNetConfig | dict, latent_size: int, text_len: int) -> int:
    """Forward FLOPs of one image through the U-Net of ``cfg`` (a UNetConfig or a diffusers
    ``config.json`` dict), counted on the meta device."""
    return forward_flops(cfg, latent_size, text_len)


def train_flops_per_image(cfg: UNetConfig | DiTConfig | dict | Denoiser, latent_size: int, text_len: int,
                          mask_ratio: float = 0.0, mixer_blocks: int = 0) -> int:
    """Model FLOPs of one training image: 3x the forward (patch-masked with ``mask_ratio`` > 0)."""
    return 3 * forward_flops(cfg, latent_size, text_len, mask_ratio, mixer_blocks)


@lru_cache(maxsize=None)
def measured_cpu_peak_flops(size: int = 1024, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """The best of ``repeats`` timed ``size``-square matmuls on this CPU, in FLOP/s (the MFU denominator on CPU)."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


def device_peak_flops(device: torch.device, precision: str = "bf16") -> tuple[float, str]:
    """(peak FLOP/s, how it was obtained) for ``device``: the data-sheet table on known GPUs,
    a timed matmul on CPU."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        for key, peaks in GPU_PEAK_FLOPS.items():
            family = key.split("-")[0]
            if family in name.replace(" ", "-") or family in name.replace(" ", ""):
                p = peaks.get(precision) or peaks["fp32"]
                return p, f"{key} data sheet ({precision})"
        return float("nan"), f"unknown GPU {name!r}: no peak in the table"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return measured_cpu_peak_flops(dtype=dtype), f"measured {'bf16' if dtype == torch.bfloat16 else 'fp32'} matmul peak"


def mfu(images_per_second: float, flops_per_image: float, peak: float) -> float:
    return images_per_second * flops_per_image / peak
