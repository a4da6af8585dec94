"""The validation loss (``train.val``) of finished demo runs' checkpoints, after the fact.

    python bench/bench_val_loss.py runs/NAME [runs/NAME ...] [--num-samples 96] [--all-checkpoints]

For each demo run directory: encodes its held-out renders (``raw-heldout``) with the run's own VAE
and text encoder into ``latents-heldout/`` if the demo has not (runs made before the demo did),
then computes the validation loss of the EMA weights of its newest checkpoint (or of every kept
checkpoint) exactly as the trainer does during training (the same fixed times, noise and
samples), and prints it beside the run's judged held-out figures from ``results.json``. Prints
the seconds each validation took.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch


def val_of(run: Path, num_samples: int, all_checkpoints: bool) -> list[dict]:
    from latentforge import checkpoint as ckpt
    from latentforge.data.encode import EncodeConfig, encode_dataset
    from latentforge.inference import load_components
    from latentforge.models.denoiser import denoiser_of
    from latentforge.train.run_files import load_run_files
    from latentforge.diffusion.schedule import alphas_cumprod
    from latentforge.train.trainer import noised
    from latentforge.train.validation import ValLossConfig, load_validation_set, validation_times

    cfg, meta = load_run_files(run / "run")
    data = run / "latents-heldout"
    if not (data / "index.json").is_file():
        enc = EncodeConfig(vae=meta["vae"]["path"], text_encoder=meta["text_encoder"]["path"],
                           max_length=int(meta["text_encoder"]["max_length"]))
        encode_dataset(str(run / "raw-heldout"), str(data), enc, progress=False)
    val_cfg = replace(cfg.train.val, data=str(data), every_steps=1, num_samples=num_samples)
    vs = load_validation_set(val_cfg, replace(cfg.data, cache_dir=str(run / "cache")), meta)
    paths = sorted((run / "run" / ckpt.CHECKPOINTS).glob("step-*")) if all_checkpoints else [ckpt.find_latest(run / "run")]
    out = []
    for path in paths:
        comps = load_components(path, use_ema=True)
        denoiser = denoiser_of(comps.unet)  # the U-Net, or the transformer with its caption mask
        noise = cfg.train.noise
        flow = noise.prediction_type == "flow_matching"
        alphas = None if flow else alphas_cumprod(noise)
        times = validation_times(val_cfg.num_timesteps, noise.num_train_timesteps, flow)
        started = time.perf_counter()
        with torch.no_grad():  # the trainer's own noising and target for this run's objective
            r = vs.losses(lambda x, t, h, m: denoiser.forward(comps.unet, x, t, h, m if denoiser.uses_text_mask else None),
                          lambda x0, eps, t: noised(x0, eps, t, noise, alphas), times, torch.device("cpu"))
        out.append({"checkpoint": path.name, "seconds": time.perf_counter() - started, **r})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--num-samples", type=int, default=96)
    ap.add_argument("--all-checkpoints", action="store_true")
    args = ap.parse_args()
    for run in map(Path, args.runs):
        results = json.loads((run / "results.json").read_text())
        h = results["evaluation"]["splits"]["heldout"]
        judged = (f"held-out {h['wordings']['caption']['both']['rate']:.0%}, new wordings "
                  f"{h['new_wordings']['both']['rate']:.0%}, position {h['all']['position']['rate']:.0%}")
        for r in val_of(run, args.num_samples, args.all_checkpoints):
            gaps = " ".join(f"{g:.4f}" for g in r["text_gap_by_t"])
            print(f"{run.name} {r['checkpoint']}: loss {r['loss']:.4f}, empty caption {r['loss_uncond']:.4f}, "
                  f"text gap {r['text_gap']:.4f} (by time: {gaps}); {r['seconds']:.1f} s | judged: {judged}")


if __name__ == "__main__":
    main()
