"""Throughput of ``latentforge eval``: generation and feature extraction, timed separately.

    python bench/bench_eval.py [--num 64] [--batch 16] [--steps 30] [--threads 0]

A. Generation: images/s of ``generate`` (the sampler loop with classifier-free guidance, then the
   VAE decode) from a run with run 13's tiny-cpu U-Net (4.6M parameters, 32 px images, 16x16x4
   latents), the tests' tiny VAE and BERT text encoder, at guidance 5; model loading is timed apart.
B. Feature extraction: images/s of each extractor on 32 px images, weights random (the cost does
   not depend on them) but architectures real:
   - the FID Inception-v3 on layer 2048: clean resize to 299 alone, then resize + network;
   - DINOv2 ViT-S/14 (22M parameters) at 224 px through its image processor, for ``fd_*``.
C. The share of a training run that ``train.eval.every_steps`` costs, at the U-Net's tiny and small
   presets (``--presets``): a real run per preset trains ``2 x --every`` steps on 32 px latents and
   evaluates its checkpoints (FID/KID on the Inception of B, ``--eval-images`` images, guidance 5);
   the trainer's own clocks (``RUN/eval.jsonl``: training seconds, evaluation seconds) give the
   measured share, and the same two measured costs give the share at other intervals.

Prints figures; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' tiny-model builders

from latentforge.config import from_dict, to_dict  # noqa: E402
from latentforge.data.encode import EncodeConfig, encode_dataset  # noqa: E402
from latentforge.evaluate.eval import EvalConfig, load_generator  # noqa: E402
from latentforge.evaluate.features import INCEPTION_SIZE, EncoderExtractor, InceptionExtractor, clean_resize  # noqa: E402
from latentforge.recipe import load_recipe  # noqa: E402
from measured_unet import RUN13_UNET  # noqa: E402
from latentforge.train.run import RunConfig, train  # noqa: E402
from tiny_models import make_raw_dataset, make_tiny_bert, make_tiny_inception_weights, make_tiny_vae  # noqa: E402


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def build_run(root: Path) -> Path:
    raw = make_raw_dataset(root / "raw", n=16, resolution=32, num_shards=1)
    encode_dataset(str(raw), str(root / "latents"), EncodeConfig(
        vae=str(make_tiny_vae(root / "vae")), text_encoder=str(make_tiny_bert(root / "bert")), max_length=8,
        batch_size=16, device="cpu"), progress=False)
    unet = to_dict(load_recipe("tiny-cpu", RUN13_UNET).train.unet)
    cfg = from_dict(RunConfig, {
        "train": {"unet": unet, "phases": [{"datasets": [{"path": str(root / "latents")}], "steps": 1}],
                  "micro_batch_size": 4, "device": "cpu", "loggers": [], "checkpoint": {"every_steps": 100}},
        "data": {"num_workers": 0, "cache_dir": str(root / "cache")}})
    train(cfg, root / "run", progress=False)
    return root / "run"


def eval_share(root: Path, preset: str, every: int, num_images: int, steps: int, batch: int) -> dict[str, float]:
    """Train ``2 * every`` steps of ``preset`` with an evaluation every ``every`` steps; the
    measured seconds per training step and per evaluation (the second one: the reference features
    are cached by then, as in a long run)."""
    from latentforge.evaluate.curve import read_evaluations

    raw = root / "raw"
    run = root / f"run-{preset}"
    cfg = from_dict(RunConfig, {
        "train": {"unet": {"preset": preset}, "phases": [{"datasets": [{"path": str(root / "latents")}],
                                                          "steps": 2 * every}],
                  "micro_batch_size": batch, "device": "cpu", "loggers": [], "log_every": every,
                  "checkpoint": {"every_steps": every, "keep_last": 1},
                  "eval": {"every_steps": every}},
        "data": {"num_workers": 0, "cache_dir": str(root / "cache")},
        "eval": {"prompts": str(raw), "reference": str(raw), "inception": str(root / "inception.pth"),
                 "num_images": num_images, "num_steps": steps, "guidance_scales": [5.0], "batch_size": 16,
                 "kid_subset_size": 8, "kid_subsets": 10, "device": "cpu"}})
    train(cfg, run, progress=False)
    records = read_evaluations(run)
    train_per_step = (records[1]["train_seconds"] - records[0]["train_seconds"]) / every
    return {"train_step_s": train_per_step, "eval_s": records[1]["eval_seconds"],
            "measured_share": records[1]["eval_seconds"] / (records[1]["eval_seconds"] + every * train_per_step)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num", type=int, default=64, help="images per measurement")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30, help="sampler steps")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--presets", default="tiny,small", help="C: U-Net presets ('' = skip C)")
    ap.add_argument("--every", type=int, default=20, help="C: steps between evaluations of the measured runs")
    ap.add_argument("--eval-images", type=int, default=16, help="C: images per evaluation")
    ap.add_argument("--train-batch", type=int, default=16, help="C: training micro batch")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.num} images, batch {args.batch}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run = build_run(root)
        cfg = from_dict(EvalConfig, {"checkpoint": str(run), "num_steps": args.steps, "device": "cpu"})
        start = time.perf_counter()
        gen, _ = load_generator(cfg, torch.device("cpu"))
        load_s = time.perf_counter() - start
        prompts = ["a small red circle in the corner"] * args.batch
        gen(prompts[:2], 0, 5.0)  # warm-up
        num_batches = max(1, args.num // args.batch)
        images = []
        gen_s = timed(lambda: [images.extend(gen(prompts, b, 5.0)) for b in range(num_batches)])
        print(f"A. generation ({args.steps} steps, cfg 5, {images[0].width} px): "
              f"{len(images) / gen_s:.1f} img/s ({gen_s:.1f} s for {len(images)}); model load {load_s:.1f} s")

        inception = InceptionExtractor(make_tiny_inception_weights(root / "inception.pth"), feature=2048)
        inception(images[:2])  # warm-up
        resize_s = timed(lambda: [clean_resize(im, INCEPTION_SIZE) for im in images])
        inc_s = timed(lambda: [inception(images[i:i + args.batch]) for i in range(0, len(images), args.batch)])
        print(f"B. Inception-v3 (2048): {len(images) / inc_s:.1f} img/s including the clean resize "
              f"(resize alone {len(images) / resize_s:.0f} img/s)")

        from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

        dino = root / "dinov2-small"
        Dinov2Model(Dinov2Config(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, image_size=518,
                                 patch_size=14)).save_pretrained(dino)
        BitImageProcessor(size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224},
                          image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]).save_pretrained(dino)
        enc = EncoderExtractor(dino)
        enc(images[:2])
        enc_s = timed(lambda: [enc(images[i:i + args.batch]) for i in range(0, len(images), args.batch)])
        print(f"B. DINOv2 ViT-S/14 at 224 px: {len(images) / enc_s:.1f} img/s")

        for preset in [p for p in args.presets.split(",") if p]:
            m = eval_share(root, preset, args.every, args.eval_images, args.steps, args.train_batch)
            shares = ", ".join(f"every {k}: {m['eval_s'] / (m['eval_s'] + k * m['train_step_s']):.1%}"
                               for k in (100, 1000, 5000))
            print(f"C. {preset} U-Net, batch {args.train_batch}: {m['train_step_s']:.3f} s per training step, "
                  f"{m['eval_s']:.1f} s per evaluation of {args.eval_images} images ({args.steps} steps, FID/KID); "
                  f"measured share every {args.every} steps: {m['measured_share']:.1%}; at {shares}")


if __name__ == "__main__":
    main()
