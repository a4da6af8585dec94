"""Noise schedules, objectives and the sampling loop (against diffusers' own scheduler and pipeline)."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKL, StableDiffusionPipeline
from diffusers.training_utils import compute_snr

from latentforge.config import from_dict
from latentforge.diffusion.objectives import (
    add_noise,
    diffusion_loss,
    min_snr_weight,
    offset_noise,
    pred_x0,
    sample_timesteps,
    training_target,
)
from latentforge.diffusion.sampling import cfg_combine, sample_latents
from latentforge.diffusion.schedule import (
    SAMPLERS,
    NoiseScheduleConfig,
    alphas_cumprod,
    make_sampler,
    make_train_scheduler,
    scheduler_config,
    snr,
)
from latentforge.errors import ConfigError
from latentforge.models.unet import UNetConfig, build_unet

ZERO_SNR = NoiseScheduleConfig(prediction_type="v_prediction", rescale_zero_terminal_snr=True, timestep_spacing="trailing")


# ---- schedule ----------------------------------------------------------------------------------


def test_scaled_linear_alphas_cumprod_is_sd_schedule():
    ac = alphas_cumprod(NoiseScheduleConfig())
    # SD's "scaled_linear": linear in sqrt(beta), computed in float32 like diffusers.
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float32) ** 2
    assert ac.dtype == torch.float32 and ac.shape == (1000,)
    torch.testing.assert_close(ac, torch.cumprod(1.0 - betas, dim=0), rtol=0, atol=0)
    assert ac[0].item() == pytest.approx(0.99915, abs=1e-7)
    assert ac[-1].item() == pytest.approx(0.0046600, abs=1e-6)  # SD's well-known non-zero terminal alpha-bar


def test_every_sampler_shares_the_one_config():
    cfg = NoiseScheduleConfig(prediction_type="v_prediction", timestep_spacing="trailing")
    train = make_train_scheduler(cfg)
    for name in SAMPLERS:
        s = make_sampler(name, cfg)
        assert s.config.prediction_type == "v_prediction", name
        assert s.config.timestep_spacing == "trailing", name
        assert s.config.num_train_timesteps == 1000, name
        torch.testing.assert_close(s.alphas_cumprod, train.alphas_cumprod, rtol=0, atol=0, msg=name)
    assert make_sampler("dpm++", cfg).config.algorithm_type == "dpmsolver++"
    assert train.config.clip_sample is False
    assert make_sampler("ddim", cfg).config.set_alpha_to_one is False
    with pytest.raises(ConfigError, match="^sampler: unknown 'plms'"):
        make_sampler("plms", cfg)


def test_zero_terminal_snr_last_snr_is_zero():
    ac = alphas_cumprod(ZERO_SNR)
    t = torch.arange(1000)
    s = snr(ac, t)
    assert s[-1].item() == 0.0
    assert (s[:-1] > 0).all() and (s[1:] < s[:-1]).all()
    # Lin et al.'s rescale keeps the first step's alpha-bar.
    assert ac[0].item() == pytest.approx(alphas_cumprod(NoiseScheduleConfig())[0].item(), abs=1e-6)
    # The samplers start from t = T-1; Euler and DPM++ store 2**-24 there instead of 0 (finite sigma).
    for name in ("ddim", "dpm++", "euler", "ddpm"):
        sampler = make_sampler(name, ZERO_SNR)
        sampler.set_timesteps(10)
        assert int(sampler.timesteps[0]) == 999, name


def test_snr_matches_diffusers_compute_snr():
    cfg = NoiseScheduleConfig()
    t = torch.tensor([0, 1, 250, 500, 999])
    expected = compute_snr(make_train_scheduler(cfg), t)
    torch.testing.assert_close(snr(alphas_cumprod(cfg), t), expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"rescale_zero_terminal_snr": True, "timestep_spacing": "trailing"},
            "^schedule.prediction_type: rescale_zero_terminal_snr needs v_prediction",
        ),
        (
            {"rescale_zero_terminal_snr": True, "prediction_type": "v_prediction"},
            "^schedule.timestep_spacing: rescale_zero_terminal_snr needs trailing",
        ),
        ({"beta_start": 0.02}, "^schedule.beta_start: need 0 < beta_start < beta_end < 1"),
        ({"prediction_type": "sample"}, "^schedule.prediction_type: must be one of"),
        ({"num_train_timesteps": 1}, "^schedule.num_train_timesteps: must be at least 2"),
    ],
)
def test_schedule_validation(data, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(NoiseScheduleConfig, data, "schedule")


def test_scheduler_config_is_plain_data():
    d = scheduler_config(ZERO_SNR)
    assert d["rescale_betas_zero_snr"] is True and d["prediction_type"] == "v_prediction"
    assert all(isinstance(v, (int, float, str, bool)) for v in d.values())


# ---- objectives --------------------------------------------------------------------------------


def test_add_noise_and_v_target_match_diffusers():
    cfg = NoiseScheduleConfig(prediction_type="v_prediction")
    sched = make_train_scheduler(cfg)
    ac = alphas_cumprod(cfg)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(5, 4, 8, 8, generator=g)
    noise = torch.randn(5, 4, 8, 8, generator=g)
    t = torch.tensor([0, 10, 500, 998, 999])
    assert torch.equal(add_noise(x0, noise, t, ac), sched.add_noise(x0, noise, t))
    assert torch.equal(training_target(x0, noise, t, ac, "v_prediction"), sched.get_velocity(x0, noise, t))
    assert training_target(x0, noise, t, ac, "epsilon") is noise


@pytest.mark.parametrize(
    ("cfg", "prediction_type"),
    [(NoiseScheduleConfig(), "epsilon"), (NoiseScheduleConfig(), "v_prediction"), (ZERO_SNR, "v_prediction")],
)
def test_x0_is_recovered_from_a_perfect_prediction(cfg, prediction_type):
    ac = alphas_cumprod(cfg)
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(1000, 4, 2, 2, generator=g, dtype=torch.float64)
    noise = torch.randn(1000, 4, 2, 2, generator=g, dtype=torch.float64)
    t = torch.arange(1000)
    x_t = add_noise(x0, noise, t, ac)
    target = training_target(x0, noise, t, ac, prediction_type)
    torch.testing.assert_close(pred_x0(target, x_t, t, ac, prediction_type), x0, rtol=0, atol=1e-10)
    if prediction_type == "v_prediction":
        # Also the noise: eps = sqrt(1-a) x_t + sqrt(a) v.
        a = ac.double()[t].reshape(-1, 1, 1, 1)
        torch.testing.assert_close((1 - a).sqrt() * x_t + a.sqrt() * target, noise, rtol=0, atol=1e-10)


def test_min_snr_weights_at_known_snrs():
    s = torch.tensor([0.0, 0.5, 1.0, 5.0, 10.0, 100.0])
    eps = min_snr_weight(s, 5.0, "epsilon")
    v = min_snr_weight(s, 5.0, "v_prediction")
    torch.testing.assert_close(eps, torch.tensor([1.0, 1.0, 1.0, 1.0, 0.5, 0.05]))
    torch.testing.assert_close(v, torch.tensor([0.0, 0.5 / 1.5, 0.5, 5 / 6, 5 / 11, 5 / 101]))
    # Same as diffusers' train_text_to_image.py for SNR > 0.
    pos = s[1:]
    reference = torch.stack([pos, 5.0 * torch.ones_like(pos)], dim=1).min(dim=1)[0]
    torch.testing.assert_close(eps[1:], reference / pos)
    torch.testing.assert_close(v[1:], reference / (pos + 1))
    # A floor lifts the noisy side's weights under it (v at SNR 0 and 0.5: 0 and 1/3 become 0.4),
    # not the quiet side's (SNR 100: 5/101 stays); epsilon's noisy side is 1 already.
    torch.testing.assert_close(min_snr_weight(s, 5.0, "v_prediction", floor=0.4),
                               torch.tensor([0.4, 0.4, 0.5, 5 / 6, 5 / 11, 5 / 101]))
    torch.testing.assert_close(min_snr_weight(s, 5.0, "epsilon", floor=0.4), eps)
    with pytest.raises(ConfigError, match="^snr_gamma: must be positive"):
        min_snr_weight(s, 0.0, "epsilon")
    with pytest.raises(ConfigError, match="^prediction_type: unknown 'sample'"):
        min_snr_weight(s, 5.0, "sample")


def test_offset_noise_statistics_and_determinism():
    noise = torch.zeros(64, 64, 4, 4)
    global_state = torch.get_rng_state()
    out = offset_noise(noise, 0.1, torch.Generator().manual_seed(7))
    assert torch.equal(torch.get_rng_state(), global_state), "offset_noise used the global RNG"
    assert torch.equal(out, offset_noise(noise, 0.1, torch.Generator().manual_seed(7)))
    assert not torch.equal(out, offset_noise(noise, 0.1, torch.Generator().manual_seed(8)))
    # Constant over H, W; N(0, 0.1^2) across (sample, channel): 4096 draws.
    assert torch.equal(out, out[:, :, :1, :1].expand_as(out))
    per_channel = out[:, :, 0, 0]
    assert per_channel.std().item() == pytest.approx(0.1, rel=0.05)
    assert abs(per_channel.mean().item()) < 0.01
    # Added to the given noise, not replacing it.
    base = torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(0))
    shifted = offset_noise(base, 0.5, torch.Generator().manual_seed(1))
    assert torch.allclose((shifted - base).std(dim=(2, 3)), torch.zeros(2, 3), atol=1e-6)


def test_sample_timesteps_uses_only_its_generator():
    global_state = torch.get_rng_state()
    t = sample_timesteps(20000, 1000, torch.Generator().manual_seed(3))
    assert torch.equal(torch.get_rng_state(), global_state)
    assert t.dtype == torch.int64 and t.shape == (20000,)
    assert t.min().item() == 0 and t.max().item() == 999
    assert t.float().mean().item() == pytest.approx(499.5, rel=0.02)
    assert torch.equal(t, sample_timesteps(20000, 1000, torch.Generator().manual_seed(3)))


def test_diffusion_loss_weighting():
    g = torch.Generator().manual_seed(0)
    pred = torch.randn(3, 4, 2, 2, generator=g, dtype=torch.bfloat16)
    target = torch.randn(3, 4, 2, 2, generator=g, dtype=torch.bfloat16)
    per_sample = ((pred.float() - target.float()) ** 2).mean(dim=(1, 2, 3))
    loss = diffusion_loss(pred, target)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, torch.nn.functional.mse_loss(pred.float(), target.float()))
    w = torch.tensor([1.0, 0.0, 2.0])
    torch.testing.assert_close(diffusion_loss(pred, target, w), (per_sample * w).mean())


# ---- sampling ----------------------------------------------------------------------------------


def test_cfg_combine():
    u, c = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 0.0])
    assert torch.equal(cfg_combine(u, c, 1.0), c)
    assert torch.equal(cfg_combine(u, c, 0.0), u)
    assert torch.equal(cfg_combine(u, c, 7.5), u + 7.5 * (c - u))


def _tiny_unet(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    unet = build_unet(UNetConfig(preset="tiny", cross_attention_dim=32, sample_size=8))
    # Fresh U-Nets zero their output conv; randomise it so the test sees non-trivial predictions.
    with torch.no_grad():
        for p in unet.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return unet.eval()


def _pipeline(unet: torch.nn.Module, scheduler) -> StableDiffusionPipeline:
    # Only the latent loop is compared: text states are given as prompt_embeds and output_type is
    # "latent", so no text encoder or tokenizer is needed; the VAE sets vae_scale_factor = 2.
    vae = AutoencoderKL(
        block_out_channels=[8, 8],
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
    )
    pipe = StableDiffusionPipeline(
        vae=vae, text_encoder=None, tokenizer=None, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("sampler", list(SAMPLERS))
@pytest.mark.parametrize(("schedule", "guidance_scale"), [(NoiseScheduleConfig(), 4.0), (ZERO_SNR, 1.0), (ZERO_SNR, 3.0)])
def test_sample_latents_equals_stable_diffusion_pipeline(sampler, schedule, guidance_scale):
    unet = _tiny_unet()
    g = torch.Generator().manual_seed(11)
    cond = torch.randn(2, 5, 32, generator=g)
    uncond = torch.randn(2, 5, 32, generator=g)

    ours = sample_latents(
        unet, make_sampler(sampler, schedule), cond, uncond, shape=(2, 4, 8, 8), num_steps=4,
        guidance_scale=guidance_scale, generator=torch.Generator().manual_seed(42),
    )
    theirs = _pipeline(unet, make_sampler(sampler, schedule))(
        prompt_embeds=cond, negative_prompt_embeds=uncond, height=16, width=16, num_inference_steps=4,
        guidance_scale=guidance_scale, generator=torch.Generator().manual_seed(42), output_type="latent",
    ).images
    assert ours.shape == (2, 4, 8, 8) and torch.isfinite(ours).all()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)

    other_seed = sample_latents(
        unet, make_sampler(sampler, schedule), cond, uncond, shape=(2, 4, 8, 8), num_steps=4,
        guidance_scale=guidance_scale, generator=torch.Generator().manual_seed(43),
    )
    assert (other_seed - ours).abs().max() > 1e-2


def test_sample_latents_attention_mask_and_input_checks():
    unet = _tiny_unet()
    g = torch.Generator().manual_seed(0)
    cond, uncond = torch.randn(2, 5, 32, generator=g), torch.randn(2, 5, 32, generator=g)
    common = dict(shape=(2, 4, 8, 8), num_steps=3, guidance_scale=2.0)

    def run(mask=None):
        return sample_latents(
            unet, make_sampler("ddim", NoiseScheduleConfig()), cond, uncond, **common,
            generator=torch.Generator().manual_seed(5), encoder_attention_mask=mask,
        )

    plain = run()
    ones = torch.ones(2, 5)
    torch.testing.assert_close(run((ones, ones)), plain, rtol=0, atol=1e-6)
    padded = ones.clone()
    padded[:, 3:] = 0
    assert (run((ones, padded)) - plain).abs().max() > 1e-4

    with pytest.raises(ValueError, match="^uncond_hidden: needed"):
        sample_latents(unet, make_sampler("ddim", NoiseScheduleConfig()), cond, None, **common, generator=g)
    with pytest.raises(ValueError, match=r"^cond_hidden: expected shape \(batch=3"):
        sample_latents(unet, make_sampler("ddim", NoiseScheduleConfig()), cond, uncond, shape=(3, 4, 8, 8),
                       num_steps=3, guidance_scale=2.0, generator=g)
