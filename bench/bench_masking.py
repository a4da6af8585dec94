"""Patch masking: the transformer's training step with 0, 50 and 75% of its patches masked.

    python bench/bench_masking.py [--preset small --batch 32 --steps 10 --warmup 2 --threads 1]

The real training step (``latentforge bench``'s: Trainer.train_step with EMA, AdamW, fp32, eager,
synthetic batches) of the demo recipe with ``train.model=dit`` at 16x16x4 latents (32 px, the
tiny VAE), for each masking setting; FLOPs per image are those of the masked forward (counted on
the meta device, 3x forward). Prints figures; asserts nothing about time.
"""

from __future__ import annotations

import argparse

import torch

from latentforge.plan.bench import run_bench
from latentforge.recipe import load_recipe

SETTINGS = [(0.0, 0), (0.5, 0), (0.75, 0), (0.75, 2)]  # (ratio, mixer blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"DiT {args.preset}, batch {args.batch}, 16x16x4 latents (64 tokens at patch 2), fp32, eager, "
          f"{args.threads} thread(s); median of {args.steps} steps after {args.warmup} warm-up")
    print(f"{'ratio':>5s} {'mixer':>5s} {'kept':>4s} {'ms/step':>9s} {'min-max':>13s} {'img/s':>7s} "
          f"{'GFLOP/img':>9s} {'FLOPs':>6s} {'time':>6s} {'MFU':>6s}")
    base = None
    for ratio, mixer in SETTINGS:
        recipe = load_recipe("tiny-cpu", [
            "train.model=dit", f"train.dit.preset={args.preset}", f"train.micro_batch_size={args.batch}",
            "train.device=cpu", f"train.masking.ratio={ratio}", f"train.masking.mixer_blocks={mixer}"])
        (row,) = run_bench(recipe, steps=args.steps, warmup=args.warmup, synthetic=True, progress=False)["phases"]
        s = row["step_seconds"]
        if base is None:
            base = row
        kept = round((1 - ratio) * 64 + 1e-9)
        print(f"{ratio:5.2f} {mixer:5d} {kept:4d} {1e3 * s['median']:9.0f} {1e3 * s['min']:6.0f}-{1e3 * s['max']:<6.0f} "
              f"{row['img_per_s_per_device']:7.1f} {row['flops_per_image'] / 1e9:9.3f} "
              f"{row['flops_per_image'] / base['flops_per_image']:6.2f} "
              f"{s['median'] / base['step_seconds']['median']:6.2f} {100 * row['mfu']:5.1f}%", flush=True)


if __name__ == "__main__":
    main()
