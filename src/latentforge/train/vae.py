"""Train a small ``AutoencoderKL`` from scratch on ingested (raw) shards.

No pretrained VAE can be downloaded here, and a team that wants every weight trained on its own
licensed data needs this anyway. The loss is the KL-regularised autoencoder objective of
Rombach et al. 2022 ("High-Resolution Image Synthesis with Latent Diffusion Models", sec. 3 and
appendix G) without the adversarial and perceptual terms: L1 + MSE reconstruction plus a small
KL weight. Two optional terms stand in for the perceptual loss on flat-colour images (see
:func:`reconstruction_loss`): an L1 loss on the image's finite differences (edges), and extra
weight on coloured (non-gray) pixels, which keep small shapes from dissolving into the
background. After training, the latent scale factor is measured on training images
(1 / std of the sampled latents, as section 4.3.2 of the paper prescribes) and written into the
VAE's config, where encode picks it up; it is never a constant in code.

Training is resumable: ``OUT/checkpoints/step-N/`` (the usual atomic checkpoints of
:mod:`latentforge.checkpoint`) hold the weights, AdamW and LR state, the posterior-noise
generator, the RNG states and the loader cursor, every ``checkpoint_every_steps`` and when a
signal stops the run (:mod:`latentforge.interrupt`: exit code 75); a rerun of the same command
continues from the newest one, exactly. They are removed once the VAE directory is written;
``metrics.json``, written last, marks it complete (:func:`is_complete`).
"""

from __future__ import annotations

import io
import json
import logging
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from latentforge import checkpoint as ckpt
from latentforge import storage
from latentforge.config import load_config, save_config, to_dict
from latentforge.data.loader import LoaderConfig, build_loader
from latentforge.data.schema import read_index, read_shard
from latentforge.errors import ConfigError, Problems, UserError
from latentforge.interrupt import InterruptConfig, StopOnSignal
from latentforge.models.autoencoder import AutoencoderConfig, build_vae
from latentforge.train.optim import MuonAdamW, adamw_kernel, hidden_matrices
from latentforge.train.rng import rng_state, set_rng_state

log = logging.getLogger(__name__)

CONFIG_FILE = "train_vae_config.yaml"
METRICS_FILE = "metrics.json"  # written last: its presence means the VAE directory is complete
# The layers that read the image in and write it out: on AdamW when the optimizer is Muon.
VAE_EDGE_LAYERS = ("encoder.conv_in", "decoder.conv_out")


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
    optimizer: Literal["adamw", "muon"] = field(default="adamw", metadata={
        "help": "adamw on every weight, or muon: Muon on the hidden kernels and matrices (not the encoder's "
                "first or the decoder's last convolution), AdamW on the rest, at the same lr (train.optim.name)"})
    warmup_steps: int = field(default=50, metadata={"help": "linear warmup steps"})
    kl_weight: float = field(default=1e-6, metadata={"help": "weight of the KL term (LDM's f=4/8 KL models use 1e-6)"})
    l1_weight: float = field(default=1.0, metadata={"help": "weight of the L1 reconstruction term"})
    mse_weight: float = field(default=1.0, metadata={"help": "weight of the MSE reconstruction term"})
    grad_weight: float = field(default=0.0, metadata={
        "help": "weight of the L1 loss between the horizontal and vertical finite differences of the "
                "reconstruction and of the image (edges; a cheap perceptual proxy for flat colours); 0 = off"})
    color_weight: float = field(default=0.0, metadata={
        "help": "extra weight of the L1/MSE terms on coloured pixels: each pixel counts 1 + color_weight x "
                "its chroma (max - min over RGB, 0 for gray, 1 for a saturated colour) in the image; 0 = off"})
    decoder_noise: float = field(default=0.0, metadata={
        "help": "noise-augmented decoding: the decoder also sees latents with Gaussian noise of std "
                "decoder_noise x |N(0, 1)| x the batch's latent std added, one draw per image, so that it "
                "turns the denoiser's imperfect latents into clean images too; 0 = off"})
    latent_scale: float = field(default=1.0, metadata={
        "help": "the std of the latents the denoiser sees: scaling_factor = latent_scale / the measured latent "
                "std; 1 = unit variance (SD's convention); below 1 the diffusion noise drowns the latents sooner "
                "(every timestep's SNR times latent_scale^2)"})
    scale_samples: int = field(default=512, metadata={"help": "training images used to measure the latent std"})
    seed: int = field(default=0, metadata={"help": "seed of the initialisation and the posterior samples"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda"})
    log_every: int = field(default=50, metadata={"help": "steps between loss log lines"})
    checkpoint_every_steps: int = field(default=500, metadata={
        "help": "steps between resumable checkpoints in OUT/checkpoints (removed when training ends)"})
    interrupt: InterruptConfig = field(default_factory=InterruptConfig, metadata={
        "help": "on SIGINT / SIGTERM / a scheduler's warning signal: finish the step, checkpoint, exit 75"})

    def validate(self) -> None:
        problems = Problems()
        if self.steps < 0:
            problems.add(f"steps: must be >= 0, got {self.steps}; 0 = stop on max_seconds only")
        if self.max_seconds < 0:
            problems.add(f"max_seconds: must be >= 0, got {self.max_seconds}; 0 = no time limit")
        if self.steps == 0 and self.max_seconds == 0:
            problems.add("steps: 0 and max_seconds 0 would never stop; set steps or max_seconds")
        if self.batch_size < 1:
            problems.add(f"batch_size: must be >= 1, got {self.batch_size}; images per step")
        if self.lr <= 0:
            problems.add(f"lr: must be > 0, got {self.lr}; e.g. 1e-4")
        for name in ("kl_weight", "l1_weight", "mse_weight", "grad_weight", "color_weight", "decoder_noise"):
            if getattr(self, name) < 0:
                problems.add(f"{name}: must be >= 0, got {getattr(self, name)}; 0 = the term is off")
        if not self.latent_scale > 0:
            problems.add(f"latent_scale: must be > 0, got {self.latent_scale}; 1 = latents of unit variance")
        if self.l1_weight == self.mse_weight == self.grad_weight == 0:
            problems.add("l1_weight: l1_weight, mse_weight and grad_weight are all 0: at least one reconstruction "
                         "term must be on (l1_weight: 1 is the default)")
        if self.checkpoint_every_steps < 1:
            problems.add(f"checkpoint_every_steps: must be >= 1, got {self.checkpoint_every_steps}; "
                         "steps between checkpoints")
        problems.nested("interrupt", self.interrupt)
        problems.raise_if_any()


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
    if index.kind != "raw":
        raise UserError(f"{path}: train-vae evaluates on raw shards (from ingest), not {index.kind!r} (vae.eval_dataset)")
    rows: list[dict] = []
    for shard in index.shards:
        rows += read_shard(storage.join(path, shard.name), columns=["image"]).to_pylist()
        if len(rows) >= num:
            break
    if not rows:
        raise UserError(f"{path}: no images for evaluation")
    return decode_images(rows[:num])["pixels"]


def chroma(x: torch.Tensor) -> torch.Tensor:
    """Per pixel (N, 1, H, W): max - min over the RGB channels of images in [-1, 1], scaled to
    [0, 1] (0 for any gray, 1 for a fully saturated colour)."""
    return (x.amax(1, keepdim=True) - x.amin(1, keepdim=True)) / 2


def reconstruction_loss(rec: torch.Tensor, x: torch.Tensor, l1_weight: float = 1.0, mse_weight: float = 1.0,
                        grad_weight: float = 0.0, color_weight: float = 0.0) -> dict[str, torch.Tensor]:
    """The reconstruction terms of the VAE loss for images in [-1, 1] (NCHW); returns each term and
    their weighted sum ``"loss"``.

    - ``l1``, ``mse``: per-pixel errors averaged over channels and pixels, each pixel weighted by
      ``1 + color_weight * chroma(x)`` (the weights are not renormalised: with color_weight 0 these
      are the plain L1 and MSE of LDM's autoencoders, Rombach et al. 2022, appendix G).
    - ``grad``: mean L1 between the finite differences ``I[.., i, j+1] - I[.., i, j]`` (and along
      the height) of ``rec`` and of ``x``, the two directions averaged: the image-gradient loss of
      Mathieu et al. 2016 ("Deep multi-scale video prediction beyond mean square error", eq. 4,
      alpha = 1), which keeps edges and corners that the pixel losses trade for a smooth blob.
    """
    err = rec - x
    weight = 1.0 + color_weight * chroma(x) if color_weight else None
    l1, mse = err.abs(), err.pow(2)
    if weight is not None:
        l1, mse = l1 * weight, mse * weight
    terms = {"l1": l1.mean(), "mse": mse.mean()}
    if grad_weight:
        dx = (err[..., :, 1:] - err[..., :, :-1]).abs().mean()  # d(rec) - d(x) = d(rec - x)
        dy = (err[..., 1:, :] - err[..., :-1, :]).abs().mean()
        terms["grad"] = (dx + dy) / 2
    else:
        terms["grad"] = err.new_zeros(())
    terms["loss"] = l1_weight * terms["l1"] + mse_weight * terms["mse"] + grad_weight * terms["grad"]
    return terms


def noise_latents(z: torch.Tensor, scale: float, generator: torch.Generator) -> torch.Tensor:
    """``z`` (N, C, H, W) plus Gaussian noise of std ``scale * |n| * std(z)`` per image (``n ~ N(0, 1)``,
    one draw per image; ``std(z)`` over the batch, not differentiated): the noise-augmented decoding
    of Zheng et al. 2025 ("Diffusion transformers with representation autoencoders"), which
    trains the decoder on latents near, not only on, the encoder's. ``scale`` 0 returns ``z``."""
    if not scale:
        return z
    level = torch.randn(z.shape[0], 1, 1, 1, generator=generator).abs().to(z.device)
    eps = torch.randn(z.shape, generator=generator).to(z.device)
    return z + scale * level * z.detach().std() * eps


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


def train_vae(cfg: VAETrainConfig, out_dir: str | Path, progress: bool = True, lock: str = "") -> dict:
    """Train (or resume, see the module docstring), measure the scale factor, save a diffusers
    AutoencoderKL directory; returns metrics. Stopped by a signal, it returns
    ``{"interrupted": signal name, "steps": step saved}`` instead. ``lock``: the command's name
    (e.g. "latentforge train-vae"): ``out_dir``'s lock is held from the first write there
    (:func:`latentforge.storage.directory_lock`), so a second training of it stops in one line."""
    with StopOnSignal(cfg.interrupt, what="train-vae") as stop, storage.lock_at_first_write(lock) as take_lock:
        return _train_vae(cfg, Path(out_dir), progress, stop, take_lock)


_RUN_KNOBS = ("max_seconds", "log_every", "checkpoint_every_steps", "interrupt", "device")  # not in the weights


def _config_diffs(out: Path, cfg: VAETrainConfig, free: tuple[str, ...]) -> list[str]:
    before = {k: v for k, v in to_dict(load_config(VAETrainConfig, out / CONFIG_FILE)).items() if k not in free}
    now = {k: v for k, v in to_dict(cfg).items() if k not in free}
    return sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))


def _check_same_config(out: Path, cfg: VAETrainConfig) -> None:
    """A resume must train the same thing: everything but the stopping and logging knobs."""
    diffs = _config_diffs(out, cfg, ("steps", *_RUN_KNOBS))
    if diffs:
        raise UserError(f"{out}: holds checkpoints of a train-vae with another {', '.join(diffs)} "
                        f"({CONFIG_FILE}); use another --out or restore the settings")


def is_complete(out: str | Path) -> bool:
    """Whether ``out`` holds a VAE that train-vae finished (its metrics, written last)."""
    return (Path(out) / METRICS_FILE).is_file()


def check_trained_as(out: str | Path, cfg: VAETrainConfig) -> None:
    """A finished VAE in ``out`` is reused only where ``cfg`` would train the same one (every setting
    but the stopping and logging knobs, its steps included); else one line naming what differs."""
    if not (Path(out) / CONFIG_FILE).is_file():
        raise UserError(f"{out}: holds a VAE without its {CONFIG_FILE}, so what it was trained with is unknown; "
                        "use another --out or delete it")
    diffs = _config_diffs(Path(out), cfg, _RUN_KNOBS)
    if diffs:
        raise UserError(f"{out}: holds a VAE trained with another {', '.join(diffs)} ({CONFIG_FILE}); "
                        "use another --out or delete it")


def _train_vae(cfg: VAETrainConfig, out: Path, progress: bool, stop: StopOnSignal,
               take_lock: Callable[[Path], None]) -> dict:
    if (out / METRICS_FILE).exists():
        raise UserError(f"{out}: already holds a VAE; choose another --out")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    torch.manual_seed(cfg.seed)
    vae = build_vae(cfg.model).to(device)
    vae.train()
    # AdamW on all weights (or Muon on the hidden ones); warmup, then cosine to 5% (constant when only
    # max_seconds bounds the run).
    # The fused kernel: on the demo's VAE (168k parameters, batch 8, CPU) the step's compute took 86 ms
    # against 95-99 ms with the default; the whole train-vae loop, loader included, 2-3% less time
    # (docs/demo.md, run 21).
    params = list(vae.parameters())  # listed once: the optimizer and every step's gradient clip use it
    if cfg.optimizer == "muon":
        hidden = hidden_matrices(vae, VAE_EDGE_LAYERS)
        ids = {id(p) for p in hidden}
        opt = MuonAdamW([{"params": hidden, "muon": True}, {"params": [p for p in params if id(p) not in ids]}],
                        lr=cfg.lr, betas=(0.9, 0.99))
    else:
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.99),
                                **adamw_kernel(torch.device(device).type))
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
        raise ConfigError(f"vae.model.sample_size: {cfg.model.sample_size} != the dataset's resolution {res}")
    eval_images = _load_eval_images(cfg.eval_dataset, cfg.num_eval) if cfg.eval_dataset else None

    history: list[dict] = []
    step, seconds_before = 0, 0.0  # training time of the earlier runs this one resumes
    storage.refuse_foreign_dir(out, (CONFIG_FILE,), "VAE training")
    out.mkdir(parents=True, exist_ok=True)  # the first write
    take_lock(out)  # before the checkpoints are read: none is being written meanwhile
    resume_from = ckpt.find_latest(out)
    if resume_from is not None:
        _check_same_config(out, cfg)
        c = ckpt.load_checkpoint(resume_from)
        ckpt.load_weights(vae, c.tensors["model"], str(resume_from), f"the VAE of {out / CONFIG_FILE}",
                          "the checkpoints and that file must come from the same run")
        opt.load_state_dict(c.state["optimizer"])
        sched.load_state_dict(c.state["lr_scheduler"])
        gen.set_state(c.state["generator"])
        set_rng_state(c.state["rng"])
        loader.load_state_dict(c.meta["loader"])
        step, seconds_before, history = c.step, float(c.meta["train_seconds"]), list(c.meta["history"])
        print(f"resuming from {resume_from}", flush=True)  # also with --quiet
    else:
        save_config(cfg, out / CONFIG_FILE)

    t0 = time.perf_counter() - seconds_before

    def save() -> float:
        started = time.perf_counter()
        stop.saving = True
        try:
            state = {"optimizer": opt.state_dict(), "lr_scheduler": sched.state_dict(),
                     "generator": gen.get_state(), "rng": rng_state()}
            meta = {"loader": loader.state_dict(), "train_seconds": time.perf_counter() - t0, "history": history}
            ckpt.save_checkpoint(out, step, {"model": vae.state_dict()}, state, meta, keep_last=1)
        finally:
            stop.saving = False
        seconds = time.perf_counter() - started
        stop.warn_if_slow(seconds, f"the train-vae checkpoint of step {step}")
        return seconds

    bar = tqdm(total=cfg.steps or None, initial=step, desc="train-vae", unit="step", disable=not progress,
               dynamic_ncols=True)
    it = iter(loader)
    if stop.requested:  # during set-up: nothing new to save
        bar.close()
        loader.close()
        return {"interrupted": stop.signal_name, "steps": step, "saved": resume_from is not None}
    while step < total:
        x = next(it)["pixels"].to(device)
        dist = vae.encode(x).latent_dist
        z = dist.mean + dist.std * torch.randn(dist.mean.shape, generator=gen).to(device)
        rec = vae.decode(noise_latents(z, cfg.decoder_noise, gen)).sample
        terms = reconstruction_loss(rec, x, cfg.l1_weight, cfg.mse_weight, cfg.grad_weight, cfg.color_weight)
        l1 = terms["l1"]
        kl = dist.kl().mean() / x[0].numel()  # per pixel, like the reconstruction terms
        loss = terms["loss"] + cfg.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        if step % cfg.log_every == 0 or step == 1:
            rec_psnr = float(psnr(rec.detach(), x).mean())  # host sync: only on log steps
            history.append({"step": step, "loss": float(loss.detach()), "l1": float(l1.detach()), "kl": float(kl.detach()),
                            "train_psnr": rec_psnr, "time_s": time.perf_counter() - t0})
            bar.set_postfix(loss=f"{history[-1]['loss']:.4f}", psnr=f"{rec_psnr:.1f}")
        bar.update(1)
        out_of_time = bool(cfg.max_seconds) and time.perf_counter() - t0 >= cfg.max_seconds
        if stop.requested and step < total and not out_of_time:
            seconds = save()
            bar.close()
            loader.close()
            return {"interrupted": stop.signal_name, "steps": step, "saved": True, "checkpoint_seconds": seconds}
        if step % cfg.checkpoint_every_steps == 0 and step < total and not out_of_time:
            save()
        if out_of_time:
            break
    bar.close()
    loader.close()
    train_time = time.perf_counter() - t0

    scale_loader = build_loader(cfg.data, min(64, cfg.scale_samples), collate=decode_images)
    std = measure_latent_std(vae, iter(scale_loader), device, cfg.scale_samples, gen)
    scale_loader.close()
    vae.register_to_config(scaling_factor=cfg.latent_scale / std)
    metrics = {
        "steps": step,
        "train_seconds": round(train_time, 2),
        "images_per_second": round(step * cfg.batch_size / train_time, 1),
        "latent_std": std,
        "latent_scale": cfg.latent_scale,
        "scaling_factor": cfg.latent_scale / std,
        "final_train_loss": history[-1]["loss"] if history else None,
        "heldout_psnr": evaluate_psnr(vae, eval_images, device) if eval_images is not None else None,
        "num_heldout": 0 if eval_images is None else len(eval_images),
        "history": history,
    }
    save_config(cfg, out / CONFIG_FILE)
    vae.to("cpu").save_pretrained(out, safe_serialization=True)
    # The mark of a complete VAE, written last and atomically: a run killed before it leaves an
    # unfinished directory, which the rerun trains again from its last checkpoint (removed only after
    # this mark), or from step 0 when it made none.
    storage.atomic_write_bytes(out / METRICS_FILE, json.dumps(metrics, indent=1).encode())
    shutil.rmtree(out / ckpt.CHECKPOINTS, ignore_errors=True)
    return metrics
