"""The ``latentforge`` command: parse arguments -> build a config -> call one function.

Config values come from a recipe (``--recipe NAME|PATH``) and dotted overrides given as bare
``section.key=value`` arguments (``ingest.image.resolution=32``); the few flags below are
shortcuts for the most common overrides. Bad input ends in one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path
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
    counts, out = summary["counts"], ns.out.rstrip("/")
    print(f"synth: {counts['train']} training images in {out}/train, {counts['heldout']} held-out images in "
          f"{out}/heldout ({len(summary['heldout_combos'])} colour/shape combinations never in train); "
          f"ingest {out}/train alone to train")


def cmd_ingest(ns, overrides):
    from latentforge.data.ingest import ingest

    recipe = _recipe(ns, overrides, {"ingest.image.resolution": ns.resolution, "ingest.num_workers": ns.workers})
    summary = ingest(ns.sources, ns.out, recipe.ingest, progress=not ns.quiet, lock="latentforge ingest")
    rej = ", ".join(f"{k} {v}" for k, v in summary["rejected"].items()) or "none"
    print(f"ingest: seen {summary['seen']}, written {summary['written']} in {summary['num_shards']} shards, "
          f"rejected {summary['num_rejected']} ({rej}); {summary.get('img_per_s')} img/s -> {ns.out}")
    if not summary["written"]:  # nothing to train on: a job that goes on to encode must not take this for success
        why = f"{ns.out}/rejected.jsonl says why" if summary["seen"] else "its sources hold no sample"
        print(f"latentforge: error: ingest wrote no sample ({why})", file=sys.stderr)
        return 2


def _pipeline_caption_length(base: str) -> int | None:
    """The caption length a diffusers pipeline directory's tokenizer declares (``model_max_length``
    in ``tokenizer/tokenizer_config.json``: 77 for SD's CLIP, the trained length for a latentforge
    export), or None when it declares none."""
    try:
        n = json.loads((Path(base) / "tokenizer" / "tokenizer_config.json").read_text()).get("model_max_length")
    except (OSError, ValueError, AttributeError):
        return None
    return int(n) if isinstance(n, (int, float)) and 0 < n < 1e29 else None  # ~1e30: "no limit"


def _recipe_sets(ns: argparse.Namespace, overrides: list[str], key: str) -> bool:
    """Does the user set ``section.field`` ``key``, on the command line or in the recipe file?"""
    from latentforge.config import load_yaml
    from latentforge.recipe import resolve_recipe_path

    section, name = key.split(".")
    if any(o.startswith((f"{key}=", f"{section}=")) for o in overrides):
        return True
    return bool(ns.recipe) and name in (load_yaml(resolve_recipe_path(ns.recipe)).get(section) or {})


def cmd_encode(ns, overrides):
    from latentforge.data.encode import encode_dataset

    if ns.base and not _recipe_sets(ns, overrides, "encode.max_length"):
        # The pipeline's own caption length, unless the user sets one (encode.max_length defaults to SD's 77).
        overrides = [f"encode.max_length={n}" for n in [_pipeline_caption_length(ns.base)] if n] + overrides
    if ns.base and (ns.vae or ns.text_encoder):
        raise UserError("encode: --from takes the VAE and text encoder from the pipeline; drop --vae/--text-encoder")
    # A pipeline directory holds vae/, text_encoder/ and tokenizer/: both loaders find their subfolder.
    recipe = _recipe(ns, overrides, {"encode.vae": ns.vae or ns.base, "encode.text_encoder": ns.text_encoder or ns.base,
                                     "encode.batch_size": ns.batch_size,
                                     "encode.attention_mask": "pipeline" if ns.base else None})
    if not recipe.encode.text_encoder and recipe.encode.vae:
        from dataclasses import replace

        from latentforge.models.text import builtin_text_encoder

        recipe.encode = replace(recipe.encode, text_encoder=builtin_text_encoder())
        print(f"encode: no --text-encoder: the built-in all-MiniLM-L6-v2 ({recipe.encode.text_encoder})",
              file=sys.stderr)
    if ns.ray:
        from latentforge.distributed.ray_data import encode_on_ray

        summary = encode_on_ray(ns.raw_dir, ns.out, recipe.encode, _ray_config(ns), ns.num_actors or 1,
                                progress=not ns.quiet)
    else:
        _refuse_flags(ns, "encode", ("address", "num_actors"), "--ray")
        summary = encode_dataset(ns.raw_dir, ns.out, recipe.encode, progress=not ns.quiet, lock="latentforge encode")
    if summary.get("interrupted"):
        print(f"encode: interrupted by {summary['interrupted']}: the finished shards are kept in {ns.out}; "
              "rerun the same command to resume", flush=True)
        return _exit_code(summary)
    print(f"encode: seen {summary['seen']}, written {summary['written']}, rejected "
          f"{sum(summary['rejected'].values())} -> {ns.out}")
    if summary.get("truncated_captions"):
        print(f"encode: {summary['truncated_captions']} captions are longer than the text encoder's max_length "
              "(encode.max_length): their embeddings see its first tokens only (the shards keep the whole caption)")


def cmd_train_vae(ns, overrides):
    from latentforge.train.vae import train_vae

    shortcuts = {"vae.steps": ns.steps, "vae.eval_dataset": ns.eval}
    if ns.raw_dir:
        shortcuts["vae.data.datasets"] = [{"path": p} for p in ns.raw_dir]
    recipe = _recipe(ns, overrides, shortcuts)
    if not recipe.vae.data.datasets:
        raise UserError("train-vae: give RAW_DIR (raw shards from ingest) or set vae.data.datasets")
    m = train_vae(recipe.vae, ns.out, progress=not ns.quiet, lock="latentforge train-vae")
    if m.get("interrupted"):
        saved = f"saved step {m['steps']}" if m["saved"] else "nothing to save"
        print(f"train-vae: interrupted by {m['interrupted']}: {saved} -> {ns.out}/checkpoints; "
              "rerun the same command to resume", flush=True)
        return _exit_code(m)
    psnr = f"{m['heldout_psnr']:.2f} dB" if m["heldout_psnr"] is not None else "not measured (no --eval)"
    print(f"train-vae: {m['steps']} steps in {m['train_seconds']} s, held-out PSNR {psnr}, "
          f"scaling_factor {m['scaling_factor']:.4f} -> {ns.out}")


def cmd_train(ns, overrides):
    from latentforge.distributed.env import close_world, init_world
    from latentforge.distributed.parallelize import needs_single_rank_group
    from latentforge.storage import refuse_foreign_dir
    from latentforge.train.run import RunConfig, train

    recipe = _recipe(ns, overrides, {"train.init_from": getattr(ns, "base", None)})
    if os.path.exists(ns.run_dir) and not os.path.isdir(ns.run_dir):
        raise UserError(f"{ns.run_dir}: is a file; RUN_DIR names a run directory")
    refuse_foreign_dir(ns.run_dir, ("train_config.yaml", "checkpoints"), "training run")
    if getattr(ns, "ray", False) or getattr(ns, "online_encode", False):
        return _train_on_ray(ns, recipe)
    if hasattr(ns, "ray"):  # train (finetune has no Ray flags)
        _refuse_flags(ns, "train", ("address", "num_workers", "gpus_per_worker", "cpus_per_worker",
                                    "max_failures", "storage", "num_actors"), "--ray or --online-encode")
    # torchrun / SLURM: RANK, WORLD_SIZE; else one process (with a one-rank group for FSDP2 CPU offload)
    world = init_world(recipe.train.device, single_rank_group=needs_single_rank_group(recipe.train.parallel))
    if not world.is_main:  # rank 0 speaks for every rank; the others only report errors
        logging.getLogger("latentforge").setLevel(logging.ERROR)
    try:
        # One run at a time in a run directory (a second launch, a requeue while the first still runs): rank 0
        # holds its lock; a rank 0 refused ends the job, as torchrun stops the other ranks with it.
        summary = train(RunConfig(train=recipe.train, data=recipe.loader, eval=recipe.eval), ns.run_dir,
                        resume=ns.resume, progress=not ns.quiet, world=world, lock=f"latentforge {ns.command}")
    finally:
        close_world()
    if not world.is_main:
        return _exit_code(summary)
    return _report_train(summary, ns.run_dir)


def _exit_code(summary: dict) -> int:
    from latentforge.interrupt import EXIT_INTERRUPTED

    return EXIT_INTERRUPTED if summary.get("interrupted") else 0


def _report_train(summary: dict, run_dir: str, where: str = "") -> int:
    """The last line of train / finetune; exit code 75 after a stop on a signal (requeue)."""
    from latentforge import checkpoint as ckpt

    took = f"; checkpoints took up to {summary['checkpoint_seconds']:.1f} s" if summary.get("checkpoint_seconds") else ""
    if summary.get("interrupted"):
        latest = ckpt.find_latest(run_dir)
        saved = (f"saved step {summary['step']}" if latest is not None and latest.name == ckpt.checkpoint_dir_name(
            summary["step"]) else f"nothing to save at step {summary['step']}")
        print(f"train: interrupted by {summary['interrupted']}: {saved}{where} -> {run_dir}; "
              f"rerun the same command to resume{took}", flush=True)
        return _exit_code(summary)
    state = "finished" if summary["finished"] else "stopped early (rerun to continue)"
    print(f"train: {state} at step {summary['step']} in {summary['seconds']:.0f} s{where} -> {run_dir}{took}")
    return 0


def _ray_config(ns):
    from latentforge.distributed.ray_cluster import RayConfig

    given = {k: getattr(ns, k) for k in ("address", "num_workers", "gpus_per_worker", "cpus_per_worker",
                                         "max_failures", "storage") if getattr(ns, k, None) is not None}
    return RayConfig(**given)


def _train_on_ray(ns, recipe):
    """``train --ray`` (Ray Train workers) and/or ``--online-encode`` (Ray encoder actors)."""
    from latentforge.distributed.ray_cluster import ray_session
    from latentforge.distributed.ray_launch import train_on_ray
    from latentforge.train.run import RunConfig, train

    cfg = RunConfig(train=recipe.train, data=recipe.loader, eval=recipe.eval)
    ray_cfg = _ray_config(ns)
    online = (recipe.encode, ns.num_actors or 1) if ns.online_encode else None
    if ns.ray:
        if ns.resume != "auto":
            raise UserError("train --ray: always resumes from the newest complete checkpoint (--resume auto)")
        summary = train_on_ray(cfg, ns.run_dir, ray_cfg, ns.quiet, online=online)
    else:  # one training process, encoder actors on a local Ray instance or --address
        from pathlib import Path

        from latentforge.distributed.ray_data import OnlineSource

        source = OnlineSource(online[0], online[1], ray_cfg)
        with ray_session(ray_cfg, Path(ns.run_dir), ns.quiet):
            summary = train(cfg, ns.run_dir, resume=ns.resume, progress=not ns.quiet, source=source)
    return _report_train(summary, ns.run_dir, " on Ray")


def _refuse_flags(ns, command: str, names: tuple[str, ...], needs: str) -> None:
    given = [f"--{n.replace('_', '-')}" for n in names if getattr(ns, n, None) is not None]
    if given:
        raise UserError(f"{command}: {', '.join(given)} {'is' if len(given) == 1 else 'are'} only used with {needs}")


def _add_ray_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--ray", action="store_true", help="run on Ray (a local instance unless --address)")
    sp.add_argument("--address", help="Ray cluster address (host:6379, ray://host:10001 or auto)")


def cmd_sample(ns, overrides):
    from pathlib import Path

    from latentforge.errors import UserError
    from latentforge.inference import generate, load_components, make_grid

    _no_recipe(ns, overrides, "sample")
    out = Path(ns.out)
    if out.exists() and not out.is_dir():  # before the images are made, not after
        raise UserError(f"{out}: is a file; --out names a directory")
    if (out / "grid.png").exists() and not ns.overwrite:
        raise UserError(f"{out}: already holds samples (grid.png); choose another --out or pass --overwrite")
    if ns.num_per_prompt < 1:
        raise UserError(f"--num-per-prompt: must be at least 1, got {ns.num_per_prompt}")
    from latentforge.storage import as_utf8

    for p in ns.prompt:  # a terminal in another encoding passes bytes that are not UTF-8 (kept as surrogates)
        if as_utf8(p) != p:
            raise UserError(f'--prompt "{as_utf8(p)}": not UTF-8 text; set the terminal\'s encoding to UTF-8')
    comps = load_components(ns.checkpoint, use_ema=not ns.no_ema, sampler=ns.sampler)
    prompts = [p for p in ns.prompt for _ in range(ns.num_per_prompt)]
    images = generate(comps.unet, comps.vae, comps.text_model, comps.tokenizer, comps.noise, comps.max_length,
                      prompts, seed=ns.seed, num_steps=ns.steps, guidance_scale=ns.cfg, sampler=ns.sampler,
                      progress=not ns.quiet)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("[0-9][0-9][0-9][0-9].png"):  # --overwrite: an earlier, longer set leaves none behind
        old.unlink()
    for i, img in enumerate(images):
        img.save(out / f"{i:04d}.png")
    make_grid(images, prompts, scale=max(1, 128 // images[0].width)).save(out / "grid.png")
    (out / "prompts.txt").write_text("\n".join(prompts) + "\n")
    print(f"sample: {len(images)} images and grid.png -> {out}")


def _no_recipe(ns: argparse.Namespace, overrides: list[str], command: str) -> None:
    """``sample`` and ``export`` use the run's own config: a recipe or override given to them would
    be ignored, so it is refused."""
    given = ([f"--recipe {ns.recipe}"] if ns.recipe else []) + overrides
    if given:
        raise UserError(f"{command}: takes no recipe or key=value overrides (it uses the run's own config), got "
                        f"{' '.join(given)}")


def cmd_export(ns, overrides):
    from latentforge.export.diffusers_pipeline import export_pipeline

    _no_recipe(ns, overrides, "export")
    out = export_pipeline(ns.checkpoint, ns.out, use_ema=not ns.no_ema, scheduler=ns.scheduler,
                          lora_file=ns.lora_file)
    pipeline = json.loads((out / "latentforge_export.json").read_text())["pipeline"]
    what = f"LoRA weights for {pipeline}.load_lora_weights" if ns.lora_file else f"diffusers {pipeline}"
    print(f"export: {what} -> {out}")


def _float_list(text: str, flag: str = "--cfg", example: str = "1,2,4,8") -> list[float]:
    """Comma-separated numbers (an empty item is a typo, not a request: refused)."""
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise UserError(f"{flag}: expected comma-separated numbers, e.g. {example}; got {text!r}") from None


def cmd_eval(ns, overrides):
    from latentforge.distributed.env import close_world, init_world, read_env
    from latentforge.evaluate.eval import evaluate

    recipe = _recipe(ns, overrides, {
        "eval.checkpoint": ns.checkpoint, "eval.prompts": ns.prompts, "eval.reference": ns.reference,
        "eval.inception": ns.inception, "eval.clip": ns.clip, "eval.fd_encoders": ns.fd_encoder,
        "eval.guidance_scales": _float_list(ns.cfg) if ns.cfg else None, "eval.num_images": ns.num_images,
        "eval.num_steps": ns.steps, "eval.sampler": ns.sampler, "eval.seed": ns.seed,
        "eval.batch_size": ns.batch_size, "eval.use_ema": False if ns.no_ema else None})
    # torchrun: prompts split across ranks, rank 0 measures; a plain process needs no process group.
    world = init_world(recipe.eval.device) if read_env().world_size > 1 else None
    try:
        results = evaluate(recipe.eval, ns.out, progress=not ns.quiet, world=world, lock="latentforge eval")
    finally:
        if world is not None:
            close_world()
    if results is None:
        return
    from latentforge.evaluate.eval import results_table

    print(results_table(results["rows"], results["warnings"]), end="")
    print(f"eval: {len(results['rows'])} guidance scales -> {ns.out}/results.md, results.json")


def cmd_report(ns, overrides):
    from pathlib import Path

    from latentforge.evaluate.curve import run_total_samples, write_quality_report

    run = Path(ns.run_dir)
    plan = None
    if overrides and not ns.recipe:
        raise UserError(f"report: key=value overrides apply to a --recipe's plan; give one, or drop {overrides[0]}")
    if not ns.recipe:
        _refuse_flags(ns, "report", ("gpu", "gpus", "price", "throughput"), "--recipe (the plan they describe)")
    if ns.recipe:  # where the full recipe's budget would end on the planned cluster
        from latentforge.plan import cost
        from latentforge.plan.report import plan_config
        from latentforge.plan.shapes import recipe_phases

        recipe = _recipe(ns, overrides, {})
        cfg, _ = plan_config(recipe.plan, gpu=ns.gpu, gpus=ns.gpus, price=ns.price, throughput=ns.throughput)
        plan = cost.plan_run(recipe_phases(recipe), cfg, cfg.gpus[0])
    path = write_quality_report(run, run_total_samples(run), plan)
    print(f"report: quality against training images, GPU-hours and dollars -> {path}")


def cmd_demo(ns, overrides):
    from latentforge.demo import pin_judge, rescore_demo, rescore_table, run_demo

    if ns.pin_judge is not None and ns.rescore is not None:
        raise UserError("demo: --pin-judge trains a judge for a recipe, --rescore scores a finished demo; give one")
    for flag, value in (("--out", ns.out), ("--pin-judge", ns.pin_judge)):
        if value is not None and not value.strip():
            raise UserError(f"demo {flag}: empty; give a directory")
    if ns.rescore is not None:
        if ns.recipe:
            raise UserError(f"demo --rescore reads the recipe the demo ran with ({ns.out}/recipe.yaml); leave out --recipe")
        scales = _float_list(ns.rescore, "--rescore", "2,3,4")
        result = rescore_demo(ns.out, scales, overrides, progress=not ns.quiet)
        print(rescore_table(result), end="")
        print(f"demo --rescore: {len(scales)} guidance scales -> {ns.out}/rescore/rescore.md, results.json")
        return
    ns.recipe = ns.recipe or "tiny-cpu"
    recipe = _recipe(ns, overrides, {})
    if ns.pin_judge is not None:
        path, report = pin_judge(recipe, ns.pin_judge, progress=not ns.quiet)
        print(f"demo --pin-judge: the judge of recipe {ns.recipe} ({report['train_images']} renders + "
              f"{report['train_nonshapes']} non-shapes, trained in {report['seconds']} s) -> {path}; set "
              f"demo.pinned_judge={path} (the recipe's demo section) for the demo to use it")
        return
    return _exit_code(run_demo(recipe, ns.out, progress=not ns.quiet))  # 75 after an interrupt, like train


def _output_file(path: str, flag: str, suffixes: tuple[str, ...] = ()) -> None:
    """Checked before the work that fills it: a directory, a missing parent or a format the
    writer cannot make would otherwise lose the result at the end."""
    p = Path(path)
    try:
        if p.is_dir() or path.endswith("/"):
            raise UserError(f"{flag} {path}: is a directory; give a file name")
        if not p.parent.is_dir():
            raise UserError(f"{flag} {path}: no directory {p.parent}")
    except OSError as e:
        raise UserError(f"{flag} {path[:80]}{'...' if len(path) > 80 else ''}: {e.strerror}") from None
    if suffixes and p.suffix.lower() not in suffixes:
        raise UserError(f"{flag} {path}: give a file ending in {' or '.join(suffixes)}")


def cmd_bench(ns, overrides):
    from latentforge.plan.bench import run_bench

    if ns.synthetic and ns.real_data:
        raise UserError("bench: --synthetic and --real-data contradict each other; give one")
    _output_file(ns.out, "--out", (".json",))  # JSON that plan --throughput reads (and never the recipe's YAML)
    recipe = _recipe(ns, overrides, {})
    synthetic = True if ns.synthetic else (False if ns.real_data else None)
    result = run_bench(recipe, steps=ns.steps, warmup=ns.warmup, synthetic=synthetic, progress=True)
    with open(ns.out, "w") as f:
        json.dump(result, f, indent=1)
    data = ("synthetic batches of the recipe's shapes" + ("" if ns.synthetic else " (its datasets do not exist)")
            if result["synthetic"] else "the recipe's datasets")
    print(f"bench: {result['device_name']} {result['precision']}, peak {result['peak_flops'] / 1e12:.3f} TFLOP/s "
          f"({result['peak_flops_source']}), data: {data}; memory: {result['memory_method']} -> {ns.out}")


def cmd_plan(ns, overrides):
    from latentforge.plan.report import cost_report, memory_report, plan_config

    memory_only = ("resolution", "micro_batch", "precision", "parallel", "activation_checkpointing", "optimizer",
                   "ema", "cpu_offload", "gpu_memory")
    if not ns.memory:
        _refuse_flags(ns, "plan", memory_only, "--memory")
        if ns.chart:
            _output_file(ns.chart, "--chart", (".png", ".pdf", ".svg"))
        if ns.json:
            _output_file(ns.json, "--json")
    else:
        _refuse_flags(ns, "plan --memory", ("gpus", "price", "throughput", "img_per_sec_per_gpu", "mfu",
                                            "scaling_efficiency", "goodput", "num_images",
                                            "encode_img_per_sec_per_gpu", "json"), "the cost plan (without --memory)")
        if ns.micro_batch is not None and ns.micro_batch < 1:
            raise UserError(f"plan: --micro-batch must be >= 1, got {ns.micro_batch}")
    recipe = _recipe(ns, overrides, {})
    flags = ("gpu", "gpus", "price", "throughput", "img_per_sec_per_gpu", "scaling_efficiency", "goodput",
             "num_images", "encode_img_per_sec_per_gpu", "mfu")
    cfg, source = plan_config(recipe.plan, **{k: getattr(ns, k) for k in flags})
    if ns.memory:
        setup = ("resolution", "micro_batch", "gpu_memory", "precision", "parallel", "world_size",
                 "activation_checkpointing", "optimizer", "ema", "cpu_offload")
        print(memory_report(recipe, cfg, **{k: getattr(ns, k) for k in setup}))
    else:
        print(cost_report(recipe, cfg, source, chart=ns.chart, json_path=ns.json))


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
    sp.add_argument("--from", dest="base", metavar="DIR",
                    help="a diffusers pipeline directory: encode with its vae/, text_encoder/ and tokenizer/ "
                         "(for fine-tuning it)")
    _add_ray_arguments(sp)
    sp.add_argument("--num-actors", dest="num_actors", type=int,
                    help="--ray: encoder actors, each with a copy of the VAE and text encoder (default 1)")

    sp = add("train-vae", cmd_train_vae, "train a small AutoencoderKL from scratch on raw shards; measures the latent "
             "scale factor and writes a diffusers VAE directory")
    sp.add_argument("raw_dir", nargs="*", metavar="RAW_DIR", help="raw shards written by ingest")
    sp.add_argument("--out", required=True, help="output directory (a diffusers AutoencoderKL)")
    sp.add_argument("--eval", help="raw shards held out for the PSNR report (vae.eval_dataset)")
    sp.add_argument("--steps", type=int, help="optimizer steps (vae.steps)")

    sp = add("train", cmd_train, "train the latent diffusion model (U-Net, or train.model=dit) on latent shards "
             "(phases, EMA, checkpoints); resumes from the newest complete checkpoint")
    sp.add_argument("run_dir", metavar="RUN_DIR", help="run directory: checkpoints, logs, samples")
    sp.add_argument("--resume", default="auto", help="auto (newest complete checkpoint), none, or a checkpoint dir")
    _add_ray_arguments(sp)
    sp.add_argument("--num-workers", dest="num_workers", type=int, help="--ray: training processes (default 1)")
    sp.add_argument("--gpus-per-worker", dest="gpus_per_worker", type=float,
                    help="--ray: GPUs per worker (default 1 if the cluster has GPUs, else 0)")
    sp.add_argument("--cpus-per-worker", dest="cpus_per_worker", type=float,
                    help="--ray: CPUs per worker (default 1 on a cluster; a share of the cores locally)")
    sp.add_argument("--max-failures", dest="max_failures", type=int,
                    help="--ray: restarts after a worker failure, each from the newest checkpoint (default 2)")
    sp.add_argument("--storage", help="--ray: Ray Train storage, a shared path or s3://bucket/prefix "
                    "(default RUN_DIR/ray); on S3 each checkpoint is uploaded")
    sp.add_argument("--online-encode", dest="online_encode", action="store_true",
                    help="the phases list raw datasets, encoded during training by Ray actors with the "
                    "recipe's encode section (VAE, text encoder)")
    sp.add_argument("--num-actors", dest="num_actors", type=int,
                    help="--online-encode: encoder actors per training process (default 1)")

    sp = add("finetune", cmd_train, "fine-tune a diffusers Stable Diffusion pipeline, or a PixArtAlphaPipeline with train.model=dit (full or "
             "LoRA with train.lora) "
             "on latent shards encoded with encode --from DIR; resumes like train")
    sp.add_argument("run_dir", metavar="RUN_DIR", help="run directory: checkpoints, logs, samples")
    sp.add_argument("--from", dest="base", metavar="DIR", required=True,
                    help="the diffusers pipeline directory to start from (train.init_from)")
    sp.add_argument("--resume", default="auto", help="auto (newest complete checkpoint), none, or a checkpoint dir")

    sp = add("sample", cmd_sample, "generate images and a grid from a checkpoint (or a run's newest one)")
    sp.add_argument("--checkpoint", required=True, help="checkpoint directory or run directory")
    sp.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    sp.add_argument("--out", default="samples", help="output directory")
    sp.add_argument("--cfg", type=float, default=5.0, help="classifier-free guidance scale")
    sp.add_argument("--steps", type=int, default=30, help="sampler steps")
    sp.add_argument("--sampler", default="ddim", choices=["ddim", "dpm++", "euler", "ddpm"],
                    help="a flow_matching model: euler = FlowMatchEulerDiscreteScheduler, ddim / dpm++ = "
                         "DPM-Solver order 1 / 2 on flow sigmas, no ddpm")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--num-per-prompt", dest="num_per_prompt", type=int, default=1)
    sp.add_argument("--no-ema", dest="no_ema", action="store_true", help="use the raw weights, not the EMA")
    sp.add_argument("--overwrite", action="store_true", help="replace the samples already in --out")

    sp = add("export", cmd_export,
             "write a diffusers pipeline directory from a checkpoint (StableDiffusionPipeline; PixArtAlphaPipeline "
             "for a train.model=dit run)")
    sp.add_argument("--checkpoint", required=True, help="checkpoint directory or run directory")
    sp.add_argument("--out", required=True, help="output directory (new)")
    sp.add_argument("--scheduler", default="ddim", choices=["ddim", "dpm++", "euler", "ddpm"],
                    help="a flow_matching model: ddim or dpm++ (their flow forms; StableDiffusionPipeline cannot "
                         "run the flow euler)")
    sp.add_argument("--no-ema", dest="no_ema", action="store_true", help="export the raw weights, not the EMA")
    sp.add_argument("--lora-file", dest="lora_file", action="store_true",
                    help="LoRA runs: write only the adapter file (load_lora_weights), not the merged pipeline")

    sp = add("eval", cmd_eval, "FID/KID (Inception-v3), Fréchet distance in other encoders' features and CLIP score "
             "of a checkpoint or diffusers directory on your prompts and reference images; resumable")
    sp.add_argument("--checkpoint", help="checkpoint, run or exported diffusers directory (eval.checkpoint)")
    sp.add_argument("--prompts", help="prompt file (.txt, .jsonl, .parquet) or raw shards from ingest (eval.prompts)")
    sp.add_argument("--reference", help="reference images: raw shards or an image folder (eval.reference)")
    sp.add_argument("--inception", help="FID/KID Inception-v3 weights file, e.g. pt_inception-2015-12-05-6726825d.pth")
    sp.add_argument("--clip", help="CLIP model directory for the CLIP score (eval.clip)")
    sp.add_argument("--fd-encoder", dest="fd_encoder", action="append",
                    help="image encoder directory (DINOv2, CLIP) for FD in its features; repeat for several")
    sp.add_argument("--cfg", help="guidance scales, e.g. 1,2,4,8 (eval.guidance_scales)")
    sp.add_argument("--num-images", dest="num_images", type=int, help="images per guidance scale (eval.num_images)")
    sp.add_argument("--steps", type=int, help="sampler steps (eval.num_steps)")
    sp.add_argument("--sampler", choices=["ddim", "dpm++", "euler", "ddpm"], help="eval.sampler")
    sp.add_argument("--seed", type=int, help="eval.seed")
    sp.add_argument("--batch-size", dest="batch_size", type=int, help="eval.batch_size")
    sp.add_argument("--no-ema", dest="no_ema", action="store_true", help="use the raw weights, not the EMA")
    sp.add_argument("--out", required=True, help="output directory: images, results.md/json, tradeoff.png; a rerun resumes")

    sp = add("report", cmd_report, "quality against training images, GPU-hours and dollars of a run evaluated during "
             "training (train.eval.every_steps) and its validation loss (train.val): markdown + PNG per metric; "
             "with --recipe, the recipe's planned cost")
    sp.add_argument("run_dir", metavar="RUN_DIR", help="a training run directory with eval.jsonl and/or val.jsonl")
    sp.add_argument("--gpu", help="with --recipe: GPU type of the plan (plan.gpu)")
    sp.add_argument("--gpus", help="with --recipe: GPU count of the plan (the first of plan.gpus)")
    sp.add_argument("--price", type=float, help="with --recipe: dollars per GPU-hour (plan.price_per_gpu_hour)")
    sp.add_argument("--throughput", help="with --recipe: a JSON written by latentforge bench on the target GPU")

    sp = add("demo", cmd_demo, "the end-to-end demo on the built-in dataset (recipe tiny-cpu by default)")
    sp.add_argument("--out", default="runs/demo", help="output directory (default runs/demo); a rerun resumes")
    sp.add_argument("--rescore", metavar="G1,G2,...",
                    help="no training: score the finished demo in --out again at these guidance scales, e.g. 2,3,4, "
                         "with its own recipe, prompts and judge (-> OUT/rescore/rescore.md); only demo.* overrides, e.g. "
                         "demo.sampler=dpm++ demo.num_steps=40")
    sp.add_argument("--pin-judge", metavar="DIR",
                    help="no demo: train the judge of the recipe's demo.judge settings on its built-in data into DIR, "
                         "once, for demo.pinned_judge (the shipped recipes/judges/tiny-cpu was written so)")

    sp = add("bench", cmd_bench, "time the real training step of a recipe on this machine: img/s per device, MFU, "
             "peak memory; writes JSON that plan --throughput reads")
    sp.add_argument("--steps", type=int, default=10, help="timed steps per phase (default 10)")
    sp.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    sp.add_argument("--out", default="bench.json", help="output JSON (default bench.json)")
    sp.add_argument("--synthetic", action="store_true",
                    help="random latents and text states of the recipe's shapes (default when its datasets do not exist)")
    sp.add_argument("--real-data", dest="real_data", action="store_true", help="require the recipe's datasets")

    sp = add("plan", cmd_plan, "GPU-hours, days and cost of a recipe's phases on a cluster (table + PNG chart); "
             "with --memory, the peak device memory of a set-up and whether it fits")
    sp.add_argument("--gpus", help="GPU counts, e.g. 8,16,32,64,128,256 (plan.gpus)")
    sp.add_argument("--gpu", help="GPU type, e.g. a100-80g, h100-sxm (plan.gpu)")
    sp.add_argument("--price", type=float, help="dollars per GPU-hour (plan.price_per_gpu_hour)")
    sp.add_argument("--throughput", help="a JSON written by latentforge bench on the target GPU")
    sp.add_argument("--img-per-sec-per-gpu", dest="img_per_sec_per_gpu",
                    help="training img/s per GPU by resolution, e.g. 256:137.5,512:36.3")
    sp.add_argument("--mfu", type=float,
                    help="instead of throughputs: an assumed MFU in (0, 1], e.g. 0.4; each phase's img/s per GPU is "
                         "derived from it and the phase's FLOPs per image (masked phases counted masked)")
    sp.add_argument("--scaling-efficiency", dest="scaling_efficiency",
                    help="one number, or GPUS:EFFICIENCY points interpolated in log2(GPUs), e.g. 8:1.0,128:0.9")
    sp.add_argument("--goodput", type=float, help="fraction of paid time that trains, in (0, 1] (default 1.0)")
    sp.add_argument("--num-images", dest="num_images", type=int, help="distinct images to encode (plan.num_images)")
    sp.add_argument("--encode-img-per-sec-per-gpu", dest="encode_img_per_sec_per_gpu", type=float,
                    help="encoding img/s per GPU (default 58.0: MosaicML's 790M images in 3,784 A100-hours)")
    sp.add_argument("--chart", default="plan.png", help="PNG of days and cost against GPUs (default plan.png; '' = none)")
    sp.add_argument("--json", help="also write the plan as JSON here")
    sp.add_argument("--memory", action="store_true", help="predict peak device memory instead of cost")
    sp.add_argument("--resolution", type=int, help="--memory: image side in px (default: the last phase's)")
    sp.add_argument("--micro-batch", dest="micro_batch", type=int, help="--memory: micro batch per rank")
    # The set-up flags default to the recipe's train section (parallel, precision, optim, ema).
    sp.add_argument("--precision", choices=["fp32", "bf16", "bf16-weights"],
                    help="--memory: fp32, bf16 autocast over fp32 weights, or bf16 weights + fp32 master")
    sp.add_argument("--parallel", choices=["ddp", "fsdp-grad-op", "fsdp-full"], help="--memory")
    sp.add_argument("--world-size", dest="world_size", type=int, default=1, help="--memory: ranks")
    sp.add_argument("--activation-checkpointing", dest="activation_checkpointing",
                    action=argparse.BooleanOptionalAction,
                    help="--memory: recompute each U-Net block in the backward pass")
    sp.add_argument("--cpu-offload", dest="cpu_offload", action=argparse.BooleanOptionalAction,
                    help="--memory: FSDP2 CPU offload (weights, gradients, optimizer state in host memory)")
    sp.add_argument("--optimizer", choices=["adamw", "adamw8bit", "muon"], help="--memory")
    sp.add_argument("--ema", choices=["same", "cpu", "off"], help="--memory: where the EMA lives")
    sp.add_argument("--gpu-memory", dest="gpu_memory", type=float, help="--memory: device memory in GB (default: --gpu's)")

    cfg = sub.add_parser("config", help="show the resolved config of a recipe",
                         description="Print a recipe with its overrides applied and validated.")
    cfg_sub = cfg.add_subparsers(dest="config_command", metavar="CONFIG_COMMAND")
    add("show", cmd_config, "print the resolved recipe as YAML", cfg_sub)
    return p


def _quiet_libraries() -> None:
    """--quiet: no progress bars from the libraries either (transformers' weight loading reads the
    hub's setting when it is imported; if it already is, its own switch)."""
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()


# Where each command writes (run_dir: of train and finetune only; report reads one).
_OUTPUTS = {"out": "--out", "chart": "--chart", "json": "--json", "pin_judge": "--pin-judge"}


def _check_local_outputs(ns: argparse.Namespace) -> None:
    """Every command writes to local paths (Ray Train uploads checkpoints with --storage): an
    ``s3://`` output would otherwise become a local folder named ``s3:``."""
    flags = dict(_OUTPUTS, **({"run_dir": "RUN_DIR"} if ns.fn is cmd_train else {}))
    for attr, flag in flags.items():
        value = getattr(ns, attr, None)
        if isinstance(value, str) and "://" in value:
            where = " (--storage s3://... uploads a Ray run's checkpoints)" if ns.fn is cmd_train else ""
            raise UserError(f"{flag} {value}: this command writes to a local path; copy the result to object "
                            f"storage afterwards{where}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, overrides = _split_overrides(argv)
    parser = build_parser()
    ns, unknown = parser.parse_known_args(args)
    keys = [tok for tok in unknown if "." in tok and _OVERRIDE.match(tok + "=")]
    if keys:  # `train.optim.lr` without `=value`: one line, not argparse's usage
        print(f"latentforge: error: override {keys[0]!r}: expected key.path=value", file=sys.stderr)
        return 2
    if unknown:
        parser.parse_args(args)  # argparse's own message for anything else it did not recognise
    if not hasattr(ns, "fn"):
        # `latentforge` or `latentforge data` alone: show the help of that level (argparse exits 0 after it).
        try:
            parser.parse_args(args + ["--help"])
        except SystemExit:
            pass
        return 2
    if getattr(ns, "quiet", False):
        _quiet_libraries()
    try:
        _check_local_outputs(ns)
        code = ns.fn(ns, overrides)  # EXIT_INTERRUPTED (75) after a stop with a checkpoint, else None / 0
    except UserError as e:
        # A configuration with several problems lists them all, one line each.
        for line in str(e).splitlines() or [""]:
            print(f"latentforge: error: {line}", file=sys.stderr)
        return 2
    except (FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError) as e:
        # A path of the user's that is of the wrong kind (an --out that is a file, a read-only directory).
        where = f"{e.filename}: " if e.filename else ""
        print(f"latentforge: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("latentforge: interrupted (rerun the same command to resume)", file=sys.stderr)
        return 130
    except Exception as e:
        if not type(e).__module__.startswith("botocore"):
            raise
        # Object storage that cannot be reached (no credentials, no such bucket, no network): the user's set-up.
        print(f"latentforge: error: object storage: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
              file=sys.stderr)
        return 2
    return code or 0


if __name__ == "__main__":
    raise SystemExit(main())
