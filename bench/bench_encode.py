"""Encoding on Ray against the local encode, and training on online-encoded vs precomputed data.

    python bench/bench_encode.py [--num 512] [--actors 1 2] [--steps 20] [--batch 32]
    OMP_NUM_THREADS=1 python bench/bench_encode.py --only-forward [--num 1024] [--rounds 3] [--batch 64]

Models and data as in the tiny-cpu demo: 32 px PNGs with captions, its VAE shape (16/32 channels,
2x down-sampling, untrained: the cost does not depend on the weights) and the pretrained
all-MiniLM-L6-v2 text encoder (24 tokens), run 13's U-Net (4.6M parameters, bench/measured_unet.py) at micro batch 32.

A. Encode throughput: ``encode_dataset`` in this process vs ``encode --ray`` (Ray Data: decode
   tasks + an actor pool) with 1 and 2 actors on a local Ray instance with all cores. Ray's
   start-up is timed apart (it is paid once per command).
B. Training img/s (median of the trainer's per-step figure after 3 warm-up steps): precomputed
   latent shards vs the same raw shards encoded online by 1 Ray actor.

C. (``--only-forward``, or before A) ``encode_dataset`` against the bare forward passes of its
   own encoders at the same batch: the forward-only rate (images already decoded to a tensor in
   memory, captions already tokenised; VAE encode to the posterior mean/std + text encoder
   forward, no I/O) and ``encode_dataset``'s rate on the same images read from the raw shards,
   model loading timed apart; the two are run in alternation, ``--rounds`` times each, in one
   process (a shared machine's load then weighs on both alike); medians and their ratio, and the
   median of each round's ratio (on a loaded machine, many short rounds give the steadier figure).

Prints figures; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from latentforge.config import from_dict
from latentforge.data import schema
from latentforge.data.encode import EncodeConfig, Encoders, decode_batch, encode_dataset
from latentforge.demo import builtin_text_encoder
from latentforge.distributed.ray_data import OnlineSource, encode_on_ray
from latentforge.distributed.ray_cluster import RayConfig
from latentforge.models.autoencoder import build_vae
from latentforge.recipe import load_recipe
from measured_unet import RUN13_UNET
from latentforge.train.run import RunConfig, train

WORDS = ("red", "green", "blue", "circle", "square", "star", "small", "large", "top", "left")


def write_raw(root: Path, num: int, resolution: int = 32, num_shards: int = 4) -> Path:
    rng = np.random.default_rng(0)
    rows = []
    for i in range(num):
        px = np.full((resolution, resolution, 3), rng.integers(0, 256, 3), np.uint8)
        a, b = sorted(rng.integers(0, resolution, 2))
        px[a:b + 1, a:b + 1] = rng.integers(0, 256, 3)
        buf = io.BytesIO()
        Image.fromarray(px).save(buf, format="PNG")
        caption = "a " + " ".join(rng.choice(WORDS, 5))
        rows.append({"key": f"b/{i:06d}", "image": buf.getvalue(), "image_format": "png", "caption": caption,
                     "width": resolution, "height": resolution, "orig_width": resolution,
                     "orig_height": resolution, "source": "", "license": "", "sha256": "", "meta": {}})
    shards = [schema.write_shard(root / f"shard-{s:06d}.parquet", rows[s::num_shards], schema.RAW_COLUMNS)
              for s in range(num_shards)]
    schema.write_index(root, schema.DatasetIndex("raw", dict(schema.RAW_COLUMNS), shards, {"resolution": resolution}))
    return root


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num", type=int, default=512, help="images")
    ap.add_argument("--actors", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=20, help="training steps per variant (part B)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--encode-batch", type=int, default=64, help="images per encoder call (part C)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of part C")
    ap.add_argument("--only-forward", action="store_true", help="only part C")
    args = ap.parse_args()
    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(os.cpu_count() or 1)
    print(f"torch threads {torch.get_num_threads()}")
    recipe = load_recipe("tiny-cpu", RUN13_UNET)
    tmp = Path(tempfile.mkdtemp(prefix="lf-bench-enc-", dir="/tmp"))
    try:
        vae_dir = tmp / "vae"
        build_vae(recipe.vae.model).save_pretrained(vae_dir)
        raw = write_raw(tmp / "raw", args.num)
        cfg = EncodeConfig(vae=str(vae_dir), text_encoder=builtin_text_encoder(), max_length=24, batch_size=64,
                           device="cpu")
        print(f"cores {os.cpu_count()}, {args.num} images at 32 px, VAE 16/32 ch, MiniLM-L6 text, batch 64")
        part_c(raw, tmp, dataclasses.replace(cfg, batch_size=args.encode_batch), args.num, args.rounds)
        if args.only_forward:
            return

        t = time.perf_counter()
        encode_dataset(str(raw), str(tmp / "local"), cfg, progress=False)
        local = time.perf_counter() - t
        print(f"A. local encode_dataset:        {args.num / local:7.1f} img/s ({local:.1f} s, incl. model loading)")

        import ray

        t = time.perf_counter()
        ray.init(num_cpus=os.cpu_count(), object_store_memory=500_000_000, include_dashboard=False,
                 log_to_driver=False, _temp_dir=str(tmp / "ray"))
        print(f"   Ray start-up (ray.init):       {time.perf_counter() - t:.1f} s")
        for n in args.actors:
            for run in ("first", "second"):  # the second finds Ray's task worker processes warm
                out = tmp / f"ray{n}-{run}"
                t = time.perf_counter()
                encode_on_ray(str(raw), str(out), cfg, RayConfig(), num_actors=n, progress=False)
                took = time.perf_counter() - t
                print(f"   encode --ray, {n} actor(s), {run} run: {args.num / took:7.1f} img/s ({took:.1f} s, "
                      "incl. model loading in the actors)")

        base = {"train": {**_train_dict(recipe), "loggers": [], "log_every": 1,
                          "micro_batch_size": args.batch, "sampling": {"prompts": []}, "ema": None,
                          "optim": {"lr": 1e-3, "schedule": "constant", "warmup_steps": 0},
                          "checkpoint": {"every_steps": 10_000, "keep_last": 1}},
                "data": {"num_workers": 0, "shuffle_window_shards": 4, "cache_dir": str(tmp / "cache")}}
        rates = {}
        for name, path, source in (("precomputed latents", tmp / "local", None),
                                   ("online encoding (1 actor)", raw, OnlineSource(cfg, 1))):
            base["train"]["phases"] = [{"datasets": [{"path": str(path)}], "steps": args.steps}]
            run_dir = tmp / f"run-{len(rates)}"
            train(from_dict(RunConfig, base), run_dir, progress=False, source=source)
            lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            rates[name] = statistics.median(r["img_per_s"] for r in lines[3:])
        for name, rate in rates.items():
            print(f"B. training, {name:26s} {rate:7.1f} img/s (median per step, micro batch {args.batch})")
        ray.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def part_c(raw: Path, tmp: Path, cfg: EncodeConfig, num: int, rounds: int) -> None:
    """encode_dataset against the forward passes of its own encoders, alternated (module docstring)."""
    from latentforge.models.text import uses_attention_mask

    t = time.perf_counter()
    enc = Encoders(cfg, "cpu")
    print(f"C. model loading (VAE + text encoder + tokenizer): {time.perf_counter() - t:.2f} s")
    index = schema.read_index(str(raw))
    pixels, captions = [], []
    for shard in index.shards:
        table = schema.read_shard(str(raw / shard.name), columns=["key", "image", "caption"])
        good, px, _ = decode_batch(table.column("key").to_pylist(), table.column("image").to_pylist(), 32, "")
        pixels.append(px)
        captions += table.column("caption").to_pylist()
    pixels = torch.from_numpy(np.concatenate(pixels))
    tokens = enc.tokenizer(captions, padding="max_length", truncation=True, max_length=enc.max_length,
                           return_tensors="pt")
    mask = tokens["attention_mask"] if uses_attention_mask(enc.text) else None
    b = cfg.batch_size

    @torch.inference_mode()
    def forward_only() -> float:
        t0 = time.perf_counter()
        for s in range(0, num, b):
            dist = enc.vae.encode(pixels[s:s + b]).latent_dist
            dist.mean, dist.std  # the two tensors the encode stores
            enc.text(input_ids=tokens["input_ids"][s:s + b],
                     attention_mask=None if mask is None else mask[s:s + b]).last_hidden_state
        return num / (time.perf_counter() - t0)

    def end_to_end(r: int) -> float:
        t0 = time.perf_counter()
        encode_dataset(str(raw), str(tmp / f"c-{r}"), cfg, progress=False, encoders=enc)
        took = time.perf_counter() - t0
        shutil.rmtree(tmp / f"c-{r}")
        return num / took

    forward_only()  # warm-up (first-call allocations)
    fwd, e2e = [], []
    for r in range(rounds):
        fwd.append(forward_only())
        e2e.append(end_to_end(r))
        print(f"   round {r}: forward-only {fwd[-1]:7.1f} img/s, encode_dataset {e2e[-1]:7.1f} img/s")
    f, e = statistics.median(fwd), statistics.median(e2e)
    ratio = statistics.median(x / y for x, y in zip(e2e, fwd))  # each round's pair ran back to back
    print(f"C. {num} images, batch {b}: forward-only {f:.1f} img/s, encode_dataset {e:.1f} img/s "
          f"(models loaded), ratio of the medians {e / f:.2f}, median of the rounds' ratios {ratio:.2f}")


def _train_dict(recipe) -> dict:
    from latentforge.config import to_dict

    d = to_dict(recipe.train)
    d.pop("phases")
    return d


if __name__ == "__main__":
    main()
