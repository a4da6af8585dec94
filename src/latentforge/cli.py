"""The ``latentforge`` command: parse arguments -> build a config -> call one function.

Config values come from a recipe (``--recipe NAME|PATH``) and dotted overrides given as bare
``section.key=value`` arguments (``ingest.image.resolution=32``); the few flags below are
shortcuts for the most common overrides. Bad input ends in one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
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
