"""The ``latentforge`` command: parse arguments -> build a config -> call one function.

Config values come from a recipe (``--recipe NAME|PATH``) and dotted overrides given as bare
``section.key=value`` arguments (``ingest.image.resolution=32``); the few flags below are
shortcuts for the most common overrides. Bad input ends in one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from typing import Callable

from latentforge import __version__
from latentforge.errors import UserError

_OVERRIDE = re.compile(r"^[A-Za-z_][\w]*(\.[\w]+)*=")


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    args, overrides = [], []
    for tok in argv:
        (overrides if _OVERRIDE.match(tok) else args).append(tok)
    return args, overrides


def _recipe(ns: argparse.Namespace, overrides: list[str], shortcuts: dict[str, object]):
    from latentforge.recipe import load_recipe

    extra = [f"{k}={json.dumps(v)}" for k, v in shortcuts.items() if v is not None]
    return load_recipe(ns.recipe, extra + overrides)  # explicit key=value wins over a shortcut flag


def cmd_synth(ns, overrides):
    from latentforge.data.synth import generate

    recipe = _recipe(ns, overrides, {"synth.num": ns.num, "synth.seed": ns.seed, "synth.image_size": ns.size})
    summary = generate(ns.out, recipe.synth, progress=not ns.quiet)
    print(json.dumps({k: summary[k] for k in summary if k in ("num_train", "num_heldout", "heldout")}, default=str))


def cmd_ingest(ns, overrides):
    from latentforge.data.ingest import ingest

    recipe = _recipe(ns, overrides, {"ingest.image.resolution": ns.resolution, "ingest.num_workers": ns.workers})
    summary = ingest(ns.sources, ns.out, recipe.ingest, progress=not ns.quiet)
    rej = ", ".join(f"{k} {v}" for k, v in summary["rejected"].items()) or "none"
    print(f"ingest: seen {summary['seen']}, written {summary['written']} in {summary['num_shards']} shards, "
          f"rejected {summary['num_rejected']} ({rej}); {summary.get('img_per_s')} img/s -> {ns.out}")


def cmd_encode(ns, overrides):
    from latentforge.data.encode import encode_dataset

    recipe = _recipe(ns, overrides, {"encode.vae": ns.vae, "encode.text_encoder": ns.text_encoder,
                                     "encode.batch_size": ns.batch_size})
    summary = encode_dataset(ns.raw_dir, ns.out, recipe.encode, progress=not ns.quiet)
    print(f"encode: seen {summary['seen']}, written {summary['written']}, rejected "
          f"{sum(summary['rejected'].values())} -> {ns.out}")


def cmd_train_vae(ns, overrides):
    from latentforge.train.vae import train_vae

    shortcuts = {"vae.steps": ns.steps, "vae.eval_dataset": ns.eval}
    if ns.raw_dir:
        shortcuts["vae.data.datasets"] = [{"path": p} for p in ns.raw_dir]
    recipe = _recipe(ns, overrides, shortcuts)
    if not recipe.vae.data.datasets:
        raise UserError("train-vae: give RAW_DIR (raw shards from ingest) or set vae.data.datasets")
    m = train_vae(recipe.vae, ns.out, progress=not ns.quiet)
    psnr = f"{m['heldout_psnr']:.2f} dB" if m["heldout_psnr"] is not None else "not measured (no --eval)"
    print(f"train-vae: {m['steps']} steps in {m['train_seconds']} s, held-out PSNR {psnr}, "
          f"scaling_factor {m['scaling_factor']:.4f} -> {ns.out}")


def cmd_train(ns, overrides):
    from latentforge.distributed.env import close_world, init_world
    from latentforge.train.run import RunConfig, train

    recipe = _recipe(ns, overrides, {})
    world = init_world(recipe.train.device)  # torchrun / SLURM: RANK, WORLD_SIZE; else one process
    if not world.is_main:  # rank 0 speaks for every rank; the others only report errors
        logging.getLogger("latentforge").setLevel(logging.ERROR)
    try:
        summary = train(RunConfig(train=recipe.train, data=recipe.loader), ns.run_dir, resume=ns.resume,
                        progress=not ns.quiet, world=world)
    finally:
        close_world()
    if not world.is_main:
        return
    state = "finished" if summary["finished"] else "stopped early (rerun to continue)"
    print(f"train: {state} at step {summary['step']} in {summary['seconds']:.0f} s -> {ns.run_dir}")


def cmd_sample(ns, overrides):
    from pathlib import Path

    from latentforge.inference import generate, load_components, make_grid

    comps = load_components(ns.checkpoint, use_ema=not ns.no_ema)
    prompts = [p for p in ns.prompt for _ in range(ns.num_per_prompt)]
    images = generate(comps.unet, comps.vae, comps.text_model, comps.tokenizer, comps.noise, comps.max_length,
                      prompts, seed=ns.seed, num_steps=ns.steps, guidance_scale=ns.cfg, sampler=ns.sampler)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    for i, img in enumerate(images):
        img.save(out / f"{i:04d}.png")
    make_grid(images, prompts, scale=max(1, 128 // images[0].width)).save(out / "grid.png")
    (out / "prompts.txt").write_text("\n".join(prompts) + "\n")
    print(f"sample: {len(images)} images and grid.png -> {out}")


def cmd_export(ns, overrides):
    from latentforge.export.diffusers_pipeline import export_pipeline

    out = export_pipeline(ns.checkpoint, ns.out, use_ema=not ns.no_ema, scheduler=ns.scheduler)
    print(f"export: diffusers StableDiffusionPipeline -> {out}")


def cmd_demo(ns, overrides):
    from latentforge.demo import run_demo

    recipe = _recipe(ns, overrides, {})
    run_demo(recipe, ns.out, progress=not ns.quiet)


def cmd_config(ns, overrides):
    import yaml

    from latentforge.config import to_dict

    recipe = _recipe(ns, overrides, {})
    print(yaml.safe_dump(to_dict(recipe), sort_keys=False), end="")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="latentforge",
        description="Train a Stable-Diffusion-class text-to-image model from scratch on your own images. "
        "Config overrides are given as bare key=value arguments, e.g. ingest.image.resolution=32.",
    )
    p.add_argument("--version", action="version", version=f"latentforge {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, fn: Callable, help: str, parent=sub) -> argparse.ArgumentParser:
        sp = parent.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn)
        sp.add_argument("--recipe", help="recipe name (recipes/NAME.yaml) or path to a YAML recipe")
        sp.add_argument("--quiet", action="store_true", help="no progress bars")
        return sp

    data = sub.add_parser("data", help="built-in datasets", description="Built-in datasets.")
    data_sub = data.add_subparsers(dest="data_command", metavar="DATA_COMMAND")
    sp = add("synth", cmd_synth, "generate the built-in captioned shapes dataset (an image folder with .txt captions)",
             data_sub)
    sp.add_argument("--out", required=True, help="output directory")
    sp.add_argument("--num", type=int, help="number of training images (synth.num)")
    sp.add_argument("--seed", type=int, help="random seed (synth.seed)")
    sp.add_argument("--size", type=int, help="image side in px (synth.image_size)")

    sp = add("ingest", cmd_ingest, "image folders / WebDataset tars / parquet (local or s3://) -> raw shards, "
             "with filters, a ledger of rejected samples and summary.json; resumable")
    sp.add_argument("sources", nargs="+", metavar="SOURCE", help="folder, .tar, .parquet, or s3://bucket/prefix")
    sp.add_argument("--out", required=True, help="output directory (local)")
    sp.add_argument("--resolution", type=int, help="target side in px (ingest.image.resolution)")
    sp.add_argument("--workers", type=int, help="worker processes, 0 = one per core (ingest.num_workers)")

    sp = add("encode", cmd_encode, "raw shards -> latent shards (VAE latents + text embeddings); resumable per shard")
    sp.add_argument("raw_dir", metavar="RAW_DIR", help="raw shards written by ingest (local or s3://)")
    sp.add_argument("--vae", help="diffusers AutoencoderKL directory or hub id (encode.vae)")
    sp.add_argument("--text-encoder", dest="text_encoder", help="transformers text encoder directory or hub id")
    sp.add_argument("--out", required=True, help="output directory (local)")
    sp.add_argument("--batch-size", dest="batch_size", type=int, help="encode.batch_size")

    sp = add("train-vae", cmd_train_vae, "train a small AutoencoderKL from scratch on raw shards; measures the latent "
             "scale factor and writes a diffusers VAE directory")
    sp.add_argument("raw_dir", nargs="*", metavar="RAW_DIR", help="raw shards written by ingest")
    sp.add_argument("--out", required=True, help="output directory (a diffusers AutoencoderKL)")
    sp.add_argument("--eval", help="raw shards held out for the PSNR report (vae.eval_dataset)")
    sp.add_argument("--steps", type=int, help="optimizer steps (vae.steps)")

    sp = add("train", cmd_train, "train the latent diffusion U-Net on latent shards (phases, EMA, checkpoints); "
             "resumes from the newest complete checkpoint")
    sp.add_argument("run_dir", metavar="RUN_DIR", help="run directory: checkpoints, logs, samples")
    sp.add_argument("--resume", default="auto", help="auto (newest complete checkpoint), none, or a checkpoint dir")

    sp = add("sample", cmd_sample, "generate images and a grid from a checkpoint (or a run's newest one)")
    sp.add_argument("--checkpoint", required=True, help="checkpoint directory or run directory")
    sp.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    sp.add_argument("--out", default="samples", help="output directory")
    sp.add_argument("--cfg", type=float, default=5.0, help="classifier-free guidance scale")
    sp.add_argument("--steps", type=int, default=30, help="sampler steps")
    sp.add_argument("--sampler", default="ddim", choices=["ddim", "dpm++", "euler", "ddpm"])
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--num-per-prompt", dest="num_per_prompt", type=int, default=1)
    sp.add_argument("--no-ema", dest="no_ema", action="store_true", help="use the raw weights, not the EMA")

    sp = add("export", cmd_export, "write a diffusers StableDiffusionPipeline directory from a checkpoint")
    sp.add_argument("--checkpoint", required=True, help="checkpoint directory or run directory")
    sp.add_argument("--out", required=True, help="output directory (new)")
    sp.add_argument("--scheduler", default="ddim", choices=["ddim", "dpm++", "euler", "ddpm"])
    sp.add_argument("--no-ema", dest="no_ema", action="store_true", help="export the raw weights, not the EMA")

    sp = add("demo", cmd_demo, "the end-to-end demo on the built-in dataset (recipe tiny-cpu by default)")
    sp.add_argument("--out", default="runs/demo", help="output directory (default runs/demo); a rerun resumes")
    sp.set_defaults(recipe="tiny-cpu")

    cfg = sub.add_parser("config", help="show the resolved config of a recipe",
                         description="Print a recipe with its overrides applied and validated.")
    cfg_sub = cfg.add_subparsers(dest="config_command", metavar="CONFIG_COMMAND")
    add("show", cmd_config, "print the resolved recipe as YAML", cfg_sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, overrides = _split_overrides(argv)
    parser = build_parser()
    ns = parser.parse_args(args)
    if not hasattr(ns, "fn"):
        # `latentforge` or `latentforge data` alone: show the help of that level.
        parser.parse_args(args + ["--help"])
        return 2
    try:
        ns.fn(ns, overrides)
    except UserError as e:
        print(f"latentforge: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("latentforge: interrupted (rerun the same command to resume)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
