"""Ingest throughput beside the bare Pillow decode+resize rate on the same files, same run.

    python bench/bench_ingest.py [--num 400] [--workers 2]

Two inputs: the built-in shapes dataset (64 px PNGs -> 32 px) and 512x384 JPEG photos-like images
(-> 256 px). The bare rate decodes + resizes + center-crops each file with Pillow in the same
number of worker processes and does nothing else (no caption, hash, encode, or write); the goal
is ingest >= 0.8 of it. Prints figures; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from latentforge.data.imageproc import FilterConfig, ImageConfig
from latentforge.data.ingest import IngestConfig, ingest
from latentforge.data.synth import SynthConfig, generate


def make_photos(out: Path, num: int, seed: int = 0) -> None:
    """JPEGs with smooth structure plus texture, so they compress and decode like photos."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    yy, xx = np.mgrid[0:384, 0:512].astype(np.float32)
    for i in range(num):
        a, b, c = rng.uniform(0.005, 0.05, 3)
        base = np.stack([np.sin(xx * a + i), np.cos(yy * b), np.sin((xx + yy) * c)], -1)
        img = (base * 90 + 128 + rng.normal(0, 12, base.shape)).clip(0, 255).astype(np.uint8)
        Image.fromarray(img).save(out / f"{i:06d}.jpg", quality=90)
        (out / f"{i:06d}.txt").write_text(f"a synthetic photo number {i}")


def _bare(args) -> int:
    path, res = args
    img = Image.open(path)
    img.draft("RGB", (res, res))  # same JPEG draft decoding ingest uses
    img = img.convert("RGB")
    s = res / min(img.size)
    img = img.resize((max(res, round(img.width * s)), max(res, round(img.height * s))), Image.Resampling.LANCZOS,
                     reducing_gap=3.0)
    left, top = (img.width - res) // 2, (img.height - res) // 2
    img.crop((left, top, left + res, top + res)).tobytes()
    return 1


def bare_rate(files: list[Path], res: int, workers: int) -> float:
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(workers) as pool:
        n = sum(pool.map(_bare, [(f, res) for f in files], chunksize=16))
    return n / (time.perf_counter() - t0)


def ingest_rate(src: Path, out: Path, res: int, workers: int, fmt: str) -> float:
    cfg = IngestConfig(image=ImageConfig(resolution=res, format=fmt), filters=FilterConfig(dedup=True),
                       num_workers=workers)
    cfg.source.folder_chunk = 100
    t0 = time.perf_counter()
    summary = ingest([str(src)], out, cfg, progress=False)
    return summary["seen"] / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num", type=int, default=400)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        generate(tmp / "synth", SynthConfig(num=args.num, num_heldout=0, image_size=64), progress=False)
        make_photos(tmp / "photos", args.num)
        for name, src, res, fmt in [("built-in 64px png -> 32", tmp / "synth" / "train", 32, "png"),
                                    ("512x384 jpeg -> 256", tmp / "photos", 256, "jpeg")]:
            files = sorted(p for p in src.iterdir() if p.suffix in (".png", ".jpg"))
            bare = bare_rate(files, res, args.workers)
            rate = ingest_rate(src, tmp / f"out-{res}", res, args.workers, fmt)
            print(f"{name:26s} ingest {rate:8.1f} img/s   bare Pillow decode+resize {bare:8.1f} img/s   "
                  f"ratio {rate / bare:.2f}   ({len(files)} files, {args.workers} processes)")


if __name__ == "__main__":
    main()
