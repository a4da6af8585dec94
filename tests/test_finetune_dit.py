"""Fine-tuning a PixArtAlphaPipeline that latentforge exported from a ``train.model: dit`` run:
full and LoRA, exact resume, the merged export (offline, reproducing ``sample``), and the
refusals of a base of one family into a recipe of another.

The base is made the way a user's would be: a tiny transformer (PixArt ``tiny`` preset, 2
blocks) trained 2 steps with flow matching on 16x16x4 latents of a tiny VAE at 32 px and a tiny
BERT's 16-d text states, exported with ``latentforge export``; the raw data is then re-encoded
with ``latentforge encode --from BASE`` and fine-tuned with ``latentforge finetune --from BASE``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from diffusers import DiffusionPipeline, PixArtAlphaPipeline, PixArtTransformer2DModel

from latentforge.cli import main
from latentforge.config import from_dict, load_config
from latentforge.data.encode import EncodeConfig, encode_dataset
from latentforge.data.schema import read_index
from latentforge.train.finetune import build_finetune_model, open_base
from latentforge.train.run import TRAIN_CONFIG, RunConfig, train
from test_finetune import _one_error_line, make_tiny_pipeline
from test_trainer import Killed, assert_same_tensors, checkpoint_steps, kill_before_step, load_step, metrics
from sample_cli import sample_cli
from tiny_models import make_raw_dataset, make_tiny_bert, make_tiny_vae

RES = 32  # pixels; the tiny VAE halves it: 16x16x4 latents
MAX_LEN = 12
STEPS = 4
LR = 1e-3
LORA_RANK, LORA_ALPHA = 2, 4
TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
PROMPTS = ["a small red circle in the corner", "a big blue square"]
TOL = 2 / 255


@pytest.fixture(scope="module", autouse=True)
def _one_thread_offline(one_thread_offline):
    """One thread, hub access off (conftest)."""


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("finetune_dit")
    raw = make_raw_dataset(root / "raw", n=16, resolution=RES, num_shards=2)
    vae = make_tiny_vae(root / "vae", shift_factor=None)  # the pipelines ignore a shift factor
    bert = make_tiny_bert(root / "bert")
    encode_dataset(str(raw), str(root / "scratch-latents"), EncodeConfig(
        vae=str(vae), text_encoder=str(bert), max_length=MAX_LEN, batch_size=8, device="cpu"), progress=False)
    scratch = from_dict(RunConfig, {
        "train": {"model": "dit", "dit": {"preset": "tiny"}, "optim": {"lr": 1e-2}, "micro_batch_size": 4,
                  "phases": [{"datasets": [{"path": str(root / "scratch-latents")}], "steps": 2}],
                  "device": "cpu", "loggers": [], "noise": {"prediction_type": "flow_matching", "flow_shift": 2.0}},
        "data": {"num_workers": 0, "cache_dir": str(root / "cache")}})
    train(scratch, root / "scratch-run", progress=False)
    base = root / "base"
    assert main(["export", "--checkpoint", str(root / "scratch-run"), "--out", str(base)]) == 0
    latents = root / "latents"
    assert main(["encode", str(raw), "--from", str(base), "--out", str(latents), "--quiet", "encode.device=cpu",
                 "encode.batch_size=8"]) == 0
    # No encode.max_length given: the exported tokenizer's, the length the run trained at (not SD's 77).
    assert read_index(str(latents)).meta["text_encoder"]["max_length"] == MAX_LEN
    return {"raw": raw, "base": base, "latents": latents, "cache": root / "cache", "root": root}


def finetune_args(assets, run_dir: Path, *overrides: str, base: Path | None = None) -> list[str]:
    return ["finetune", str(run_dir), "--from", str(base or assets["base"]), "--quiet", "train.model=dit",
            f"train.phases=[{{datasets: [{{path: '{assets['latents']}'}}], steps: {STEPS}}}]",
            "train.micro_batch_size=4", "train.device=cpu", "train.loggers=[]", "train.log_every=1",
            "train.checkpoint.every_steps=2", "train.checkpoint.keep_last=10", f"train.optim.lr={LR}",
            "train.optim.warmup_steps=0", "train.ema.decay=0.5", "loader.num_workers=0",
            f"loader.cache_dir={assets['cache']}", *overrides]


LORA = (f"train.lora={{rank: {LORA_RANK}, alpha: {LORA_ALPHA}}}", "train.optim.lr=1e-2")


def base_weights(assets) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(assets["base"] / "transformer" / "diffusion_pytorch_model.safetensors")


def resumes_exactly(assets, tmp_path: Path, monkeypatch, *overrides: str) -> Path:
    """A straight run, and one killed before step 4 then rerun: the same losses and weights bit for bit."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(finetune_args(assets, straight, *overrides)) == 0
    with monkeypatch.context() as m:
        kill_before_step(m, 4)
        with pytest.raises(Killed):
            main(finetune_args(assets, resumed, *overrides))
    assert checkpoint_steps(resumed) == [2]
    assert main(finetune_args(assets, resumed, *overrides)) == 0
    assert metrics(resumed) == metrics(straight)
    assert_same_tensors(load_step(straight, STEPS), load_step(resumed, STEPS))
    return straight


def load_export(out: Path) -> tuple[PixArtAlphaPipeline, dict]:
    pipe = DiffusionPipeline.from_pretrained(str(out), local_files_only=True)
    assert isinstance(pipe, PixArtAlphaPipeline)
    pipe.set_progress_bar_config(disable=True)
    return pipe, json.loads((out / "latentforge_export.json").read_text())["call"]


def transformer_out(model: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    """The transformer's prediction for fixed random inputs (to compare models, not pipelines)."""
    g = torch.Generator().manual_seed(seed)
    x, text = torch.randn(2, 4, 16, 16, generator=g), torch.randn(2, MAX_LEN, 16, generator=g)
    mask = torch.ones(2, MAX_LEN)
    mask[1, 5:] = 0
    with torch.no_grad():
        return model(x, encoder_hidden_states=text, encoder_attention_mask=mask, timestep=torch.tensor([100, 700]),
                     added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False)[0]


# ------------------------------------------------------------------ encoding from the pipeline


@pytest.mark.parametrize("where", ["override", "recipe"])
def test_a_caption_length_the_user_sets_wins_over_the_pipelines(assets, tmp_path, where):
    """``encode --from`` takes the pipeline tokenizer's length (the fixture: 12) only when neither an
    override nor the recipe file sets ``encode.max_length``."""
    args = ["encode", str(assets["raw"]), "--from", str(assets["base"]), "--out", str(tmp_path / "lat"), "--quiet",
            "encode.device=cpu", "encode.batch_size=8"]
    if where == "override":
        args.append("encode.max_length=8")
    else:
        (tmp_path / "r.yaml").write_text("encode:\n  max_length: 8\n")
        args += ["--recipe", str(tmp_path / "r.yaml")]
    assert main(args) == 0
    assert read_index(str(tmp_path / "lat")).meta["text_encoder"]["max_length"] == 8


# ------------------------------------------------------------------ full fine-tuning


def test_full_finetune_starts_at_the_base_resumes_exactly_and_exports(assets, tmp_path, monkeypatch):
    base = base_weights(assets)
    # Step 0 is the base: the model fine-tuning builds holds DIR/transformer's weights exactly.
    start = build_finetune_model(open_base(assets["base"]), None).state_dict()
    assert start.keys() == base.keys() and all(torch.equal(start[k], base[k]) for k in base)

    straight = resumes_exactly(assets, tmp_path, monkeypatch)
    saved = load_config(RunConfig, straight / TRAIN_CONFIG).train
    assert saved.model == "dit"
    # The schedule is DIR/scheduler's: the flow-matching objective and shift the base was trained with.
    assert (saved.noise.prediction_type, saved.noise.flow_shift) == ("flow_matching", 2.0)
    # ... and moved: Adam moves each weight by at most ~lr per step; a fresh initialisation would be O(0.1) away.
    trained = load_step(straight, STEPS).tensors["model"]
    assert trained.keys() == base.keys()
    drift = max(float((trained[k] - base[k]).abs().max()) for k in base)
    assert 0.1 * LR < drift <= 1.5 * STEPS * LR

    out = tmp_path / "export"
    assert main(["export", "--checkpoint", str(straight), "--out", str(out)]) == 0
    exported = safetensors.torch.load_file(out / "transformer" / "diffusion_pytorch_model.safetensors")
    ema = load_step(straight, STEPS).tensors["ema"]
    assert exported.keys() == ema.keys() and all(torch.equal(exported[k], ema[k]) for k in ema)
    pipe, call = load_export(out)
    images = pipe(PROMPTS, num_inference_steps=3, guidance_scale=3.0, height=RES, width=RES,
                  generator=torch.Generator("cpu").manual_seed(7), output_type="np", **call).images
    ours = sample_cli(straight, tmp_path / "samples", PROMPTS, seed=7, steps=3, cfg=3.0)
    assert images.shape == ours.shape == (len(PROMPTS), RES, RES, 3)
    assert np.abs(images - ours).max() <= TOL
    assert np.abs(ours[0] - ours[1]).max() > 10 * TOL  # the prompts matter


# ------------------------------------------------------------------ LoRA


def merged_by_hand(assets, adapters: dict[str, torch.Tensor]) -> PixArtTransformer2DModel:
    """The base transformer with W + (alpha / r) B A written into each adapted Linear (Hu et al. 2021, eq. 3)."""
    model = PixArtTransformer2DModel.from_pretrained(str(assets["base"]), subfolder="transformer")
    state = model.state_dict()
    names = {k.split(".lora_A.")[0] for k in adapters if ".lora_A." in k}
    for name in names:
        a, b = adapters[f"{name}.lora_A.default.weight"], adapters[f"{name}.lora_B.default.weight"]
        state[f"{name}.weight"] = state[f"{name}.weight"] + (LORA_ALPHA / LORA_RANK) * (b @ a)
    model.load_state_dict(state)
    return model.eval()


def test_lora_trains_only_the_adapters_resumes_exactly_and_exports_merged(assets, tmp_path, monkeypatch, trainers):
    run = resumes_exactly(assets, tmp_path, monkeypatch, *LORA)
    model = trainers[0].model
    # The expected adapters, counted from the base transformer: r x (in + out) per targeted Linear.
    reference = PixArtTransformer2DModel.from_pretrained(str(assets["base"]), subfolder="transformer")
    targeted = {name: m for name, m in reference.named_modules()
                if isinstance(m, torch.nn.Linear) and any(name.endswith("." + t) for t in TARGETS)}
    assert {n.split(".")[2] for n in targeted} == {"attn1", "attn2"}  # self- and cross-attention
    num_expected = sum(LORA_RANK * (m.in_features + m.out_features) for m in targeted.values())
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert sum(p.numel() for p in trainable.values()) == num_expected
    assert {n.split(".lora_")[0] for n in trainable} == set(targeted)
    optimized = [p for g in trainers[0].optimizer.param_groups for p in g["params"]]
    assert sum(p.numel() for p in optimized) == num_expected
    # The frozen base is bitwise DIR/transformer after training; checkpoints hold the adapters (and their EMA) only.
    base = base_weights(assets)
    state = {k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if ".lora_" not in k}
    assert state.keys() == base.keys() and all(torch.equal(state[k], base[k]) for k in base)
    final = load_step(run, STEPS)
    assert set(final.tensors["model"]) == set(trainable) == set(final.tensors["ema"])
    assert any(float(t.abs().max()) > 0 for k, t in final.tensors["ema"].items() if ".lora_B." in k)  # B started at 0

    out = tmp_path / "merged"
    assert main(["export", "--checkpoint", str(run), "--out", str(out)]) == 0
    assert json.loads((out / "latentforge_export.json").read_text())["kind"] == "merged-lora"
    pipe, call = load_export(out)
    assert pipe.transformer.state_dict().keys() == base.keys()  # no adapter layers left
    merged = transformer_out(pipe.transformer)
    torch.testing.assert_close(merged, transformer_out(merged_by_hand(assets, final.tensors["ema"])),
                               rtol=1e-5, atol=1e-5)  # merged export = base + adapters
    assert float((merged - transformer_out(reference.eval())).abs().max()) > 1e-4  # and the adapters matter
    images = pipe(PROMPTS, num_inference_steps=2, guidance_scale=3.0, height=RES, width=RES,
                  generator=torch.Generator("cpu").manual_seed(3), output_type="np", **call).images
    assert np.abs(images - sample_cli(run, tmp_path / "samples", PROMPTS, seed=3, steps=2, cfg=3.0)).max() <= TOL


def test_a_transformer_lora_file_is_refused_in_one_line(assets, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(finetune_args(assets, run, *LORA, "train.phases.0.steps=1", "train.ema=null")) == 0
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "e"), "--lora-file"]) == 2
    _one_error_line(capsys, "--lora-file", "PixArtAlphaPipeline has no load_lora_weights", "export the merged")
    assert not (tmp_path / "e").exists()


# ------------------------------------------------------------------ one family into another


def test_a_recipe_of_the_other_family_is_one_line(assets, tmp_path, capsys):
    run = tmp_path / "run"
    args = finetune_args(assets, run)
    args.remove("train.model=dit")  # the recipe's default: the U-Net
    assert main(args) == 2
    _one_error_line(capsys, "train.model: unet", "PixArtAlphaPipeline", "set train.model: dit")
    assert main(finetune_args(assets, run, "train.dit.num_layers=4")) == 2
    _one_error_line(capsys, "train.dit:", "remove train.dit")
    assert main(finetune_args(assets, run, "train.unet.block_out_channels=[8,16]")) == 2
    _one_error_line(capsys, "train.unet:", "transformer", "remove train.unet")
    # A Stable Diffusion pipeline into a transformer recipe.
    sd = make_tiny_pipeline(tmp_path / "sd", "sd1")
    assert main(finetune_args(assets, run, base=sd)) == 2
    _one_error_line(capsys, "train.model: dit", "StableDiffusionPipeline", "set train.model: unet")
    assert not run.exists()


def test_a_transformer_that_predicts_a_learned_variance_is_one_line(assets, tmp_path, capsys):
    """PixArt-alpha's published transformers predict 8 channels (noise and variance) from 4."""
    pipe = Path(shutil.copytree(assets["base"], tmp_path / "pipe"))
    config = json.loads((pipe / "transformer" / "config.json").read_text())
    (pipe / "transformer" / "config.json").write_text(json.dumps({**config, "out_channels": 8}))
    assert main(finetune_args(assets, tmp_path / "run", base=pipe)) == 2
    _one_error_line(capsys, "predicts 8 channels", "the 4 latent channels")


@pytest.mark.parametrize("index_edit, words", [
    (lambda i: {**i, "unet": ["diffusers", "UNet2DConditionModel"]}, ["with both a unet and a transformer"]),
    (lambda i: {k: v for k, v in i.items() if k != "transformer"}, ["with neither a unet nor a transformer"]),
    (lambda i: {**i, "transformer": ["diffusers", "SD3Transformer2DModel"]}, []),
])
def test_a_pipeline_that_is_neither_family_is_one_line(assets, tmp_path, capsys, index_edit, words):
    pipe = Path(shutil.copytree(assets["base"], tmp_path / "pipe"))
    index = json.loads((pipe / "model_index.json").read_text())
    (pipe / "model_index.json").write_text(json.dumps(index_edit(index)))
    if not words:  # a transformer of another class in the transformer folder
        config = json.loads((pipe / "transformer" / "config.json").read_text())
        (pipe / "transformer" / "config.json").write_text(json.dumps({**config, "_class_name": "SD3Transformer2DModel"}))
        words = ["holds a SD3Transformer2DModel, not a PixArtTransformer2DModel"]
    assert main(finetune_args(assets, tmp_path / "run", base=pipe)) == 2
    _one_error_line(capsys, str(pipe), *words)
    assert not (tmp_path / "run").exists()
