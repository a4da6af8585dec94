"""``latentforge eval``: generate images for prompts and measure them the way papers do.

One call generates ``num_images`` images per guidance scale (from a checkpoint / run directory
with its EMA weights, or from an exported diffusers directory) and computes, for each scale:

- FID and KID on the standard Inception-v3 (torchmetrics' metrics; the network's weights are a
  local file; images are resized the clean-fid way, PIL bicubic to 299);
- the Fréchet distance in the features of any other local encoder (``fd_<name>``; DINOv2 as
  recommended by Stein et al. 2023);
- the CLIP score of each image against its prompt (a local CLIP directory).

It writes ``OUT/results.json``, ``OUT/results.md`` and ``OUT/tradeoff.png`` (the distribution
metric against CLIP score, one point per guidance scale: the trade-off curve papers draw).

Long work survives a crash: generated images are written per batch, and a batch is recorded in a
manifest only after its images are on disk, so a rerun of the same command generates only the
batches that are missing. Image ``i`` comes from batch ``i // batch_size`` sampled with seed
``seed + batch``, whatever the number of ranks and however often the run was interrupted.
Reference features are computed once per (extractor weights, resize, image list) and cached next
to the reference data (or in ``cache_dir`` when that is read-only or remote).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from latentforge import storage
from latentforge.config import save_config, to_dict
from latentforge.errors import UserError
from latentforge.evaluate import metrics
from latentforge.evaluate.config import EvalConfig
from latentforge.evaluate.features import EncoderExtractor, InceptionExtractor, load_clip
from latentforge.evaluate.inputs import ReferenceSet, load_prompts, load_reference
from latentforge.export.diffusers_pipeline import pipeline_call_kwargs
from latentforge.inference import generate, load_components, resolve_checkpoint

log = logging.getLogger("latentforge.eval")

SAMPLERS = ("ddim", "dpm++", "euler", "ddpm")
GENERATION = "generation.json"  # the settings the images in OUT/images were generated with
RESULTS_JSON, RESULTS_MD, PLOT = "results.json", "results.md", "tradeoff.png"
CACHE_SUBDIR = ".latentforge-eval-cache"


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _scale_name(g: float) -> str:
    return f"cfg-{g:g}"


# ---------------------------------------------------------------- generation


def is_diffusers_dir(path: str | Path) -> bool:
    return (Path(path) / "model_index.json").is_file()


def load_generator(cfg: EvalConfig, device: torch.device) -> tuple[Callable[[list[str], int, float], list[Image.Image]],
                                                                    dict[str, Any]]:
    """(generate(prompts, seed, guidance) -> images, a description of the model)."""
    if not cfg.checkpoint:
        raise UserError("eval: no model (set --checkpoint / eval.checkpoint to a checkpoint, run or diffusers directory)")
    if is_diffusers_dir(cfg.checkpoint):
        from diffusers import DiffusionPipeline

        try:
            pipe = DiffusionPipeline.from_pretrained(cfg.checkpoint, local_files_only=True)
        except (OSError, ValueError) as e:
            first = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            raise UserError(f"{cfg.checkpoint}: cannot load the diffusers pipeline ({first})") from None
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        call = pipeline_call_kwargs(cfg.checkpoint)  # an exported transformer's PixArtAlphaPipeline settings

        def run(prompts: list[str], seed: int, guidance: float) -> list[Image.Image]:
            gen = torch.Generator(device=device).manual_seed(seed)
            return pipe(list(prompts), num_inference_steps=cfg.num_steps, guidance_scale=guidance, generator=gen,
                        output_type="pil", **call).images

        return run, {"kind": "diffusers", "path": str(Path(cfg.checkpoint).resolve()),
                     "scheduler": type(pipe.scheduler).__name__}

    path = resolve_checkpoint(cfg.checkpoint)
    comps = load_components(path, use_ema=cfg.use_ema, device=device)

    def run(prompts: list[str], seed: int, guidance: float) -> list[Image.Image]:
        return generate(comps.unet, comps.vae, comps.text_model, comps.tokenizer, comps.noise, comps.max_length,
                        prompts, seed=seed, num_steps=cfg.num_steps, guidance_scale=guidance, sampler=cfg.sampler)

    return run, {"kind": "checkpoint", "path": str(path.resolve()), "weights": comps.weights, "sampler": cfg.sampler}


def _model_identity(cfg: EvalConfig) -> dict[str, Any]:
    """What the generated images depend on, known without loading the model."""
    if is_diffusers_dir(cfg.checkpoint):
        return {"kind": "diffusers", "path": str(Path(cfg.checkpoint).resolve())}
    path = resolve_checkpoint(cfg.checkpoint) if cfg.checkpoint else None
    return {"kind": "checkpoint", "path": str(path.resolve()) if path else "", "use_ema": cfg.use_ema,
            "sampler": cfg.sampler}


def _save_png(image: Image.Image, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    image.save(tmp, format="PNG")
    os.replace(tmp, path)


def _done_batches(scale_dir: Path) -> set[int]:
    done: set[int] = set()
    for manifest in scale_dir.glob("manifest-rank*.jsonl"):
        for line in manifest.read_text().splitlines():
            try:
                done.add(int(json.loads(line)["batch"]))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue  # a line torn by a crash: its batch is generated again
    return done


def generate_all(cfg: EvalConfig, prompts: Sequence[str], out: Path, rank: int = 0, world_size: int = 1,
                 progress: bool = True) -> dict[str, Any]:
    """This rank's share of the images of every guidance scale, skipping batches already in a manifest.

    Rank ``r`` of ``W`` generates the batches ``b`` with ``b % W == r``."""
    num = len(prompts)
    num_batches = -(-num // cfg.batch_size)
    todo: list[tuple[float, int]] = []
    for g in cfg.guidance_scales:
        d = out / "images" / _scale_name(g)
        d.mkdir(parents=True, exist_ok=True)
        done = _done_batches(d)
        todo += [(g, b) for b in range(rank, num_batches, world_size) if b not in done]
    mine = sum(len(range(rank, num_batches, world_size)) for _ in cfg.guidance_scales)
    info = {"batches": mine, "generated_batches": len(todo), "resumed_batches": mine - len(todo), "model": None}
    if not todo:
        return info
    device = _device(cfg.device)
    run, info["model"] = load_generator(cfg, device)
    bar = tqdm(total=mine, initial=mine - len(todo), desc=f"generate (rank {rank})" if world_size > 1 else "generate",
               unit="batch", disable=not progress)
    for g, b in todo:
        d = out / "images" / _scale_name(g)
        lo, hi = b * cfg.batch_size, min(num, (b + 1) * cfg.batch_size)
        images = run(list(prompts[lo:hi]), cfg.seed + b, g)
        for i, img in zip(range(lo, hi), images):
            _save_png(img, d / f"{i:06d}.png")
        with open(d / f"manifest-rank{rank}.jsonl", "a") as f:  # written last: the batch is complete
            f.write(json.dumps({"batch": b, "first": lo, "num": hi - lo, "seed": cfg.seed + b}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        bar.update(1)
    bar.close()
    return info


def _check_settings(cfg: EvalConfig, prompts: Sequence[str], out: Path, take_lock: Callable[[Path], None]) -> None:
    """Images already in OUT must come from the same model, prompts and sampling settings; then
    ``take_lock(out)``, before the first write."""
    settings = {"model": _model_identity(cfg), "prompts_sha256": hashlib.sha256("\n".join(prompts).encode()).hexdigest(),
                "num_images": len(prompts), "num_steps": cfg.num_steps, "seed": cfg.seed, "batch_size": cfg.batch_size}
    path = out / GENERATION
    resumed = path.exists()
    if resumed:
        before = json.loads(path.read_text())
        changed = sorted(k for k in set(settings) | set(before) if settings.get(k) != before.get(k))
        if changed:
            raise UserError(f"{out}: holds images generated with other settings ({', '.join(changed)} changed); "
                            "choose another output directory")
    out.mkdir(parents=True, exist_ok=True)
    take_lock(out)
    if not resumed:
        storage.atomic_write_bytes(path, json.dumps(settings, indent=1).encode())


def generated_images(out: Path, g: float, num: int) -> list[Path]:
    d = out / "images" / _scale_name(g)
    paths = [d / f"{i:06d}.png" for i in range(num)]
    missing = [p for p in paths if not p.exists()]
    if missing:
        raise UserError(f"{d}: {len(missing)} of {num} generated images are missing (e.g. {missing[0].name}); "
                        "rerun the same command to generate them")
    return paths


# ---------------------------------------------------------------- features and the reference cache


def _batched(items: Iterable[Any], n: int) -> Iterable[list[Any]]:
    batch: list[Any] = []
    for x in items:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def extract(extractor: Callable[[list[Image.Image]], torch.Tensor], images: Iterable[Image.Image], total: int,
            batch_size: int, desc: str, progress: bool) -> torch.Tensor:
    feats = []
    with tqdm(total=total, desc=desc, unit="img", disable=not progress) as bar:
        for batch in _batched(images, batch_size):
            feats.append(extractor(batch))
            bar.update(len(batch))
    return torch.cat(feats)


def _cache_dirs(ref: ReferenceSet, cache_dir: str) -> list[Path]:
    dirs = []
    if ref.kind == "folder" or not storage.is_s3(ref.root):
        dirs.append(Path(ref.root) / CACHE_SUBDIR)
    dirs.append(Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache" / "latentforge" / "eval")
    return dirs


def reference_features(extractor: Any, ref: ReferenceSet, cfg: EvalConfig, progress: bool) -> tuple[torch.Tensor, dict]:
    """The extractor's features of the reference set, from the cache when its key matches.

    The key is the sha256 of the extractor's fingerprint (weights sha256, layer, resize or image
    processor) and of the reference image list; any change computes and caches them again."""
    import safetensors.torch

    key = hashlib.sha256(json.dumps({"extractor": extractor.fingerprint, "images": ref.fingerprint},
                                    sort_keys=True).encode()).hexdigest()
    name = f"{extractor.name}-{key[:16]}.safetensors"
    for d in _cache_dirs(ref, cfg.cache_dir):
        path = d / name
        if path.is_file():
            with safetensors.safe_open(str(path), "pt") as f:
                if (f.metadata() or {}).get("key") == key:
                    return f.get_tensor("features"), {"cache": "hit", "path": str(path)}
    feats = extract(extractor, ref.iter_images(), len(ref), cfg.batch_size, f"reference {extractor.name}", progress)
    meta = {"key": key, "extractor": json.dumps(extractor.fingerprint), "num_images": str(len(ref))}
    for d in _cache_dirs(ref, cfg.cache_dir):
        path = d / name
        tmp = path.with_name(f".{name}.tmp-{os.getpid()}")
        try:
            d.mkdir(parents=True, exist_ok=True)
            safetensors.torch.save_file({"features": feats.contiguous()}, str(tmp), metadata=meta)
            os.replace(tmp, path)
            return feats, {"cache": "computed", "path": str(path)}
        except OSError:  # read-only reference directory: the next location
            tmp.unlink(missing_ok=True)
    log.warning("eval: could not cache the reference features of %s anywhere", extractor.name)
    return feats, {"cache": "computed", "path": None}


# ---------------------------------------------------------------- the evaluation


def _as_uint8_chw(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(img.convert("RGB")).copy()).permute(2, 0, 1)


def _open(paths: Sequence[Path]) -> Iterable[Image.Image]:
    for p in paths:
        with Image.open(p) as im:
            yield im.convert("RGB")


def _label(extractor: Any) -> str:
    """The metric name of an extractor's Fréchet distance: fid (fid64 ... on other Inception layers) or fd_<name>."""
    if isinstance(extractor, InceptionExtractor):
        return "fid" if extractor.feature == 2048 else f"fid{extractor.feature}"
    return f"fd_{extractor.name}"


def evaluate(cfg: EvalConfig, out: str | Path, progress: bool = True, world: Any = None,
             lock: str = "") -> dict[str, Any] | None:
    """Generate (resumably, split across ranks) and measure; rank 0 returns the results, other ranks None.
    ``lock``: the command's name (e.g. "latentforge eval"): rank 0 holds ``out``'s lock
    (:func:`latentforge.storage.directory_lock`) from its first write there, so a second evaluation into
    it stops in one line."""
    with storage.lock_at_first_write(lock) as take_lock:
        return _evaluate(cfg, Path(out), progress, world, take_lock)


def _evaluate(cfg: EvalConfig, out: Path, progress: bool, world: Any,
              take_lock: Callable[[Path], None]) -> dict[str, Any] | None:
    rank, world_size = (world.rank, world.world_size) if world is not None else (0, 1)
    prompts = load_prompts(cfg.prompts, cfg.prompt_column)
    num = cfg.num_images or len(prompts)
    prompts = [prompts[i % len(prompts)] for i in range(num)]

    # Models and reference inputs are checked before any generation: bad input fails in seconds.
    device = _device(cfg.device)
    extractors: list[Any] = []
    clip = None
    ref = None
    if rank == 0:
        if cfg.inception:
            extractors.append(InceptionExtractor(cfg.inception, cfg.inception_feature, device))
        extractors += [EncoderExtractor(p, device) for p in cfg.fd_encoders]
        if cfg.clip:
            clip = load_clip(cfg.clip)
        if not extractors and clip is None:
            raise UserError("eval: no metric to compute: give --inception (FID/KID), --fd-encoder (FD) and/or --clip "
                            "(CLIP score)")
        if cfg.plot_metric and cfg.plot_metric not in (names := [_label(ex) for ex in extractors] +
                                                         (["kid"] if cfg.inception else [])):
            raise UserError(f"eval.plot_metric: {cfg.plot_metric!r} is not computed by this evaluation "
                            f"(it computes: {', '.join(names) or 'no distribution metric'})")
        if extractors:
            ref = load_reference(cfg.reference, cfg.max_reference)
            if cfg.inception and min(len(ref), num) < cfg.kid_subset_size:
                raise UserError(f"KID: subset size {cfg.kid_subset_size} needs at least {cfg.kid_subset_size} images on "
                                f"each side, got {len(ref)} reference and {num} generated per scale (set "
                                f"eval.kid_subset_size <= {min(len(ref), num)} or use more images)")
        _check_settings(cfg, prompts, out, take_lock)
        save_config(cfg, out / "eval_config.yaml")
    if world is not None and world.barrier is not None:
        world.barrier()  # rank 0 checked the inputs and wrote generation.json
    gen_info = generate_all(cfg, prompts, out, rank, world_size, progress)
    if world is not None and world.barrier is not None:
        world.barrier()  # every rank's images are on disk
    if rank != 0:
        return None

    warnings: list[str] = []
    reference: dict[str, Any] = {}
    ref_feats: dict[str, torch.Tensor] = {}
    for ex in extractors:
        ref_feats[ex.name], reference[ex.name] = reference_features(ex, ref, cfg, progress)
        reference[ex.name]["num_images"] = len(ref)
    rows = []
    for g in cfg.guidance_scales:
        paths = generated_images(out, g, num)
        row: dict[str, Any] = {"guidance_scale": g, "num_images": num}
        for ex in extractors:
            fake = extract(ex, _open(paths), num, cfg.batch_size, f"{_scale_name(g)} {ex.name}", progress)
            real = ref_feats[ex.name]
            label = _label(ex)
            msg = metrics.fid_sample_warning(len(real), len(fake), real.shape[1], label)
            if msg and msg not in warnings:  # reported once, with the results (stdout and results.md)
                warnings.append(msg)
            row[label] = metrics.frechet_distance(real, fake)
            if isinstance(ex, InceptionExtractor):
                row["kid"], row["kid_std"] = metrics.kernel_inception_distance(
                    real, fake, cfg.kid_subset_size, cfg.kid_subsets, seed=cfg.seed)
        if clip is not None:
            model, processor, _ = clip
            images = [_as_uint8_chw(im) for im in _open(paths)]
            row["clip_score"] = metrics.clip_score(images, prompts, model, processor, cfg.batch_size)
        rows.append(row)
    results = {
        "rows": rows, "warnings": warnings, "reference": reference,
        "models": {"generator": gen_info["model"] or _model_identity(cfg),
                   "extractors": {ex.name: ex.fingerprint for ex in extractors},
                   "clip": clip[2] if clip else None},
        "generation": {k: v for k, v in gen_info.items() if k != "model"},
        "config": to_dict(cfg),
    }
    storage.atomic_write_bytes(out / RESULTS_JSON, json.dumps(results, indent=1).encode())
    (out / RESULTS_MD).write_text(results_table(rows, warnings))
    plot_tradeoff(rows, out / PLOT, cfg.plot_metric)
    return results


def _metric_columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    cols = []
    for r in rows:
        cols += [k for k in r if k not in ("guidance_scale", "num_images", "kid_std") and k not in cols]
    return cols


def results_table(rows: Sequence[dict[str, Any]], warnings: Sequence[str] = ()) -> str:
    """The markdown table of ``results.md``: one row per guidance scale."""
    cols = _metric_columns(rows)
    lines = ["| guidance | images | " + " | ".join(cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append("" if v is None else f"{v:.5f} ± {r['kid_std']:.5f}" if c == "kid" else f"{v:.4f}")
        lines.append(f"| {r['guidance_scale']:g} | {r['num_images']} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    if warnings:
        text += "\n" + "\n".join(f"- warning: {w}" for w in warnings) + "\n"
    return text


def plot_tradeoff(rows: Sequence[dict[str, Any]], path: Path, metric: str = "") -> Path | None:
    """The distribution metric against CLIP score (or against the guidance scale without CLIP), one point per scale."""
    cols = _metric_columns(rows)
    dist = [c for c in cols if c != "clip_score"]
    if metric:
        if metric not in dist:
            raise UserError(f"eval.plot_metric: {metric!r} was not computed (computed: {', '.join(dist) or 'none'})")
    elif dist:
        metric = "fid" if "fid" in dist else dist[0]
    else:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xkey = "clip_score" if "clip_score" in cols else "guidance_scale"
    fig, ax = plt.subplots(figsize=(5, 4))
    xs, ys = [r[xkey] for r in rows], [r[metric] for r in rows]
    ax.plot(xs, ys, "o-")
    for r, x, y in zip(rows, xs, ys):
        ax.annotate(f"cfg {r['guidance_scale']:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("CLIP score" if xkey == "clip_score" else "guidance scale")
    name = metric.upper() if metric.startswith(("fid", "kid")) else metric
    ax.set_ylabel(name)
    against = "CLIP score" if xkey == "clip_score" else "guidance"
    ax.set_title(f"{name} against {against} ({rows[0]['num_images']} images per point)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
