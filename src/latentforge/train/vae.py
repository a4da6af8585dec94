"""Train a small ``AutoencoderKL`` from scratch on ingested (raw) shards.

No pretrained VAE can be downloaded here, and a team that wants every weight trained on its own
licensed data needs this anyway. The loss is the KL-regularised autoencoder objective of
Rombach et al. 2022 ("High-Resolution Image Synthesis with Latent Diffusion Models", sec. 3 and
appendix G) without the adversarial and perceptual terms: L1 + MSE reconstruction plus a small
KL weight. After training, the latent scale factor is measured on training images
(1 / std of the sampled latents, as section 4.3.2 of the paper prescribes) and written into the
VAE's config, where encode picks it up; it is never a constant in code.
"""

from __future__ import annotations

import io
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from latentforge import storage
from latentforge.config import save_config
from latentforge.data.loader import LoaderConfig, build_loader
from latentforge.data.schema import read_index, read_shard
from latentforge.errors import ConfigError, UserError
from latentforge.models.autoencoder import AutoencoderConfig, build_vae


@dataclass
class VAETrainConfig:
    """``latentforge train-vae``: a fresh AutoencoderKL trained on raw shards."""

    model: AutoencoderConfig = field(default_factory=lambda: AutoencoderConfig(
        block_out_channels=(32, 64, 64), layers_per_block=1, latent_channels=4, norm_num_groups=16, sample_size=32),
        metadata={"help": "the autoencoder's shape"})
    data: LoaderConfig = field(default_factory=LoaderConfig, metadata={"help": "raw shards to train on"})
    eval_dataset: str = field(default="", metadata={"help": "raw shards held out for the PSNR report; empty = none"})
    num_eval: int = field(default=256, metadata={"help": "held-out images used for PSNR"})
    steps: int = field(default=1000, metadata={"help": "optimizer steps (0 = use max_seconds only)"})
    max_seconds: float = field(default=0.0, metadata={"help": "stop after this much training time; 0 = off"})
    batch_size: int = field(default=32, metadata={"help": "images per step"})
    lr: float = field(default=2e-3, metadata={"help": "AdamW peak learning rate (cosine decay to 5%)"})
    warmup_steps: int = field(default=50, metadata={"help": "linear warmup steps"})
    kl_weight: float = field(default=1e-6, metadata={"help": "weight of the KL term (LDM's f=4/8 KL models use 1e-6)"})
    l1_weight: float = field(default=1.0, metadata={"help": "weight of the L1 reconstruction term"})
    mse_weight: float = field(default=1.0, metadata={"help": "weight of the MSE reconstruction term"})
    scale_samples: int = field(default=512, metadata={"help": "training images used to measure the latent std"})
    seed: int = field(default=0, metadata={"help": "seed of the initialisation and the posterior samples"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda"})
    log_every: int = field(default=50, metadata={"help": "steps between loss log lines"})

    def validate(self) -> None:
        if self.steps < 0 or self.max_seconds < 0:
            raise ConfigError("steps: must be >= 0 (and max_seconds >= 0)")
        if self.steps == 0 and self.max_seconds == 0:
            raise ConfigError("steps: set steps or max_seconds")
        if self.batch_size < 1:
            raise ConfigError("batch_size: must be >= 1")
        if self.lr <= 0:
            raise ConfigError("lr: must be > 0")


def decode_images(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Collate raw samples: encoded image bytes -> float tensor in [-1, 1], NCHW (in loader workers)."""
    arrs = [np.asarray(Image.open(io.BytesIO(s["image"])).convert("RGB")) for s in samples]
    x = torch.from_numpy(np.stack(arrs)).permute(0, 3, 1, 2).float().div_(127.5).sub_(1.0)
    return {"pixels": x}


def psnr(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Peak signal-to-noise ratio (dB) per image of tensors in [-1, 1]."""
    mse = ((x.clamp(-1, 1) - y.clamp(-1, 1)) / 2).pow(2).flatten(1).mean(1)
    return 10 * torch.log10(1.0 / mse.clamp_min(1e-10))


def _load_eval_images(path: str, num: int) -> torch.Tensor:
    index = read_index(path)
    rows: list[dict] = []
    for shard in index.shards:
        rows += read_shard(storage.join(path, shard.name), columns=["image"]).to_pylist()
        if len(rows) >= num:
            break
    if not rows:
        raise UserError(f"{path}: no images for evaluation")
    return decode_images(rows[:num])["pixels"]


@torch.no_grad()
def evaluate_psnr(vae, images: torch.Tensor, device: str, batch: int = 64) -> float:
    vae.eval()
    scores = []
    for i in range(0, len(images), batch):
        x = images[i:i + batch].to(device)
        rec = vae.decode(vae.encode(x).latent_dist.mode()).sample
        scores.append(psnr(rec, x).cpu())
    vae.train()
    return float(torch.cat(scores).mean())


@torch.no_grad()
def measure_latent_std(vae, batches, device: str, num: int, generator: torch.Generator) -> float:
    """Std of sampled latents over ``num`` training images (the LDM scale-factor recipe)."""
    vae.eval()
    total, total_sq, count = 0.0, 0.0, 0
    for batch in batches:
        x = batch["pixels"].to(device)
        dist = vae.encode(x).latent_dist
        z = dist.mean + dist.std * torch.randn(dist.mean.shape, generator=generator).to(device)
        total += float(z.double().sum())
        total_sq += float(z.double().pow(2).sum())
        count += z.numel()
        if count >= num * z[0].numel():
            break
    mean = total / count
    return math.sqrt(max(total_sq / count - mean * mean, 1e-12))


def train_vae(cfg: VAETrainConfig, out_dir: str | Path, progress: bool = True) -> dict:
    """Train, measure the scale factor, save a diffusers AutoencoderKL directory; returns metrics."""
    out = Path(out_dir)
    if (out / "config.json").exists():
        raise UserError(f"{out}: already holds a VAE; choose another --out")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    torch.manual_seed(cfg.seed)
    vae = build_vae(cfg.model).to(device)
    vae.train()
    # AdamW on all weights; warmup, then cosine to 5% (constant when only max_seconds bounds the run).
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.99))
    total = cfg.steps or 10**9

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if not cfg.steps:
            return 1.0
        t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    loader = build_loader(cfg.data, cfg.batch_size, collate=decode_images)
    gen = torch.Generator().manual_seed(cfg.seed)
    index = read_index(cfg.data.datasets[0].path)
    if index.kind != "raw":
        raise UserError(f"{cfg.data.datasets[0].path}: train-vae reads raw shards (from ingest), not {index.kind!r}")
    res = index.meta.get("resolution")
    if res and res != cfg.model.sample_size:
        raise ConfigError(f"model.sample_size: {cfg.model.sample_size} != the dataset's resolution {res}")
    eval_images = _load_eval_images(cfg.eval_dataset, cfg.num_eval) if cfg.eval_dataset else None

    history: list[dict] = []
    t0 = time.perf_counter()
    bar = tqdm(total=cfg.steps or None, desc="train-vae", unit="step", disable=not progress, dynamic_ncols=True)
    step = 0
    it = iter(loader)
    while step < total:
        x = next(it)["pixels"].to(device)
        dist = vae.encode(x).latent_dist
        z = dist.mean + dist.std * torch.randn(dist.mean.shape, generator=gen).to(device)
        rec = vae.decode(z).sample
        l1 = (rec - x).abs().mean()
        mse = (rec - x).pow(2).mean()
        kl = dist.kl().mean() / x[0].numel()  # per pixel, like the reconstruction terms
        loss = cfg.l1_weight * l1 + cfg.mse_weight * mse + cfg.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        if step % cfg.log_every == 0 or step == 1:
            rec_psnr = float(psnr(rec.detach(), x).mean())  # host sync: only on log steps
            history.append({"step": step, "loss": float(loss.detach()), "l1": float(l1.detach()), "kl": float(kl.detach()),
                            "train_psnr": rec_psnr, "time_s": time.perf_counter() - t0})
            bar.set_postfix(loss=f"{history[-1]['loss']:.4f}", psnr=f"{rec_psnr:.1f}")
        bar.update(1)
        if cfg.max_seconds and time.perf_counter() - t0 >= cfg.max_seconds:
            break
    bar.close()
    loader.close()
    train_time = time.perf_counter() - t0

    scale_loader = build_loader(cfg.data, min(64, cfg.scale_samples), collate=decode_images)
    std = measure_latent_std(vae, iter(scale_loader), device, cfg.scale_samples, gen)
    scale_loader.close()
    vae.register_to_config(scaling_factor=1.0 / std)
    metrics = {
        "steps": step,
        "train_seconds": round(train_time, 2),
        "images_per_second": round(step * cfg.batch_size / train_time, 1),
        "latent_std": std,
        "scaling_factor": 1.0 / std,
        "final_train_loss": history[-1]["loss"] if history else None,
        "heldout_psnr": evaluate_psnr(vae, eval_images, device) if eval_images is not None else None,
        "num_heldout": 0 if eval_images is None else len(eval_images),
        "history": history,
    }
    vae.to("cpu").save_pretrained(out, safe_serialization=True)
    save_config(cfg, out / "train_vae_config.yaml")
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    return metrics
