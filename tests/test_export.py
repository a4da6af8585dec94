"""Export and sampling: an exported diffusers StableDiffusionPipeline reproduces ``latentforge sample``.

A tiny run is trained once per text encoder (a BERT, a CLIP text tower with its own noise schedule,
and a T5 encoder with the BERT tokenizer) on latents of a tiny VAE. Its export is loaded with the real
``StableDiffusionPipeline.from_pretrained`` offline and must give the images of ``latentforge
sample`` for the same seed, for every sampler, with and without EMA weights.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import yaml
from diffusers import StableDiffusionPipeline
from PIL import Image
from transformers import AutoTokenizer

from latentforge import checkpoint as ckpt
from latentforge.cli import main
from latentforge.config import from_dict
from latentforge.data.encode import EncodeConfig, encode_dataset
from latentforge.diffusion.schedule import SAMPLERS, scheduler_config
from latentforge.errors import UserError
from latentforge.export.diffusers_pipeline import load_exported
from latentforge.inference import (
    decode_latents,
    generate,
    generate_latents,
    load_components,
    load_run_files,
    make_grid,
)
from latentforge.models.autoencoder import load_vae
from latentforge.train.run import RunConfig, train
from sample_cli import read_samples
from tiny_models import make_raw_dataset, make_tiny_bert, make_tiny_clip, make_tiny_t5, make_tiny_vae

RES = 16  # pixels; the tiny VAE halves it: 8x8x4 latents, the tiny U-Net preset's size
MAX_LEN = 12  # tokens; below both tokenizers' own limits (BERT 32, CLIP 77), so export must set it
PROMPTS = ["a small red circle in the corner", "a big blue square"]
STEPS, CFG = 6, 4.0
TOL = 2 / 255  # PNG quantisation alone gives at most 0.5/255
NUM_TRAIN_STEPS = 4
# Per text encoder, what its run changes from the defaults: the CLIP run has a non-default noise
# schedule (the export must carry it) and sample grids during training.
RUN_SETTINGS = {
    "bert": {},
    "t5": {},
    "clip": {
        "noise": {"prediction_type": "v_prediction", "timestep_spacing": "trailing", "num_train_timesteps": 500},
        "sampling": {"prompts": PROMPTS, "num_steps": 3, "seed": 5, "guidance_scale": 3.0, "sampler": "euler"},
    },
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread_offline(one_thread_offline):
    """One thread, hub access off (conftest)."""


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export_assets")
    return {
        # StableDiffusionPipeline ignores shift_factor, so an exportable run needs a VAE without one.
        "vae": make_tiny_vae(root / "vae", shift_factor=None),
        "vae_shifted": make_tiny_vae(root / "vae_shifted", shift_factor=0.1),
        "bert": make_tiny_bert(root / "bert"),
        "clip": make_tiny_clip(root / "clip"),
        "t5": make_tiny_t5(root / "t5"),  # no tokenizer of its own: encoded with the BERT one
        "raw": make_raw_dataset(root / "raw", n=16, resolution=RES, num_shards=2),
    }


@dataclass(frozen=True)
class TinyRun:
    path: Path  # the run directory
    encoder: str  # "bert", "clip" or "t5"


@pytest.fixture(scope="module")
def build_run(assets, tmp_path_factory):
    """``build_run(encoder)``: a finished tiny run, trained once per module and text encoder (4 steps;
    EMA decay 0.5, so that EMA and raw weights differ)."""
    runs: dict[str, TinyRun] = {}

    def build(encoder: str) -> TinyRun:
        if encoder not in runs:
            root = tmp_path_factory.mktemp(f"run_{encoder}")
            latents = root / "latents"
            encode_dataset(str(assets["raw"]), str(latents), EncodeConfig(
                vae=str(assets["vae"]), text_encoder=str(assets[encoder]), max_length=MAX_LEN, batch_size=8,
                device="cpu", tokenizer=str(assets["bert"]) if encoder == "t5" else None), progress=False)
            cfg = from_dict(RunConfig, {
                "train": {
                    "unet": {"preset": "tiny"}, "ema": {"decay": 0.5}, "optim": {"lr": 1e-2},
                    "phases": [{"datasets": [{"path": str(latents)}], "steps": NUM_TRAIN_STEPS}],
                    "micro_batch_size": 4, "device": "cpu", "loggers": [], "checkpoint": {"every_steps": 100},
                    **RUN_SETTINGS[encoder],
                },
                "data": {"num_workers": 0, "cache_dir": str(root / "cache")},
            })
            summary = train(cfg, root / "run", progress=False)
            assert summary["finished"] and summary["step"] == NUM_TRAIN_STEPS
            runs[encoder] = TinyRun(root / "run", encoder)
        return runs[encoder]

    return build


@pytest.fixture(scope="module", params=["bert", "clip"])
def run(request, build_run) -> TinyRun:
    return build_run(request.param)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """``export(run, ema, sampler)``: the run exported with ``latentforge export``, once per combination."""
    done: dict[tuple[TinyRun, bool, str], Path] = {}
    root = tmp_path_factory.mktemp("exports")

    def export(run: TinyRun, ema: bool = True, sampler: str = "ddim") -> Path:
        key = (run, ema, sampler)
        if key not in done:
            out = root / f"{run.encoder}-{'ema' if ema else 'raw'}-{sampler}"
            args = ["export", "--checkpoint", str(run.path), "--out", str(out), "--scheduler", sampler]
            assert main(args + ([] if ema else ["--no-ema"])) == 0
            done[key] = out
        return done[key]

    return export


def _pipeline(path: Path) -> StableDiffusionPipeline:
    pipe = StableDiffusionPipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipeline_images(pipe: StableDiffusionPipeline, seed: int, output_type: str = "np", **kw):
    """(N, H, W, 3) floats in [0, 1], or the (N, C, h, w) latents for ``output_type="latent"``."""
    return pipe(PROMPTS, num_inference_steps=STEPS, guidance_scale=CFG, height=RES, width=RES,
                generator=torch.Generator("cpu").manual_seed(seed), output_type=output_type, **kw).images


def _sample_args(checkpoint: Path, out: Path, seed: int = 0, sampler: str = "ddim", ema: bool = True,
                 num_per_prompt: int = 1) -> list[str]:
    args = ["sample", "--checkpoint", str(checkpoint), "--out", str(out), "--cfg", str(CFG), "--steps", str(STEPS),
            "--sampler", sampler, "--seed", str(seed), "--num-per-prompt", str(num_per_prompt)]
    for p in PROMPTS:
        args += ["--prompt", p]
    return args + ([] if ema else ["--no-ema"])


def _sample_cli(run: TinyRun, out: Path, seed: int, sampler: str = "ddim", ema: bool = True,
                num_per_prompt: int = 1) -> np.ndarray:
    """``latentforge sample`` -> its PNGs as (N, H, W, 3) floats in [0, 1]."""
    assert main(_sample_args(run.path, out, seed, sampler, ema, num_per_prompt)) == 0
    return read_samples(out, len(PROMPTS) * num_per_prompt)


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())


# ------------------------------------------------------------------ the pipeline reproduces sample


def _check_reproduces(run: TinyRun, export_dir: Path, out: Path, sampler: str, ema: bool, seed: int) -> None:
    pipe = _pipeline(export_dir)
    assert type(pipe.scheduler) is SAMPLERS[sampler][0]
    theirs = _pipeline_images(pipe, seed)
    ours = _sample_cli(run, out, seed, sampler, ema)
    assert theirs.shape == (len(PROMPTS), RES, RES, 3)
    assert _max_diff(theirs, ours) <= TOL
    assert _max_diff(ours[0], ours[1]) > 10 * TOL  # the prompts matter: the comparison sees conditioning
    # The tiny random VAE shrinks differences: a pipeline that pads captions to the tokenizer's own
    # length changed the images by only about 2/255. Before decoding, the latents agree to float
    # rounding (bitwise here), and such a mistake changes them by about 1e-2 (2e-2 with no mask).
    c = load_components(run.path, use_ema=ema)
    our_latents = generate_latents(c.unet, c.text_model, c.tokenizer, c.noise, c.max_length, PROMPTS, seed,
                                   STEPS, CFG, sampler)
    their_latents = _pipeline_images(pipe, seed, output_type="latent")
    torch.testing.assert_close(their_latents, our_latents, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("sampler, ema", [("ddim", True), ("ddim", False), ("dpm++", True), ("euler", False),
                                          ("ddpm", True)])
def test_exported_pipeline_reproduces_sample(run, exports, tmp_path, sampler, ema):
    _check_reproduces(run, exports(run, ema, sampler), tmp_path / "samples", sampler, ema, seed=11)


def test_run_with_a_separate_tokenizer(build_run, exports, tmp_path):
    """A T5 encoded with another model's tokenizer: sampling and export find that tokenizer."""
    run = build_run("t5")
    export_dir = exports(run)
    assert json.loads((export_dir / "model_index.json").read_text())["text_encoder"][1] == "T5EncoderModel"
    _check_reproduces(run, export_dir, tmp_path / "samples", "ddim", True, seed=2)


def test_ema_and_raw_weights_give_different_images(run, tmp_path):
    ema = _sample_cli(run, tmp_path / "ema", seed=3)
    raw = _sample_cli(run, tmp_path / "raw", seed=3, ema=False)
    assert _max_diff(ema, raw) > 10 * TOL


def test_num_per_prompt_matches_pipeline_and_writes_outputs(run, exports, tmp_path):
    out = tmp_path / "samples"
    ours = _sample_cli(run, out, seed=4, num_per_prompt=2)
    theirs = _pipeline_images(_pipeline(exports(run)), seed=4, num_images_per_prompt=2)
    assert _max_diff(theirs, ours) <= TOL  # both order the images prompt by prompt
    assert sorted(p.name for p in out.iterdir()) == ["0000.png", "0001.png", "0002.png", "0003.png",
                                                      "grid.png", "prompts.txt"]
    assert (out / "prompts.txt").read_text().splitlines() == [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2
    # 4 images of 16 px: 2 x 2 cells, scaled 8x to 128 px, with a 12 px label band under each row.
    assert Image.open(out / "grid.png").size == (2 * 128, 2 * (128 + 12))
    before = (out / "0000.png").read_bytes()
    assert main(_sample_args(run.path, out, seed=5)) == 2  # never overwrites earlier samples silently
    assert (out / "0000.png").read_bytes() == before
    assert main(_sample_args(run.path, out, seed=5) + ["--overwrite"]) == 0
    assert (out / "0000.png").read_bytes() != before


def test_pipeline_default_size_is_the_training_resolution(run, exports):
    pipe = _pipeline(exports(run))
    images = pipe(PROMPTS[:1], num_inference_steps=2, generator=torch.Generator("cpu").manual_seed(0),
                  output_type="np").images
    assert images.shape == (1, RES, RES, 3)


def test_load_exported_is_from_pretrained_without_its_noise(build_run, exports, capfd):
    """The demo loads its export as a user does, minus the loading bars and diffusers' warning that a
    BERT text encoder is not a CLIPTextModel; the same images, and the warning is back afterwards."""
    from diffusers import DiffusionPipeline
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    class Record(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    path = exports(build_run("bert"))
    logger, record = logging.getLogger("diffusers.pipelines.pipeline_utils"), Record()
    bars = [(m, m.is_progress_bar_enabled()) for m in (diffusers_logging, transformers_logging)]
    logger.addHandler(record)
    try:
        for m, _ in bars:  # on, whatever earlier tests left
            m.enable_progress_bar()
        capfd.readouterr()
        ours = load_exported(path)
        quiet, quiet_log = capfd.readouterr().err, list(record.messages)
        restored = [m.is_progress_bar_enabled() for m, _ in bars]
        theirs = DiffusionPipeline.from_pretrained(str(path), local_files_only=True)
        theirs.set_progress_bar_config(disable=True)
        loud, loud_log = capfd.readouterr().err, list(record.messages[len(quiet_log):])
    finally:
        logger.removeHandler(record)
        for m, was in bars:
            (m.enable_progress_bar if was else m.disable_progress_bar)()
    assert any(m.startswith("Expected types for text_encoder") for m in loud_log)
    assert "Loading pipeline components" in loud
    assert quiet_log == [] and "Loading" not in quiet and restored == [True, True]
    np.testing.assert_array_equal(_pipeline_images(ours, seed=6), _pipeline_images(theirs, seed=6))


def test_training_sample_grid_uses_the_ema_weights(build_run):
    run = build_run("clip")  # the run with sample grids
    s = RUN_SETTINGS["clip"]["sampling"]
    grid = Image.open(run.path / "samples" / f"step-{NUM_TRAIN_STEPS:08d}.png").convert("RGB")
    scale = 128 // RES
    # The first cell, shrunk back by the nearest-neighbour factor it was enlarged by.
    cell = np.asarray(grid.crop((0, 0, RES * scale, RES * scale)).resize((RES, RES), Image.Resampling.NEAREST))
    for use_ema in (True, False):
        c = load_components(run.path, use_ema=use_ema)
        images = generate(c.unet, c.vae, c.text_model, c.tokenizer, c.noise, c.max_length, s["prompts"],
                          seed=s["seed"], num_steps=s["num_steps"], guidance_scale=s["guidance_scale"],
                          sampler=s["sampler"])
        diff = _max_diff(cell / 255.0, np.asarray(images[0]) / 255.0)
        assert (diff <= TOL) if use_ema else (diff > TOL)


# ------------------------------------------------------------------ the export directory


def test_export_directory(run, exports):
    cfg, meta = load_run_files(run.path)
    ckpt_dir = ckpt.find_latest(run.path)
    for ema, group in ((True, "ema"), (False, "model")):
        out = exports(run, ema)
        index = json.loads((out / "model_index.json").read_text())
        assert index["unet"] == ["diffusers", "UNet2DConditionModel"]
        assert index["vae"] == ["diffusers", "AutoencoderKL"]
        assert index["text_encoder"] == ["transformers", {"bert": "BertModel", "clip": "CLIPTextModel"}[run.encoder]]
        assert index["tokenizer"][0] == "transformers"
        assert index["scheduler"] == ["diffusers", "DDIMScheduler"]
        assert index["safety_checker"] == [None, None] and index["requires_safety_checker"] is False

        exported = safetensors.torch.load_file(out / "unet" / "diffusion_pytorch_model.safetensors")
        saved = safetensors.torch.load_file(ckpt_dir / f"{group}.safetensors")
        other = safetensors.torch.load_file(ckpt_dir / f"{'model' if ema else 'ema'}.safetensors")
        assert exported.keys() == saved.keys()
        assert all(torch.equal(exported[k], saved[k]) for k in saved)
        assert not all(torch.equal(exported[k], other[k]) for k in other)  # EMA and raw differ here
        assert json.loads((out / "latentforge_export.json").read_text())["weights"] == group

        files = [p for p in out.rglob("*") if p.is_file()]
        assert not [p for p in files if p.suffix in (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")]
        for component in ("unet", "vae", "text_encoder"):
            assert list((out / component).glob("*.safetensors"))

        sched = json.loads((out / "scheduler" / "scheduler_config.json").read_text())
        assert sched["_class_name"] == "DDIMScheduler"
        assert {k: sched[k] for k in scheduler_config(cfg.train.noise)} == scheduler_config(cfg.train.noise)

        assert json.loads((out / "text_encoder" / "config.json").read_text())["use_attention_mask"] is True
        assert meta["text_encoder"]["max_length"] == MAX_LEN
        assert AutoTokenizer.from_pretrained(str(out / "tokenizer")).model_max_length == MAX_LEN
        assert not list(out.parent.glob(f".{out.name}.tmp-*"))  # written under a temporary name, renamed


def test_scheduler_config_comes_from_the_run(run, exports):
    """The CLIP run's schedule is not the default one: the export must carry it."""
    sched = json.loads((exports(run, True, "dpm++") / "scheduler" / "scheduler_config.json").read_text())
    expected = {"prediction_type": "epsilon", "timestep_spacing": "leading", "num_train_timesteps": 1000,
                **RUN_SETTINGS[run.encoder].get("noise", {})}
    assert {k: sched[k] for k in expected} == expected
    assert sched["_class_name"] == "DPMSolverMultistepScheduler"
    assert sched["algorithm_type"] == "dpmsolver++" and sched["solver_order"] == 2


# ------------------------------------------------------------------ pieces


def test_decode_latents_undoes_the_training_scale_and_shift(assets):
    """Training feeds the U-Net (z - shift_factor) * scaling_factor; decoding must invert both."""
    vae = load_vae(str(assets["vae_shifted"]))
    shift, scale = vae.config.shift_factor, vae.config.scaling_factor
    assert shift and scale != 1
    z = torch.randn(2, 4, RES // 2, RES // 2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = vae.decode(z).sample
        got = decode_latents(vae, (z - shift) * scale)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_make_grid_shapes_and_placement():
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (0, 255, 255)]
    images = [Image.new("RGB", (10, 6), c) for c in colours]
    grid = make_grid(images, scale=2)  # 5 images: ceil(sqrt(5)) = 3 columns, 2 rows, no labels
    assert grid.size == (3 * 20, 2 * 12)
    for i, c in enumerate(colours):
        assert grid.getpixel(((i % 3) * 20 + 10, (i // 3) * 12 + 6)) == c  # the centre of cell i
    assert grid.getpixel((2 * 20 + 10, 12 + 6)) == (255, 255, 255)  # the empty sixth cell
    labelled = make_grid(images, labels=[f"p{i}" for i in range(5)], ncols=5)
    assert labelled.size == (5 * 10, 6 + 12)
    with pytest.raises(ValueError, match="make_grid: no images"):
        make_grid([])


# ------------------------------------------------------------------ bad input


def _one_error_line(capsys, *words: str) -> None:
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("latentforge: error: "), err
    assert not captured.out
    for w in words:
        assert w in err[0], err[0]


@pytest.fixture
def run_copy(build_run, tmp_path) -> Path:
    """A copy of the BERT run that a test may damage."""
    return Path(shutil.copytree(build_run("bert").path, tmp_path / "run"))


def test_export_refuses_a_non_empty_or_file_destination(build_run, tmp_path, capsys):
    run = build_run("bert").path
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", "--checkpoint", str(run), "--out", str(out)]) == 2
    _one_error_line(capsys, str(out), "not an empty directory")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (tmp_path / "file").write_text("x")
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "file")]) == 2
    _one_error_line(capsys, str(tmp_path / "file"), "is a file; export writes a new directory")
    empty = tmp_path / "empty"
    empty.mkdir()  # an existing empty directory is fine
    assert main(["export", "--checkpoint", str(run), "--out", str(empty)]) == 0
    assert (empty / "model_index.json").is_file()


def test_incomplete_or_missing_checkpoint_is_refused(run_copy, tmp_path, capsys):
    step_dir = ckpt.find_latest(run_copy)
    (step_dir / ckpt.MARKER).unlink()
    out = tmp_path / "out"
    assert main(_sample_args(step_dir, out)) == 2
    _one_error_line(capsys, str(step_dir), "not a complete checkpoint", "COMPLETE")
    assert main(["export", "--checkpoint", str(step_dir), "--out", str(out)]) == 2
    _one_error_line(capsys, "not a complete checkpoint")
    assert not out.exists()

    not_a_run = tmp_path / "not_a_run"
    not_a_run.mkdir()
    (not_a_run / "notes.txt").write_text("hello")
    for command in (_sample_args(not_a_run, out), ["export", "--checkpoint", str(not_a_run), "--out", str(out)]):
        assert main(command) == 2
        _one_error_line(capsys, str(not_a_run), "neither a checkpoint directory nor a run directory")
    assert main(_sample_args(tmp_path / "missing", out)) == 2
    _one_error_line(capsys, "no such directory")
    assert not out.exists()


@pytest.mark.parametrize("damage, words", [("{bad", "not valid JSON"), ("[1]", "damaged (no vae / text_encoder record)"),
                                           ('{"vae": {"path": "v"}}', "damaged (no text_encoder record)"),
                                           ('{"vae": {}, "text_encoder": {"path": "t", "max_length": 8}}',
                                            "damaged (no vae record)")])
def test_a_damaged_data_meta_is_refused_in_one_line(run_copy, tmp_path, capsys, damage, words):
    """The run's data_meta.json names its VAE and text encoder: damaged, it was a JSONDecodeError or a
    TypeError traceback in sample and export; now one line that says how to write it again."""
    (run_copy / "data_meta.json").write_text(damage)
    out = tmp_path / "out"
    assert main(_sample_args(run_copy, out)) == 2
    _one_error_line(capsys, f"{run_copy / 'data_meta.json'}: {words}", "rerunning `latentforge train`")
    assert main(["export", "--checkpoint", str(run_copy), "--out", str(out)]) == 2
    _one_error_line(capsys, words)
    assert not out.exists()


def test_a_train_config_of_another_model_is_refused_in_one_line(run_copy, tmp_path, capsys):
    """The run's train_config.yaml edited (or copied from another run) so that it builds another U-Net:
    sample and export named the first mismatched weight in one line, not torch's list of them all."""
    config = run_copy / "train_config.yaml"
    cfg = yaml.safe_load(config.read_text())
    cfg["train"]["unet"]["layers_per_block"] = 2
    config.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    step_dir = ckpt.find_latest(run_copy)
    assert main(_sample_args(run_copy, out)) == 2
    _one_error_line(capsys, f"{step_dir}: its weights do not fit the model of {config} (Missing key(s) in state_dict: ",
                    " in all)); the checkpoint and that file must come from the same run")
    assert main(["export", "--checkpoint", str(run_copy), "--out", str(out)]) == 2
    _one_error_line(capsys, "its weights do not fit the model of")
    assert not out.exists()


def test_an_exported_pipeline_with_damaged_weights_is_one_line(build_run, exports, tmp_path):
    """Truncated U-Net weights in an export: diffusers raised three chained tracebacks (the demo's
    --rescore showed them); load_exported says which directory and what to do."""
    damaged = Path(shutil.copytree(exports(build_run("bert")), tmp_path / "export"))
    weights = damaged / "unet" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(UserError, match=rf"^{damaged}: the exported pipeline does not load \(.+\); export it again$"):
        load_exported(damaged)


def test_sample_refuses_a_prompt_that_is_not_utf8(build_run, tmp_path, capsys):
    """A terminal in another encoding passes bytes that Python keeps as surrogates: the tokenizer raised a
    TypeError on them."""
    run = build_run("bert").path
    args = _sample_args(run, tmp_path / "out")
    args[args.index("--prompt") + 1] = b"caf\xe9 red".decode("utf-8", "surrogateescape")
    assert main(args) == 2
    _one_error_line(capsys, '--prompt "caf\\xe9 red": not UTF-8 text')
    assert not (tmp_path / "out").exists()


def test_sample_and_export_refuse_a_recipe_or_overrides_they_would_ignore(build_run, tmp_path, capsys):
    run = build_run("bert").path
    out = tmp_path / "out"
    for extra in (["train.optim.lr=1"], ["--recipe", "tiny-cpu"]):
        assert main(_sample_args(run, out) + extra) == 2
        _one_error_line(capsys, "sample: takes no recipe or key=value overrides", extra[-1])
        assert main(["export", "--checkpoint", str(run), "--out", str(out)] + extra) == 2
        _one_error_line(capsys, "export: takes no recipe or key=value overrides", extra[-1])
    assert not out.exists()


def test_sample_refuses_steps_past_the_noise_levels_and_a_non_finite_scale(build_run, tmp_path, capsys):
    run = build_run("bert").path
    args = _sample_args(run, tmp_path / "out")
    steps = args.index("--steps") + 1
    assert main(args[:steps] + ["1000"] + args[steps + 1:]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the models' loading bars
    assert last.startswith("latentforge: error: sampling steps: 1000; give 1 to 999")
    cfg = args.index("--cfg") + 1
    assert main(args[:cfg] + ["nan"] + args[cfg + 1:]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "latentforge: error: guidance scale: nan is not a finite number"
    assert not (tmp_path / "out").exists()


def test_outputs_in_object_storage_are_refused_in_one_line(build_run, tmp_path, capsys, monkeypatch):
    """No command writes to s3:// itself: each says so instead of writing a local folder named s3:."""
    monkeypatch.chdir(tmp_path)
    run = build_run("bert").path
    sample = _sample_args(run, tmp_path)
    sample[sample.index("--out") + 1] = "s3://b/s"
    for command in (sample, ["export", "--checkpoint", str(run), "--out", "s3://b/e"],
                    ["train-vae", str(run), "--out", "s3://b/v"], ["train", "s3://b/run"],
                    ["plan", "--recipe", "tiny-cpu", "--chart", "s3://b/p.png"]):
        assert main(command) == 2
        _one_error_line(capsys, "s3://b/", "this command writes to a local path")
    assert list(tmp_path.iterdir()) == []


def test_sample_refuses_a_file_for_out_or_checkpoint(build_run, tmp_path, capsys):
    run = build_run("bert").path
    (tmp_path / "file").write_text("x")
    assert main(_sample_args(run, tmp_path / "file")) == 2
    _one_error_line(capsys, str(tmp_path / "file"), "is a file; --out names a directory")
    weights = next(ckpt.find_latest(run).glob("*.safetensors"))
    assert main(_sample_args(weights, tmp_path / "out")) == 2
    _one_error_line(capsys, str(weights), "is a file; give the checkpoint directory that holds it")


def test_a_vae_or_text_encoder_replaced_since_the_encode_is_refused(run_copy, assets, tmp_path, capsys):
    """The run's data meta names the VAE and text encoder with their fingerprints: weights swapped
    at those paths since would give wrong images without a word, so sample and export refuse them."""
    meta_path = run_copy / "data_meta.json"
    meta = json.loads(meta_path.read_text())
    for key, asset in (("vae", "vae"), ("text_encoder", "bert")):
        moved = Path(shutil.copytree(assets[asset], tmp_path / f"{key}-copy"))
        meta[key]["path"] = str(moved)
        if key == "text_encoder":
            meta[key]["tokenizer_path"] = str(moved)
    meta_path.write_text(json.dumps(meta))
    assert main(_sample_args(run_copy, tmp_path / "ok")) == 0  # the same weights elsewhere: fine
    capsys.readouterr()
    for key in ("vae", "text_encoder"):
        moved = tmp_path / f"{key}-copy"
        weights = next(moved.glob("*.safetensors"))
        tensors = safetensors.torch.load_file(weights)
        name = sorted(tensors)[0]
        tensors[name] = tensors[name] + 0.5
        safetensors.torch.save_file(tensors, weights, metadata={"format": "pt"})
        assert main(_sample_args(run_copy, tmp_path / f"out-{key}") + ["--quiet"]) == 2  # quiet: no loading bars
        _one_error_line(capsys, str(moved), "not the", "the training data was encoded with")
        assert main(["export", "--checkpoint", str(run_copy), "--out", str(tmp_path / f"exp-{key}"), "--quiet"]) == 2
        _one_error_line(capsys, "the training data was encoded with")
        shutil.rmtree(moved)
        shutil.copytree(assets["vae" if key == "vae" else "bert"], moved)  # restored for the next key


def test_a_checkpoint_outside_its_run_is_refused(run_copy, tmp_path, capsys):
    lone = Path(shutil.copytree(ckpt.find_latest(run_copy), tmp_path / "lone" / "step"))
    assert main(_sample_args(lone, tmp_path / "out")) == 2
    _one_error_line(capsys, "not a latentforge training run")


class _Payload:
    """Unpickling this creates a directory: proof that the loader executed pickled code."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return os.mkdir, (str(self.target),)


def test_sampling_and_export_never_unpickle(run_copy, tmp_path, capsys):
    """A state.pt holding a code-executing pickle, with a marker that vouches for it, is refused."""
    step_dir = ckpt.find_latest(run_copy)
    sentinel = tmp_path / "pwned"
    torch.save({"optimizer": _Payload(sentinel)}, step_dir / ckpt.STATE)
    marker = json.loads((step_dir / ckpt.MARKER).read_text())
    marker["files"][ckpt.STATE] = {"num_bytes": (step_dir / ckpt.STATE).stat().st_size,
                                   "sha256": ckpt._sha256(step_dir / ckpt.STATE)}
    (step_dir / ckpt.MARKER).write_text(json.dumps(marker))
    with pytest.raises(pickle.UnpicklingError):  # the payload is a real pickle the safe loader refuses
        torch.load(step_dir / ckpt.STATE, weights_only=True)

    assert main(_sample_args(run_copy, tmp_path / "samples")) == 2
    _one_error_line(capsys, "refusing to load")
    assert main(["export", "--checkpoint", str(run_copy), "--out", str(tmp_path / "out")]) == 2
    _one_error_line(capsys, "refusing to load")
    assert not sentinel.exists()
    assert not (tmp_path / "samples").exists() and not (tmp_path / "out").exists()


def test_export_refuses_a_vae_with_a_shift_factor(run_copy, assets, tmp_path, capsys):
    """StableDiffusionPipeline decodes latents / scaling_factor and ignores a shift."""
    meta_path = run_copy / "data_meta.json"
    meta = json.loads(meta_path.read_text())
    meta["vae"].update(path=str(assets["vae_shifted"]), shift_factor=0.1)
    meta_path.write_text(json.dumps(meta))
    assert main(["export", "--checkpoint", str(run_copy), "--out", str(tmp_path / "out")]) == 2
    _one_error_line(capsys, "shift_factor")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag, value, start", [("--num-per-prompt", "0", "--num-per-prompt: must be at least 1, got 0"),
                                               ("--steps", "0", "sampling steps: 0; give 1 to 999")])
def test_sample_refuses_nothing_to_do(build_run, tmp_path, capsys, flag, value, start):
    args = _sample_args(build_run("bert").path, tmp_path / "out")
    args[args.index(flag) + 1] = value
    assert main(args) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"latentforge: error: {start}")


def _vouch(step_dir: Path, *names: str) -> None:
    marker = json.loads((step_dir / ckpt.MARKER).read_text())
    for name in names:
        marker["files"][name] = {"num_bytes": (step_dir / name).stat().st_size, "sha256": ckpt._sha256(step_dir / name)}
    (step_dir / ckpt.MARKER).write_text(json.dumps(marker))


@pytest.mark.parametrize("damage", ["pickle", "truncated"])
def test_weights_that_are_not_safetensors_are_one_line_for_sample_and_export(run_copy, tmp_path, capsys, damage):
    step_dir = ckpt.find_latest(run_copy)
    weights = step_dir / "ema.safetensors"  # what sample and export read by default
    if damage == "pickle":
        torch.save({"w": torch.zeros(2)}, weights)
    else:
        weights.write_bytes(weights.read_bytes()[:100])
    _vouch(step_dir, weights.name)
    assert main(_sample_args(run_copy, tmp_path / "samples")) == 2
    _one_error_line(capsys, str(weights), "not a readable safetensors file")
    assert main(["export", "--checkpoint", str(run_copy), "--out", str(tmp_path / "out")]) == 2
    _one_error_line(capsys, str(weights), "not a readable safetensors file")
    assert not (tmp_path / "samples").exists() and not (tmp_path / "out").exists()


def test_a_traversal_name_in_meta_json_is_refused(run_copy, tmp_path, capsys):
    step_dir = ckpt.find_latest(run_copy)
    outside = run_copy.parent / "stolen.safetensors"
    shutil.copyfile(step_dir / "ema.safetensors", outside)
    meta = json.loads((step_dir / ckpt.META).read_text())
    meta["tensors"].append("../../../stolen")
    (step_dir / ckpt.META).write_text(json.dumps(meta))
    _vouch(step_dir, ckpt.META)
    for args in (_sample_args(step_dir, tmp_path / "samples"),
                 ["export", "--checkpoint", str(step_dir), "--out", str(tmp_path / "out")]):
        assert main(args) == 2
        _one_error_line(capsys, "tensor group name '../../../stolen'")
