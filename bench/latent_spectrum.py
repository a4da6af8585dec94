"""How many directions of a demo VAE's latent space the decoder uses.

    python bench/latent_spectrum.py RUN_DIR [RUN_DIR ...] [--samples 1000]

For each demo output directory (its ``vae/`` and the training latents of ``latents/``): the
eigenvalues of the 4x4 channel covariance of the first ``--samples`` training latents (in the
units the denoiser sees, i.e. times the VAE's ``scaling_factor``), the share of the variance that
is each image's own mean (the background tone, a constant over the image), and what the decoder
makes of the latents projected onto their top k eigen-directions (the others set to their mean):
the PSNR of that decode against the decode of the full latents. A direction the decoder ignores
leaves the decode unchanged (PSNR above 50 dB); the denoiser still has to model it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def latents_of(run: Path, samples: int) -> tuple[torch.Tensor, float]:
    """The first ``samples`` training latents (unscaled posterior means) and the VAE's scaling factor."""
    from latentforge.data.loader import LoaderConfig, StreamConfig, open_dataset

    ds = open_dataset(LoaderConfig(datasets=[StreamConfig(path=str(run / "latents"))], shuffle=False,
                                   caption_dropout=0.0, num_workers=0))
    n = min(samples, ds.samples_per_epoch)
    rows = ds.__getitems__(list(range(n)))
    scale = float(json.loads((run / "vae" / "config.json").read_text())["scaling_factor"])
    return torch.stack([r["latent_mean"] for r in rows]).double(), scale


def spectrum(run: Path, samples: int, decode_samples: int = 200) -> dict:
    from latentforge.models.autoencoder import load_vae
    from latentforge.train.vae import psnr

    z, scale = latents_of(run, samples)
    c = z.shape[1]
    flat = z.transpose(0, 1).reshape(c, -1)
    mean = flat.mean(dim=1, keepdim=True)
    cov = torch.cov(flat)
    eigvals, eigvecs = torch.linalg.eigh(cov)  # ascending
    per_image = z.mean(dim=(2, 3))  # the background tone of each image, per channel
    total = float(torch.trace(cov))
    image_share = float(torch.trace(torch.cov(per_image.T))) / total
    vae = load_vae(str(run / "vae"))
    sub = z[:decode_samples]
    sub_flat = sub.transpose(0, 1).reshape(c, -1)
    with torch.no_grad():
        full = vae.decode(sub.float()).sample.double()
        kept = {}
        for k in range(c - 1, 0, -1):
            top = eigvecs[:, -k:]
            proj = top @ top.T @ (sub_flat - mean) + mean
            zk = proj.reshape(c, sub.shape[0], *sub.shape[2:]).transpose(0, 1)
            kept[k] = float(psnr(vae.decode(zk.float()).sample.double(), full).mean())
    return {"run": run.name, "samples": z.shape[0], "eigenvalues_scaled": [float(v) * scale ** 2 for v in eigvals],
            "variance_share": [float(v) / total for v in eigvals], "per_image_mean_share": image_share,
            "decode_psnr_top_k": kept}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--samples", type=int, default=1000)
    args = parser.parse_args()
    for run in args.runs:
        r = spectrum(run, args.samples)
        eig = " ".join(f"{v:.4f}" for v in r["eigenvalues_scaled"])
        share = " ".join(f"{v:.1%}" for v in r["variance_share"])
        kept = ", ".join(f"top {k}: {v:.1f} dB" for k, v in r["decode_psnr_top_k"].items())
        print(f"{r['run']}: {r['samples']} latents; eigenvalues (scaled) {eig}; variance share {share}; "
              f"images' own means {r['per_image_mean_share']:.1%} of it; decode against the full latents: {kept}")


if __name__ == "__main__":
    main()
