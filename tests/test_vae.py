"""The VAE trained by ``train_vae``: held-out reconstruction above a calibrated PSNR bound, the
latent std behind ``scaling_factor`` against a direct computation on encoded latents, and the
PSNR helper on images whose PSNR is known."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from latentforge import checkpoint as ckpt
from latentforge.config import save_config
from latentforge.data.loader import LoaderConfig, StreamConfig
from latentforge.models.autoencoder import load_vae
from latentforge.train import vae as vae_module
from latentforge.errors import ConfigError, UserError
from latentforge.train.vae import VAETrainConfig, _load_eval_images, noise_latents, psnr, reconstruction_loss, train_vae
from tiny_models import make_raw_dataset

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 150
# Calibration (STEPS = 150, batch 16, lr 2e-3, this machine), held-out PSNR of vae_config(seed):
#   seeds 0, 1, 2, the real training:                     13.33, 14.58, 13.82 dB;
#   seeds 0, 1, an encoder fed the next image (broken_build): 11.59, 11.59 dB;
#   a mid-grey image (all zeros) for every held-out image:    11.64 dB.
# The bound sits between them: 0.8 dB under the worst healthy seed (17% more MSE) and 0.9 dB
# over the broken runs. The margin is narrow in dB because 150 steps of this 8/16-channel VAE only
# start to beat a flat image; more steps widen it (300 steps of seed 0: 14.3 dB) at twice the time.
BOUND_DB = 12.5
SHORT_STEPS = 10  # the scale-factor and evaluation checks need a trained VAE, not a good one


def ref_psnr(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """PSNR = 10 log10(MAX^2 / MSE) per image, MAX = 2 for pixel values in [-1, 1] (float64)."""
    x, y = np.clip(x, -1, 1).astype(np.float64), np.clip(y, -1, 1).astype(np.float64)
    mse = ((x - y) ** 2).reshape(len(x), -1).mean(1)
    return 10 * np.log10(4.0 / mse)


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vae_data")
    return {"train": make_raw_dataset(root / "train", 48, 16, num_shards=2),
            "held": make_raw_dataset(root / "held", 16, 16, num_shards=1, seed=1),
            "cache": root / "cache"}


def vae_config(raw: dict[str, Path], seed: int, steps: int = STEPS) -> VAETrainConfig:
    cfg = VAETrainConfig(data=LoaderConfig(datasets=[StreamConfig(path=str(raw["train"]))], num_workers=0, seed=seed,
                                           cache_dir=str(raw["cache"])),
                         eval_dataset=str(raw["held"]), num_eval=16, steps=steps, batch_size=16, warmup_steps=10,
                         scale_samples=48, log_every=50, seed=seed)
    cfg.model.block_out_channels = (8, 16)
    cfg.model.norm_num_groups = 4
    cfg.model.sample_size = 16
    return cfg


def broken_build(cfg):
    """A VAE whose encoder sees the next image of the batch: its latents hold nothing about the
    image the decoder must reconstruct (a misaligned batch)."""
    vae = REAL_BUILD(cfg)
    encode = vae.encode
    vae.encode = lambda x, *args, **kwargs: encode(x.roll(1, dims=0), *args, **kwargs)
    return vae


REAL_BUILD = vae_module.build_vae


def all_images(path: Path) -> torch.Tensor:
    return _load_eval_images(str(path), 10**9)


# ------------------------------------------------------------------------------ the PSNR helper


def test_psnr_of_identical_images_is_the_floor():
    x = torch.rand(3, 3, 8, 8) * 2 - 1
    assert psnr(x, x.clone()).tolist() == pytest.approx([100.0] * 3)  # MSE floored at 1e-10


def test_psnr_of_a_known_mse():
    g = torch.Generator().manual_seed(0)
    y = torch.rand((4, 3, 8, 8), generator=g) * 1.6 - 0.8  # in [-0.8, 0.8]
    d = torch.tensor([0.01, 0.05, 0.1, 0.2]).view(-1, 1, 1, 1)
    x = y + d * torch.sign(torch.randn((4, 3, 8, 8), generator=g))  # stays in [-1, 1]
    # |x - y| = d everywhere: MSE on the [0, 1] scale is (d / 2)^2, PSNR = -20 log10(d / 2)
    expected = [-20 * math.log10(v / 2) for v in (0.01, 0.05, 0.1, 0.2)]
    assert psnr(x, y).tolist() == pytest.approx(expected, abs=1e-3)
    assert psnr(x, y).numpy() == pytest.approx(ref_psnr(x.numpy(), y.numpy()), abs=1e-3)


def test_psnr_clamps_to_the_pixel_range():
    y = torch.ones(2, 3, 4, 4)
    over = torch.stack([torch.full((3, 4, 4), 5.0), torch.full((3, 4, 4), -3.0)])
    # 5 is clamped to 1 (identical: the floor), -3 to -1 (the largest error: MSE 1 on [0, 1], 0 dB)
    assert psnr(over, y).tolist() == pytest.approx([100.0, 0.0], abs=1e-4)
    assert psnr(y, over).tolist() == pytest.approx([100.0, 0.0], abs=1e-4)


# ------------------------------------------------------------------------------ the loss terms


def ref_terms(rec: np.ndarray, x: np.ndarray, color_weight: float) -> dict[str, float]:
    """The reconstruction terms written out with loops over pixels (float64): each pixel weighted
    by 1 + color_weight * (max - min of its target RGB) / 2, and the L1 distance between the
    forward differences of the reconstruction and of the target, taken separately."""
    n, c, h, w = x.shape
    l1 = mse = 0.0
    for i in range(n):
        for r in range(h):
            for q in range(w):
                px = x[i, :, r, q].astype(np.float64)
                wgt = 1.0 + color_weight * (px.max() - px.min()) / 2
                e = rec[i, :, r, q].astype(np.float64) - px
                l1 += wgt * np.abs(e).sum()
                mse += wgt * (e ** 2).sum()
    dx = np.abs(np.diff(rec.astype(np.float64), axis=3) - np.diff(x.astype(np.float64), axis=3)).mean()
    dy = np.abs(np.diff(rec.astype(np.float64), axis=2) - np.diff(x.astype(np.float64), axis=2)).mean()
    return {"l1": l1 / x.size, "mse": mse / x.size, "grad": (dx + dy) / 2}


@pytest.mark.parametrize("color_weight", [0.0, 3.0])
def test_reconstruction_loss_matches_a_loop_over_pixels(color_weight):
    g = torch.Generator().manual_seed(0)
    x = torch.rand((2, 3, 5, 7), generator=g) * 2 - 1
    x[0, :, :2] = 0.3  # a gray band: chroma 0, weight 1
    rec = x + 0.3 * torch.randn((2, 3, 5, 7), generator=g)
    terms = reconstruction_loss(rec, x, l1_weight=0.5, mse_weight=2.0, grad_weight=1.5, color_weight=color_weight)
    ref = ref_terms(rec.numpy(), x.numpy(), color_weight)
    for k in ("l1", "mse", "grad"):
        assert float(terms[k]) == pytest.approx(ref[k], rel=1e-5), k
    assert float(terms["loss"]) == pytest.approx(0.5 * ref["l1"] + 2.0 * ref["mse"] + 1.5 * ref["grad"], rel=1e-5)


def test_reconstruction_loss_by_hand():
    """One 1x2 image whose numbers can be checked on paper: a gray pixel (0, 0, 0) and a red one
    (1, -1, -1) reconstructed with errors 0.2 and -0.4 in every channel."""
    x = torch.tensor([[[[0.0, 1.0]], [[0.0, -1.0]], [[0.0, -1.0]]]])
    rec = x + torch.tensor([0.2, -0.4]).view(1, 1, 1, 2)
    t = reconstruction_loss(rec, x, grad_weight=1.0, color_weight=1.0)
    # red: chroma (1 - (-1)) / 2 = 1, weight 2; gray: weight 1. L1 = (3 * 0.2 * 1 + 3 * 0.4 * 2) / 6
    assert float(t["l1"]) == pytest.approx((0.6 + 2.4) / 6)
    assert float(t["mse"]) == pytest.approx((3 * 0.04 + 3 * 0.16 * 2) / 6)
    # two identical rows: horizontal difference error |(-0.4) - 0.2| = 0.6 per channel, vertical 0
    t = reconstruction_loss(rec.repeat(1, 1, 2, 1), x.repeat(1, 1, 2, 1), grad_weight=1.0)
    assert float(t["grad"]) == pytest.approx((0.6 + 0.0) / 2)


def test_the_edge_term_ignores_a_constant_offset_and_sees_a_blurred_edge():
    x = -torch.ones(1, 3, 8, 8)
    x[..., 2:6, 2:6] = 1.0  # a white square on black
    shifted = x + 0.1  # same edges: only the pixel terms see it
    t = reconstruction_loss(shifted, x, grad_weight=1.0)
    assert float(t["grad"]) == pytest.approx(0.0, abs=1e-7) and float(t["l1"]) == pytest.approx(0.1)
    blurred = torch.nn.functional.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)
    assert float(reconstruction_loss(blurred, x, grad_weight=1.0)["grad"]) > 0.05


def test_loss_weights_are_validated():
    with pytest.raises(ConfigError, match="grad_weight"):
        VAETrainConfig(grad_weight=-1.0).validate()
    with pytest.raises(ConfigError, match="at least one reconstruction term"):
        VAETrainConfig(l1_weight=0.0, mse_weight=0.0).validate()
    VAETrainConfig(l1_weight=0.0, mse_weight=0.0, grad_weight=1.0).validate()


# ------------------------------------------------------------------------------ the trained VAE


def test_train_vae_optimises_the_configured_terms(raw, tmp_path, monkeypatch):
    """The weights of the config reach the loss of every step, and the logged loss is that loss
    (plus the KL term, 0 here)."""
    calls = []

    def spy(rec, x, *weights):
        terms = reconstruction_loss(rec, x, *weights)
        calls.append((weights, float(terms["loss"].detach())))
        return terms

    monkeypatch.setattr(vae_module, "reconstruction_loss", spy)
    cfg = vae_config(raw, seed=0, steps=2)
    cfg.grad_weight, cfg.color_weight, cfg.mse_weight, cfg.kl_weight, cfg.log_every = 0.5, 3.0, 0.0, 0.0, 1
    metrics = train_vae(cfg, tmp_path / "vae", progress=False)
    assert [c[0] for c in calls] == [(1.0, 0.0, 0.5, 3.0)] * 2
    assert [h["loss"] for h in metrics["history"]] == pytest.approx([c[1] for c in calls])


def test_noise_latents_adds_per_image_noise_scaled_by_the_latent_std():
    """Scale 0 is the identity; the added noise is linear in the scale (the same draws); per image
    its std over the latent's values, in units of the batch's latent std, is |n| for one standard
    normal n per image (mean sqrt(2 / pi) over many images); the gradient reaches z unchanged
    (the std is not differentiated)."""
    z = torch.randn(4000, 1, 16, 16, generator=torch.Generator().manual_seed(0)) * 3 + 1
    assert noise_latents(z, 0.0, torch.Generator().manual_seed(1)) is z
    one = noise_latents(z, 1.0, torch.Generator().manual_seed(1)) - z
    half = noise_latents(z, 0.5, torch.Generator().manual_seed(1)) - z
    assert torch.allclose(half, one / 2, atol=1e-5)
    level = one.flatten(1).std(1) / z.std()
    assert float(level.mean()) == pytest.approx(math.sqrt(2 / math.pi), rel=0.03)
    assert float(level.std()) == pytest.approx(math.sqrt(1 - 2 / math.pi), rel=0.05)
    n = torch.randn(4000, 1, 1, 1, generator=torch.Generator().manual_seed(1)).abs().flatten()
    assert torch.allclose(level, n, rtol=0.25, atol=0.02)  # 256 values a image: their std within ~5% (1 sigma)
    zg = z[:3].clone().requires_grad_(True)
    noise_latents(zg, 2.0, torch.Generator().manual_seed(1)).sum().backward()
    assert torch.equal(zg.grad, torch.ones_like(zg))


def test_decoder_noise_reaches_the_decoder(raw, tmp_path, monkeypatch):
    """The configured scale is what every training step's decoder input gets."""
    scales = []

    def spy(z, scale, generator):
        scales.append(scale)
        return noise_latents(z, scale, generator)

    monkeypatch.setattr(vae_module, "noise_latents", spy)
    cfg = vae_config(raw, seed=0, steps=2)
    cfg.decoder_noise = 0.3
    train_vae(cfg, tmp_path / "vae", progress=False)
    assert scales == [0.3, 0.3]


@pytest.fixture(scope="module")
def trained(raw, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("vae") / "vae"
    return out, train_vae(vae_config(raw, seed=0, steps=SHORT_STEPS), out, progress=False)


def test_scaling_factor_is_one_over_the_std_of_the_encoded_latents(raw, trained):
    """Encode every training image with the saved VAE, sample the posterior with a generator of
    our own, and take the std of all latent values: the saved scaling_factor is its inverse."""
    out, metrics = trained
    vae = load_vae(str(out)).eval()
    with torch.no_grad():
        dist = vae.encode(all_images(raw["train"])).latent_dist
    g = torch.Generator().manual_seed(12345)
    z = (dist.mean + dist.std * torch.randn(dist.mean.shape, generator=g)).double()
    assert z.numel() == 48 * 4 * 8 * 8
    std = float(z.std(unbiased=False))
    assert 1 / vae.config.scaling_factor == pytest.approx(std, rel=0.01)
    assert metrics["latent_std"] == pytest.approx(std, rel=0.01)
    assert float((z * vae.config.scaling_factor).std()) == pytest.approx(1.0, rel=0.01)  # what the scale is for
    assert abs(std - 1.0) > 0.1, "latents of std ~1 could not tell a std from a variance"


def test_latent_scale_scales_the_saved_scaling_factor(raw, trained, tmp_path):
    """vae.latent_scale 0.7: the same VAE (same seed and steps), its scaling_factor 0.7 times the
    unit-variance one, so the denoiser's latents have std 0.7."""
    out, metrics = trained
    cfg = vae_config(raw, seed=0, steps=SHORT_STEPS)
    cfg.latent_scale = 0.7
    scaled = train_vae(cfg, tmp_path / "vae", progress=False)
    assert scaled["latent_std"] == pytest.approx(metrics["latent_std"], rel=1e-6)
    assert scaled["scaling_factor"] == pytest.approx(0.7 * metrics["scaling_factor"], rel=1e-6)
    assert load_vae(str(tmp_path / "vae")).config.scaling_factor == pytest.approx(0.7 / scaled["latent_std"], rel=1e-6)


def test_heldout_psnr_is_a_direct_reconstruction_of_the_held_out_images(raw, trained):
    out, metrics = trained
    vae = load_vae(str(out)).eval()
    images = all_images(raw["held"])
    with torch.no_grad():
        rec = vae.decode(vae.encode(images).latent_dist.mode()).sample
    assert metrics["num_heldout"] == 16
    assert metrics["heldout_psnr"] == pytest.approx(float(ref_psnr(rec.numpy(), images.numpy()).mean()), abs=1e-3)


@pytest.mark.slow
def test_heldout_psnr_is_above_the_calibrated_bound(raw, tmp_path):
    metrics = train_vae(vae_config(raw, seed=0), tmp_path / "vae", progress=False)
    held = all_images(raw["held"])
    grey = float(ref_psnr(np.zeros_like(held.numpy()), held.numpy()).mean())
    assert grey < BOUND_DB  # a flat image does not pass
    assert metrics["heldout_psnr"] > BOUND_DB, f"held-out PSNR {metrics['heldout_psnr']:.2f} dB after {STEPS} steps"


@pytest.mark.slow
def test_a_broken_vae_fails_the_bound(raw, tmp_path, monkeypatch):
    monkeypatch.setattr(vae_module, "build_vae", broken_build)
    metrics = train_vae(vae_config(raw, seed=0), tmp_path / "vae", progress=False)
    assert metrics["heldout_psnr"] < BOUND_DB


def test_train_vae_with_muon_keeps_the_image_facing_convolutions_on_adamw(raw, tmp_path, monkeypatch):
    """optimizer=muon: one MuonAdamW whose Muon group holds the hidden kernels and matrices and not
    the encoder's first or the decoder's last convolution (3 image channels in, 3 out)."""
    built = []

    class Spy(vae_module.MuonAdamW):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(vae_module, "MuonAdamW", Spy)
    cfg = vae_config(raw, seed=0, steps=SHORT_STEPS)
    cfg.optimizer = "muon"
    metrics = train_vae(cfg, tmp_path / "vae", progress=False)
    assert math.isfinite(metrics["heldout_psnr"])
    (opt,) = built
    muon, adamw = opt.param_groups
    assert muon["muon"] and not adamw["muon"]
    muon_shapes = [tuple(p.shape) for p in muon["params"]]
    adamw_shapes = [tuple(p.shape) for p in adamw["params"]]
    assert (8, 3, 3, 3) in adamw_shapes and (3, 8, 3, 3) in adamw_shapes  # encoder.conv_in, decoder.conv_out
    assert all(s[1] != 3 and s[0] != 3 for s in muon_shapes) and len(muon_shapes) > 10
    assert all(len(s) >= 2 for s in muon_shapes)


def test_mid_block_attention_switch_reaches_the_saved_vae(tmp_path):
    """Off: no self-attention in either middle block, and the saved config says so, so that a
    reload (diffusers, as the exported pipeline does) builds the same network."""
    from latentforge.models.autoencoder import AutoencoderConfig, build_vae

    def attention_params(vae):
        return sum(p.numel() for n, p in vae.named_parameters() if ".attentions." in n)

    cfg = AutoencoderConfig(block_out_channels=(8, 16), norm_num_groups=4, sample_size=16)
    with_attention = build_vae(cfg)
    cfg.mid_block_attention = False
    without = build_vae(cfg)
    # encoder and decoder: q, k, v, out projections (16 x 16 + bias) and a group norm (weight, bias)
    assert attention_params(with_attention) == 2 * (4 * (16 * 16 + 16) + 2 * 16)
    assert attention_params(without) == 0
    without.save_pretrained(tmp_path, safe_serialization=True)
    assert attention_params(load_vae(str(tmp_path))) == 0


def test_checkpoints_of_another_vae_are_refused_in_one_line(raw, tmp_path, monkeypatch):
    """A run stopped after its first checkpoint, then its train_vae_config.yaml replaced by another VAE's
    and that VAE asked for: the resume named the first mismatched weight in one line, not torch's list."""
    save = ckpt.save_checkpoint

    def save_then_crash(*args, **kwargs):
        save(*args, **kwargs)
        raise KeyboardInterrupt  # the process dies right after the checkpoint

    out = tmp_path / "vae"
    cfg = vae_config(raw, seed=0, steps=4)
    cfg.checkpoint_every_steps = 2
    with monkeypatch.context() as m:
        m.setattr(ckpt, "save_checkpoint", save_then_crash)
        with pytest.raises(KeyboardInterrupt):
            train_vae(cfg, out, progress=False)
    step_dir = ckpt.find_latest(out)
    assert step_dir is not None and step_dir.name == ckpt.checkpoint_dir_name(2)
    cfg.model.block_out_channels = (8, 32)
    save_config(cfg, out / vae_module.CONFIG_FILE)
    with pytest.raises(UserError, match=rf"^{step_dir}: its weights do not fit the VAE of "
                                        rf"{out / vae_module.CONFIG_FILE} \((Missing|Unexpected|size)[^\n]*\); "
                                        "the checkpoints and that file must come from the same run$"):
        train_vae(cfg, out, progress=False)
