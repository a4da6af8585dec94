"""The diffusion transformer (train.model: dit): presets against the published architecture, the
denoiser interface, training with EMA and exact resume, sample grids, and an exported
PixArtAlphaPipeline that loads offline and reproduces ``latentforge sample``.

One tiny run (PixArt-alpha ``tiny`` preset, 16x16x4 latents of a tiny VAE at 32 px, a tiny BERT's
16-d text states) is trained once per module.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import yaml
from diffusers import DiffusionPipeline, PixArtAlphaPipeline, PixArtTransformer2DModel

from latentforge import checkpoint as ckpt
from latentforge.cli import main
from latentforge.config import from_dict
from latentforge.data.encode import EncodeConfig, encode_dataset
from latentforge.errors import ConfigError
from latentforge.inference import generate_latents, load_components
from latentforge.models.denoiser import DiTDenoiser, denoiser_for, denoiser_of
from latentforge.models.dit import PRESETS, DiTConfig, dit_diffusers_config, dit_num_params
from latentforge.train.run import RunConfig, train
from latentforge.train.trainer import Trainer, TrainConfig
from sample_cli import sample_cli
from tiny_models import make_raw_dataset, make_tiny_bert, make_tiny_vae

RES = 32  # pixels; the tiny VAE halves it: 16x16x4 latents, 64 tokens at patch 2
MAX_LEN = 12
PROMPTS = ["a small red circle in the corner", "a big blue square"]
STEPS, CFG = 5, 4.0
TOL = 2 / 255
NUM_TRAIN_STEPS = 6


# ------------------------------------------------------------------ presets, on the meta device

# PixArt-alpha/PixArt-XL-2-512x512, transformer/config.json (the architecture fields).
PIXART_XL_2_512 = {
    "activation_fn": "gelu-approximate", "attention_bias": True, "attention_head_dim": 72, "caption_channels": 4096,
    "cross_attention_dim": 1152, "dropout": 0.0, "in_channels": 4, "norm_elementwise_affine": False,
    "norm_eps": 1e-6, "norm_num_groups": 32, "norm_type": "ada_norm_single", "num_attention_heads": 16,
    "num_embeds_ada_norm": 1000, "num_layers": 28, "out_channels": 8, "patch_size": 2, "sample_size": 64,
    "upcast_attention": False,
}


def pixart_params(d: int, layers: int, in_ch: int, out_ch: int, patch: int, text: int, size_cond: bool) -> int:
    """PixArt-alpha's parameters written out from the paper's architecture (arXiv:2310.00426, Fig. 4;
    DiT's blocks, arXiv:2212.09748) with biases everywhere: per block self-attention and
    cross-attention (4 d x d projections each), a 4x MLP and a 6d scale-shift table; the patch
    embedding, adaLN-single (a 256-d sinusoid MLP to d, then d -> 6d), the caption MLP
    (text -> d -> d), the final 2d table and the output projection; with the 1024 px model's
    resolution and aspect-ratio embedders (each 256 -> d/3 -> d/3)."""
    block = 2 * 4 * (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 6 * d
    patch_embed = in_ch * patch * patch * d + d
    adaln = (256 * d + d) + (d * d + d) + (d * 6 * d + 6 * d)
    if size_cond:
        e = d // 3
        adaln += 2 * ((256 * e + e) + (e * e + e))
    caption = (text * d + d) + (d * d + d)
    final = 2 * d + d * patch * patch * out_ch + patch * patch * out_ch
    return layers * block + patch_embed + adaln + caption + final


def test_xl_2_is_pixart_alpha_xl_2_with_its_published_0_6b_parameters_on_meta():
    resolved = dit_diffusers_config(DiTConfig(preset="xl-2"))
    assert {k: resolved[k] for k in PIXART_XL_2_512} == PIXART_XL_2_512
    n = dit_num_params(DiTConfig(preset="xl-2"))
    assert n == pixart_params(1152, 28, 4, 8, 2, 4096, size_cond=False)
    assert round(n / 1e9, 1) == 0.6  # "0.6B" in the paper's Table 1 and the model cards
    # The 1024 px model (sample_size 128) adds the resolution/aspect-ratio conditioning.
    with torch.device("meta"):
        big = PixArtTransformer2DModel(**{**resolved, "sample_size": 128, "use_additional_conditions": True})
    n_big = sum(p.numel() for p in big.parameters())
    assert n_big == pixart_params(1152, 28, 4, 8, 2, 4096, size_cond=True) and round(n_big / 1e9, 1) == 0.6
    # The small/tiny presets follow the same formula at their own sizes.
    for name in ("small", "tiny"):
        p = PRESETS[name]
        d = p["num_attention_heads"] * p["attention_head_dim"]
        assert dit_num_params(DiTConfig(preset=name)) == pixart_params(
            d, p["num_layers"], p["in_channels"], p["out_channels"], p["patch_size"], p["caption_channels"], False)


def test_dit_forward_flops_on_meta_match_the_matmuls_written_out():
    """FLOPs of one image (torch's counter on the meta device) against the matmuls of the tiny
    transformer counted by hand: 2 FLOPs per multiply-add."""
    den = DiTDenoiser(DiTConfig(preset="tiny")).with_data(4, 16, 384)
    p, d, layers, n, text_len, text = 2, 64, 2, (16 // 2) ** 2, 24, 384
    per_block = (2 * n * d * d * 4 + 2 * 2 * n * n * d  # self-attention: q, k, v, out; scores and values
                 + 2 * n * d * d * 2 + 2 * text_len * d * d * 2 + 2 * 2 * n * text_len * d  # cross-attention
                 + 2 * n * d * 4 * d * 2)  # MLP
    rest = (2 * n * 4 * p * p * d  # patch embedding
            + 2 * (256 * d + d * d + d * 6 * d)  # adaLN-single
            + 2 * text_len * (text * d + d * d)  # caption MLP
            + 2 * n * d * p * p * 4)  # output projection
    assert den.forward_flops(16, text_len) == layers * per_block + rest


# ------------------------------------------------------------------ bad input


def test_patch_size_must_divide_the_latent_side():
    with pytest.raises(ConfigError, match=r"^train\.dit\.patch_size: 3 does not divide the sample_size 16"):
        from_dict(TrainConfig, {"model": "dit", "dit": {"sample_size": 16, "patch_size": 3}}, "train")
    den = DiTDenoiser(DiTConfig(preset="tiny", patch_size=3))
    with pytest.raises(ConfigError, match=r"^train\.dit\.patch_size: 3 does not divide the latent side 16"):
        den.with_data(4, 16, 16)


# ------------------------------------------------------------------ the denoiser interface


def test_the_caption_mask_hides_padding_and_the_text_reaches_the_prediction():
    """Through the interface: padded text states change nothing where the mask hides them, and the
    real tokens change the prediction (so training and sampling condition on the text)."""
    torch.manual_seed(0)
    den = DiTDenoiser(DiTConfig(preset="tiny")).with_data(4, 16, 16)
    model = den.build().eval()
    x, t = torch.randn(2, 4, 16, 16), torch.tensor([10, 900])
    text, mask = torch.randn(2, 6, 16), torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]])
    other_padding = torch.where(mask[..., None].bool(), text, torch.randn(2, 6, 16))
    with torch.no_grad():
        a = den.forward(model, x, t, text, mask)
        b = den.forward(model, x, t, other_padding, mask)
        c = den.forward(model, x, t, other_padding, None)
        direct = model(x, encoder_hidden_states=text, timestep=t, encoder_attention_mask=mask).sample
        scalar = den.forward(model, x[:1], torch.tensor(10), text[:1], mask[:1])
    assert a.shape == x.shape
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert (a - c).abs().max() > 1e-3  # without the mask the padding is attended to
    torch.testing.assert_close(a, direct, rtol=0, atol=0)
    torch.testing.assert_close(scalar, a[:1], rtol=1e-5, atol=1e-6)  # a scalar timestep is one per sample
    assert denoiser_of(model).kind == "dit" and denoiser_of(model).pipeline_class == "PixArtAlphaPipeline"


# ------------------------------------------------------------------ a tiny run: train, resume, sample, export


@pytest.fixture(scope="module", autouse=True)
def _one_thread_offline(one_thread_offline):
    """One thread, hub access off (conftest)."""


@pytest.fixture(scope="module")
def latents(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dit_assets")
    vae = make_tiny_vae(root / "vae", shift_factor=None)  # the pipelines ignore a shift factor
    bert = make_tiny_bert(root / "bert")
    raw = make_raw_dataset(root / "raw", n=16, resolution=RES, num_shards=2)
    encode_dataset(str(raw), str(root / "latents"), EncodeConfig(
        vae=str(vae), text_encoder=str(bert), max_length=MAX_LEN, batch_size=8, device="cpu"), progress=False)
    return {"latents": root / "latents", "cache": root / "cache"}


def run_config(latents: dict[str, Path], **train_overrides) -> RunConfig:
    return from_dict(RunConfig, {
        "train": {
            "model": "dit", "dit": {"preset": "tiny"}, "ema": {"decay": 0.5}, "optim": {"lr": 1e-2},
            "phases": [{"datasets": [{"path": str(latents["latents"])}], "steps": NUM_TRAIN_STEPS}],
            "micro_batch_size": 4, "device": "cpu", "loggers": [], "log_every": 1,
            "checkpoint": {"every_steps": NUM_TRAIN_STEPS // 2, "keep_last": 5},
            "noise": {"prediction_type": "v_prediction"},
            "sampling": {"prompts": PROMPTS, "num_steps": 3, "seed": 5, "guidance_scale": 3.0},
            **train_overrides,
        },
        "data": {"num_workers": 0, "caption_dropout": 0.25, "cache_dir": str(latents["cache"])},
    })


@pytest.fixture(scope="module")
def run(latents, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dit_run") / "run"
    summary = train(run_config(latents), path, progress=False)
    assert summary["finished"] and summary["step"] == NUM_TRAIN_STEPS
    return path


def _metrics(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in ("img_per_s", "mfu")}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_run_trains_the_transformer_with_ema_and_logs_its_flops(run):
    cfg = yaml.safe_load((run / "train_config.yaml").read_text())["train"]
    assert cfg["model"] == "dit" and cfg["dit"]["caption_channels"] == 16 and cfg["dit"]["sample_size"] == 16
    c = ckpt.load_checkpoint(ckpt.find_latest(run))
    assert set(c.tensors) >= {"model", "ema"}
    assert any(k.startswith("transformer_blocks.1.attn2.") for k in c.tensors["model"])
    assert not all(torch.equal(c.tensors["model"][k], c.tensors["ema"][k]) for k in c.tensors["model"])
    losses = [r["loss"] for r in _metrics(run)]
    assert len(losses) == NUM_TRAIN_STEPS and all(np.isfinite(losses))
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["mfu"] > 0 for r in lines)  # FLOPs per image counted for the transformer
    assert (run / "samples" / f"step-{NUM_TRAIN_STEPS:08d}.png").exists()


class Killed(BaseException):
    pass


def test_resume_is_exact(run, latents, tmp_path, monkeypatch):
    """A crash two steps after the middle checkpoint, then a resumed run: every logged record and
    the final model and EMA are bit for bit those of the uninterrupted run."""
    original = Trainer.train_step

    def crash(self, batches):
        if self.step + 1 == NUM_TRAIN_STEPS // 2 + 2:
            raise Killed()
        return original(self, batches)

    resumed = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(Trainer, "train_step", crash)
        with pytest.raises(Killed):
            train(run_config(latents), resumed, progress=False)
    assert [r["step"] for r in _metrics(resumed)] == list(range(1, NUM_TRAIN_STEPS // 2 + 2))
    train(run_config(latents), resumed, progress=False)
    assert _metrics(resumed) == _metrics(run)
    a, b = ckpt.load_checkpoint(ckpt.find_latest(run)), ckpt.load_checkpoint(ckpt.find_latest(resumed))
    for group in ("model", "ema"):
        assert a.tensors[group].keys() == b.tensors[group].keys()
        assert all(torch.equal(a.tensors[group][k], b.tensors[group][k]) for k in a.tensors[group])


def masked_config(latents: dict[str, Path]) -> RunConfig:
    """The run with 75% of the patches masked after a 1-block mixer for 5 steps, then an unmasked
    last step (a phase with masking_ratio 0, as MicroDiT ends)."""
    phase = {"datasets": [{"path": str(latents["latents"])}]}
    return run_config(latents, masking={"ratio": 0.75, "mixer_blocks": 1},
                      phases=[{**phase, "steps": NUM_TRAIN_STEPS - 1}, {**phase, "steps": 1, "masking_ratio": 0.0}])


def test_a_masked_run_resumes_exactly_and_ends_unmasked(run, latents, tmp_path, monkeypatch):
    """Masks are drawn from (seed, position): a crash two steps after the middle checkpoint, then
    a resumed run, gives every logged record and the final weights bit for bit. The masked forward
    ran on the 5 masked steps only (guard), and the masked losses are not the unmasked run's."""
    calls = []
    original_tokens, original_step = DiTDenoiser.forward_tokens, Trainer.train_step

    def counted(self, model, latents, timesteps, text, text_mask, keep, mixer_blocks=0):
        if latents.device.type != "meta":  # (the FLOPs per image are counted on meta)
            calls.append((keep.shape[1], mixer_blocks))
        return original_tokens(self, model, latents, timesteps, text, text_mask, keep, mixer_blocks)

    def crash(self, batches):
        if self.step + 1 == NUM_TRAIN_STEPS // 2 + 2:
            raise Killed()
        return original_step(self, batches)

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    with monkeypatch.context() as m:
        m.setattr(DiTDenoiser, "forward_tokens", counted)
        train(masked_config(latents), straight, progress=False)
    assert calls == [(16, 1)] * (NUM_TRAIN_STEPS - 1)  # 64 tokens, 16 kept; not in the last phase
    with monkeypatch.context() as m:
        m.setattr(Trainer, "train_step", crash)
        with pytest.raises(Killed):
            train(masked_config(latents), resumed, progress=False)
    train(masked_config(latents), resumed, progress=False)
    assert _metrics(resumed) == _metrics(straight)
    a, b = ckpt.load_checkpoint(ckpt.find_latest(straight)), ckpt.load_checkpoint(ckpt.find_latest(resumed))
    assert all(torch.equal(a.tensors["model"][k], b.tensors["model"][k]) for k in a.tensors["model"])
    masked, unmasked = [r["loss"] for r in _metrics(straight)], [r["loss"] for r in _metrics(run)]
    assert masked[0] != unmasked[0]  # the same first batch, noise and weights: only the masking differs
    lines = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["mfu"] < lines[-1]["mfu"] * lines[0]["img_per_s"] / lines[-1]["img_per_s"]  # fewer FLOPs masked


def test_resume_as_a_unet_is_refused(run, latents, tmp_path):
    from latentforge.errors import UserError

    with pytest.raises(UserError, match=r"resuming with a different train\.model"):
        train(run_config(latents, model="unet"), run, progress=False)


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dit_export") / "pipe"
    assert main(["export", "--checkpoint", str(run), "--out", str(out)]) == 0
    return out


def test_exported_pixart_pipeline_loads_offline_and_reproduces_sample(run, exported, tmp_path):
    index = json.loads((exported / "model_index.json").read_text())
    assert index["_class_name"] == "PixArtAlphaPipeline"
    assert index["transformer"] == ["diffusers", "PixArtTransformer2DModel"]
    assert index["text_encoder"] == ["transformers", "BertModel"]
    exported_weights = safetensors.torch.load_file(exported / "transformer" / "diffusion_pytorch_model.safetensors")
    ema = ckpt.load_checkpoint(ckpt.find_latest(run)).tensors["ema"]
    assert exported_weights.keys() == ema.keys() and all(torch.equal(exported_weights[k], ema[k]) for k in ema)

    pipe = DiffusionPipeline.from_pretrained(str(exported), local_files_only=True)
    assert isinstance(pipe, PixArtAlphaPipeline)
    pipe.set_progress_bar_config(disable=True)
    call = json.loads((exported / "latentforge_export.json").read_text())["call"]
    assert call == {"use_resolution_binning": False, "clean_caption": False, "max_sequence_length": MAX_LEN}

    def theirs(output_type: str):
        return pipe(PROMPTS, num_inference_steps=STEPS, guidance_scale=CFG, height=RES, width=RES,
                    generator=torch.Generator("cpu").manual_seed(7), output_type=output_type, **call).images

    images = theirs("np")
    ours = sample_cli(run, tmp_path / "samples", PROMPTS, seed=7, steps=STEPS, cfg=CFG)
    assert images.shape == ours.shape == (len(PROMPTS), RES, RES, 3)
    assert np.abs(images - ours).max() <= TOL
    assert np.abs(ours[0] - ours[1]).max() > 10 * TOL  # the prompts matter
    c = load_components(run)
    our_latents = generate_latents(c.model, c.text_model, c.tokenizer, c.noise, c.max_length, PROMPTS, 7, STEPS, CFG)
    torch.testing.assert_close(theirs("latent"), our_latents, rtol=1e-5, atol=1e-5)
    # One step: PixArt returns the step's predicted clean latents, not the scheduler's next sample
    one = pipe(PROMPTS, num_inference_steps=1, guidance_scale=CFG, height=RES, width=RES,
               generator=torch.Generator("cpu").manual_seed(7), output_type="latent", **call).images
    torch.testing.assert_close(one, generate_latents(c.model, c.text_model, c.tokenizer, c.noise, c.max_length, PROMPTS,
                                                     7, 1, CFG), rtol=1e-5, atol=1e-5)


def test_fine_tuning_an_exported_transformer_into_a_unet_is_one_line(exported, latents, tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"train": {"phases": [{"datasets": [{"path": str(latents["latents"])}],
                                                            "steps": 1}], "device": "cpu", "loggers": []}}))
    code = main(["finetune", str(tmp_path / "run"), "--from", str(exported), "--recipe", str(recipe), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "train.model: unet, but" in err and "set train.model: dit to fine-tune it" in err, err


def test_cli_patch_size_that_does_not_divide_the_latents_is_one_line(latents, tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"train": {"model": "dit", "phases": [
        {"datasets": [{"path": str(latents["latents"])}], "steps": 1}], "device": "cpu", "loggers": []},
        "loader": {"cache_dir": str(latents["cache"])}}))
    code = main(["train", str(tmp_path / "run"), "--recipe", str(recipe), "--quiet", "train.dit.patch_size=3"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    # the tiny preset's default sample size is the latents' 16: the recipe is refused as it loads
    assert err.startswith("latentforge: error: train.dit.patch_size: 3 does not divide the sample_size 16"), err
    assert not (tmp_path / "run").exists()


def test_plan_bench_and_auto_micro_batch_take_the_transformer(tmp_path):
    """The demo recipe with train.model=dit: FLOPs per image of the planner are the transformer's
    (counted on meta), bench times its real training step, and micro_batch_size auto sizes it."""
    from latentforge.plan.bench import run_bench
    from latentforge.train.memory import resolve_auto_micro_batch
    from latentforge.plan.shapes import recipe_phases
    from latentforge.recipe import load_recipe

    recipe = load_recipe("tiny-cpu", ["train.model=dit", "train.global_batch_size=32", "train.micro_batch_size=4"])
    den = denoiser_for(recipe.train).with_data(4, 16, 384)
    (phase,) = recipe_phases(recipe)
    assert phase.flops_per_image == 3 * den.forward_flops(16, recipe.encode.max_length)
    result = run_bench(recipe, steps=1, warmup=0, synthetic=True, progress=False)
    (row,) = result["phases"]
    assert row["flops_per_image"] == phase.flops_per_image and row["step_seconds"]["median"] > 0
    auto = replace_micro(recipe.train)
    sized = resolve_auto_micro_batch(auto, [(16, 24)], torch.device("cpu"), 1, budget=(64 << 20, False, "64 MiB"))
    assert 1 <= sized.phases[0].micro_batch_size <= 32 and 32 % sized.phases[0].micro_batch_size == 0


def replace_micro(train_cfg):
    from dataclasses import replace

    return replace(train_cfg, micro_batch_size="auto")


@pytest.mark.slow
@pytest.mark.parametrize("masking", [None, {"ratio": 0.5, "mixer_blocks": 1}], ids=["unmasked", "masked"])
def test_ddp_and_fsdp_per_transformer_block_with_checkpointing_match_one_process(tmp_path, one_thread, masking):
    """The transformer on 2 gloo ranks (DDP; FSDP2 sharded per transformer block with activation
    checkpointing) against one process: the same losses, gradient norms and final weights, as
    tests/test_distributed.py checks for the U-Net; also with patch masking (its forward goes
    through the DDP wrapper and FSDP2's root hooks, the blocks called as modules)."""
    from latent_fixtures import build_latent_data
    from latentforge.distributed.dcp import is_sharded_checkpoint
    from test_distributed import assert_close_runs, recipe, run_ranks, train_cmd, write_recipe

    data = build_latent_data(tmp_path / "data")
    runs = {}
    for strategy, parallel in (("none", {}), ("ddp", {}), ("fsdp", {"activation_checkpointing": True})):
        cfg = recipe(data, strategy, **parallel)
        cfg["train"]["model"] = "dit"
        if masking:
            cfg["train"]["masking"] = masking
        runs[strategy] = tmp_path / f"run-{strategy}"
        if strategy == "none":
            train(from_dict(RunConfig, {"train": cfg["train"], "data": cfg["loader"]}), runs[strategy], progress=False)
        else:
            run_ranks(train_cmd(runs[strategy], write_recipe(tmp_path / f"{strategy}.yaml", cfg)))
    saved = yaml.safe_load((runs["fsdp"] / "train_config.yaml").read_text())["train"]
    assert saved["model"] == "dit" and saved["masking"]["ratio"] == (masking or {"ratio": 0.0})["ratio"]
    assert_close_runs(runs["none"], runs["ddp"])
    assert_close_runs(runs["none"], runs["fsdp"])
    assert is_sharded_checkpoint(ckpt.find_latest(runs["fsdp"]))
