"""The flow-matching objective against a reference written from the papers, and its samplers.

The reference recomputes ``Trainer.loss_on`` for ``prediction_type: flow_matching`` in float64 with
a few lines of plain torch and no latentforge code:

- rectified flow (Liu et al. 2022, arXiv:2209.03003, eq. 1; Esser et al. 2024, SD3, §2-3):
  x_s = (1 - s) x0 + s eps, target v = eps - x0, plain MSE;
- the model's timestep is s * T (diffusers' FlowMatchEulerDiscreteScheduler convention);
- logit-normal sigma (SD3 §3.1): s = sigmoid(m + std * n), n ~ N(0, 1); or s ~ U[0, 1);
- the shift (SD3 §5.3.2): s' = a s / (1 + (a - 1) s), a = flow_shift * sqrt(h w) / base_size when
  a base size is set;
- latents: z = (posterior mean + posterior std * n - shift) * scale, as in test_objective.

The only inputs taken from the code under test are the raw random draws of ``sample_noise`` (the
standard normal or uniform number behind each sigma, the noise, the posterior noise): the
reference turns them into sigmas itself. Their distribution is checked separately.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from latentforge.config import from_dict
from latentforge.diffusion.flow_matching import flow_pred_x0, resolution_shift, sample_flow_sigmas, shift_sigma
from latentforge.diffusion.schedule import (
    NoiseScheduleConfig,
    check_scheduler_objective,
    flow_scheduler_config,
    make_sampler,
)
from latentforge.errors import ConfigError
from latentforge.models.unet import UNetConfig, build_unet
from latentforge.train.run import RunConfig
from latentforge.train.trainer import sample_noise
from latent_fixtures import TEXT_DIM, TEXT_LEN
from test_objective import SCALE, SHAPE, SHIFT, T, Probe, make_trainer, probe_function

SEED = 11  # make_trainer's train.seed

# --------------------------------------------------------------------------- the reference (papers)


def ref_sigma(raw: torch.Tensor, sampling: str, mean: float, std: float, shift: float) -> torch.Tensor:
    """sigma from the raw draw: sigmoid(mean + std n) or the uniform number, then the SD3 shift (float64)."""
    u = raw.double()
    s = torch.sigmoid(mean + std * u) if sampling == "logit_normal" else u
    return shift * s / (1 + (shift - 1) * s)


def ref_flow_loss(mean, std, post_noise, noise, sigma, hidden, model, scale=SCALE, shift=SHIFT):
    """Mean over the batch of the per-sample velocity MSE, in float64; also x_s and the model's timestep."""
    x0 = mean.double()
    if post_noise is not None:
        x0 = x0 + std.double() * post_noise.double()
    x0 = (x0 - shift) * scale
    s = sigma.double().view(-1, 1, 1, 1)
    eps = noise.double()
    x_s = (1 - s) * x0 + s * eps
    timestep = sigma.double() * T
    pred = model(x_s, timestep, hidden.double())
    per_sample = ((pred - (eps - x0)) ** 2).mean(dim=(1, 2, 3))
    return per_sample.mean(), x_s, timestep


@pytest.fixture(scope="module")
def batch() -> dict:
    g = torch.Generator().manual_seed(4321)
    n = 5
    return {
        "latent_mean": torch.randn((n, *SHAPE), generator=g).to(torch.float16),
        "latent_std": (0.05 + 0.3 * torch.rand((n, *SHAPE), generator=g)).to(torch.float16),
        "text_hidden": torch.randn((n, TEXT_LEN, TEXT_DIM), generator=g).to(torch.float16),
        "_position": [3, 8, 21, 400, 9_999],
    }


def raw_draws(positions, sampling: str, posterior: bool):
    """The raw number behind each sigma (first draw of each sample's generator), the noise and the posterior noise."""
    first = (lambda g: torch.randn(1, generator=g)) if sampling == "logit_normal" else (lambda g: torch.rand(1, generator=g))
    return sample_noise(SEED, positions, SHAPE, T, 0.0, posterior, first)


FLOW_CASES = {
    "sd3-default": dict(),
    "mean-std": dict(flow_logit_mean=0.5, flow_logit_std=0.7),
    "shift3": dict(flow_shift=3.0),
    "shift-by-size": dict(flow_shift=1.5, flow_shift_base_size=4),  # 8x8 latents: a = 1.5 * 8 / 4 = 3
    "uniform": dict(flow_time_sampling="uniform"),
}


@pytest.mark.parametrize("case", list(FLOW_CASES))
@pytest.mark.parametrize("posterior", [True, False], ids=["posterior", "mean"])
def test_flow_loss_on_equals_the_papers(batch, case, posterior):
    noise_cfg = NoiseScheduleConfig(prediction_type="flow_matching", **FLOW_CASES[case])
    probe = Probe()
    loss = make_trainer(probe, noise_cfg, sample_posterior=posterior).loss_on(batch)

    raw, noise, post = raw_draws(batch["_position"], noise_cfg.flow_time_sampling, posterior)
    a = noise_cfg.flow_shift * (8 / noise_cfg.flow_shift_base_size if noise_cfg.flow_shift_base_size else 1.0)
    sigma = ref_sigma(raw, noise_cfg.flow_time_sampling, noise_cfg.flow_logit_mean, noise_cfg.flow_logit_std, a)
    expected, x_s, timestep = ref_flow_loss(batch["latent_mean"], batch["latent_std"], post, noise, sigma,
                                            batch["text_hidden"], probe_function)
    assert 0 < float(sigma.min()) and float(sigma.max()) < 1
    assert probe.seen["t"].dtype == torch.float32  # a continuous time, not an index
    torch.testing.assert_close(probe.seen["t"].double(), timestep, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(probe.seen["x_t"].double(), x_s, rtol=1e-5, atol=1e-5)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), expected, rtol=2e-5, atol=1e-7)


def test_flow_loss_on_with_the_tiny_unet(batch):
    """The real U-Net in place of the probe, given float timesteps s * T."""
    torch.manual_seed(0)
    unet = build_unet(UNetConfig(preset="tiny", in_channels=4, out_channels=4, sample_size=8,
                                 cross_attention_dim=TEXT_DIM)).eval()
    noise_cfg = NoiseScheduleConfig(prediction_type="flow_matching", flow_shift=3.0)
    with torch.no_grad():
        loss = make_trainer(unet, noise_cfg).loss_on(batch)
        raw, noise, post = raw_draws(batch["_position"], "logit_normal", True)
        sigma = ref_sigma(raw, "logit_normal", 0.0, 1.0, 3.0)

        def model(x_s, t, hidden):
            return unet(x_s.float(), t.float(), encoder_hidden_states=hidden.float(), return_dict=False)[0].double()

        expected, _, _ = ref_flow_loss(batch["latent_mean"], batch["latent_std"], post, noise, sigma,
                                       batch["text_hidden"], model)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-4, atol=1e-6)


def test_eps_and_v_draws_are_unchanged_by_the_flow_option():
    """The default time draw is still the integer timestep (existing runs resume on the same noise)."""
    t, noise, _ = sample_noise(5, [1, 2, 3], SHAPE, T, 0.0, False)
    t2, noise2, _ = sample_noise(5, [1, 2, 3], SHAPE, T, 0.0, False, None)
    assert t.dtype == torch.int64 and torch.equal(t, t2) and torch.equal(noise, noise2)


# --------------------------------------------------------------------------- the sigma distribution

N_DRAWS = 20_000


@pytest.mark.parametrize(("mean", "std"), [(0.0, 1.0), (-0.4, 1.6)])
def test_logit_normal_sigmas_have_the_right_distribution(mean, std):
    """logit(sigma) ~ N(mean, std^2): sample mean within 5 standard errors (std / sqrt(N)), sample
    std within 5 of its standard errors (std / sqrt(2 N)), and a Kolmogorov-Smirnov test against
    scipy's normal (p > 1e-4: a correct sampler fails it once in 10,000 runs)."""
    sigma = sample_flow_sigmas(N_DRAWS, torch.Generator().manual_seed(0), "logit_normal", mean, std).double()
    z = torch.log(sigma / (1 - sigma)).numpy()
    se_mean, se_std = std / math.sqrt(N_DRAWS), std / math.sqrt(2 * N_DRAWS)
    assert abs(z.mean() - mean) < 5 * se_mean
    assert abs(z.std(ddof=1) - std) < 5 * se_std
    assert scipy.stats.kstest(z, "norm", args=(mean, std)).pvalue > 1e-4


def test_trainer_draws_per_position_are_logit_normal_and_shifted():
    """The draws of the training path (one generator per global position, the shift of the latent
    size): unshifting with the inverse formula s = s' / (a - (a - 1) s') gives logit-normal sigmas."""
    noise_cfg = NoiseScheduleConfig(prediction_type="flow_matching", flow_logit_mean=0.3, flow_shift=2.0,
                                    flow_shift_base_size=4)
    trainer = make_trainer(Probe(), noise_cfg)
    shape = (1, 8, 8)  # a = 2 * 8 / 4 = 4
    sigma, _, _ = sample_noise(SEED, list(range(4000)), shape, T, 0.0, False, trainer._flow_time(shape))
    s = sigma.double()
    unshifted = s / (4 - 3 * s)
    z = torch.log(unshifted / (1 - unshifted)).numpy()
    assert abs(z.mean() - 0.3) < 5 / math.sqrt(4000) and abs(z.std(ddof=1) - 1) < 5 / math.sqrt(8000)
    assert scipy.stats.kstest(z, "norm", args=(0.3, 1.0)).pvalue > 1e-4
    assert float(s.median()) > 0.75  # the shift moved the mass to high noise (median 0.84 for a = 4, m = 0.3)


def test_a_shift_below_one_moves_the_drawn_sigmas_toward_clean():
    """A shift under 1 (what ``resolution_shift`` gives a latent smaller than the base size) is applied
    to the drawn sigmas too, by SD3's s' = a s / (1 + (a - 1) s): for a = 0.5, s' = 0.5 u / (1 - 0.5 u)
    of the uniform draws u; through the trainer, an 8x8 latent at base size 16 gets a = 8 / 16 = 0.5."""
    u = torch.rand(4, generator=torch.Generator().manual_seed(0))
    shifted = sample_flow_sigmas(4, torch.Generator().manual_seed(0), "uniform", shift=0.5)
    torch.testing.assert_close(shifted, 0.5 * u / (1 - 0.5 * u))
    assert bool((shifted < u).all())  # toward clean, never left unshifted
    trainer = make_trainer(Probe(), NoiseScheduleConfig(prediction_type="flow_matching", flow_time_sampling="uniform",
                                                        flow_shift_base_size=16))
    torch.testing.assert_close(trainer._flow_time((1, 8, 8))(torch.Generator().manual_seed(0)), shifted[:1])


def test_the_shift_of_the_size_reads_the_height_and_the_width():
    """The shift of a non-square latent is shift x sqrt(h w) / base: 4x16 and 16x4 at base 4 both give
    sqrt(64) / 4 = 2 (SD3 section 5.3.2), so a uniform draw u becomes 2u / (1 + u) for both."""
    trainer = make_trainer(Probe(), NoiseScheduleConfig(prediction_type="flow_matching", flow_time_sampling="uniform",
                                                        flow_shift_base_size=4))
    u = torch.rand(1, generator=torch.Generator().manual_seed(0))
    for shape in ((1, 4, 16), (1, 16, 4)):
        torch.testing.assert_close(trainer._flow_time(shape)(torch.Generator().manual_seed(0)), 2 * u / (1 + u))


def test_x0_from_a_velocity_by_hand():
    """On the straight path x_s = (1 - s) x0 + s eps with velocity v = eps - x0, x0 = x_s - s v: x0 = 1,
    eps = 3, s = 0.25 give x_s = 1.5 and v = 2, so 1.5 - 0.25 * 2 = 1 (what diffusers' flow-prediction
    solvers compute as sample - sigma * model_output)."""
    one = torch.ones(1, 1, 1, 1)
    assert flow_pred_x0(2 * one, 1.5 * one, torch.tensor([0.25])).item() == 1.0


def test_sampling_is_reproducible_from_the_generator_only():
    a = sample_flow_sigmas(8, torch.Generator().manual_seed(3))
    torch.manual_seed(123)  # the global RNG plays no part
    b = sample_flow_sigmas(8, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    assert not torch.equal(a, sample_flow_sigmas(8, torch.Generator().manual_seed(4)))


# --------------------------------------------------------------------------- the shift


def test_shift_formula_against_hand_values():
    s = torch.tensor([0.0, 0.25, 0.5, 1.0], dtype=torch.float64)
    torch.testing.assert_close(shift_sigma(s, 3.0), torch.tensor([0.0, 0.5, 0.75, 1.0], dtype=torch.float64))
    torch.testing.assert_close(shift_sigma(s, 1.0), s)
    torch.testing.assert_close(shift_sigma(torch.tensor([0.5], dtype=torch.float64), 0.5),
                               torch.tensor([0.25 / 0.75], dtype=torch.float64))
    assert resolution_shift(3.0, 0, 128, 128) == 3.0  # no base size: the shift as given
    assert resolution_shift(1.0, 32, 64, 64) == 2.0  # twice the side: sqrt(4) = 2
    assert resolution_shift(3.0, 64, 128, 128) == 6.0
    assert resolution_shift(2.0, 32, 32, 8) == pytest.approx(1.0)  # sqrt(256) / 32 = 0.5


def test_shift_matches_diffusers_flow_match_scheduler():
    """diffusers' own shifted training sigmas (FlowMatchEulerDiscreteScheduler(shift=a).sigmas)."""
    for a in (1.0, 3.0, 0.7):
        sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=T, shift=a)
        base = torch.arange(T, 0, -1, dtype=torch.float32) / T
        torch.testing.assert_close(shift_sigma(base, a), sched.sigmas)


# --------------------------------------------------------------------------- samplers


def test_flow_ddim_sampler_takes_the_euler_step_on_its_sigmas():
    """'ddim' for a flow model (first-order DPM-Solver++ on flow sigmas) is the Euler step
    x + (s_next - s) v of the flow ODE, with the model's timestep ~ s * T, ending at s = 0."""
    cfg = NoiseScheduleConfig(prediction_type="flow_matching", flow_shift=3.0)
    sched = make_sampler("ddim", cfg, 8)
    sched.set_timesteps(6)
    sigmas = sched.sigmas.double()
    assert float(sigmas[-1]) == 0.0 and float(sigmas[0]) > 0.99
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, 8, generator=g)
    for i, t in enumerate(sched.timesteps):
        assert abs(float(t) - float(sigmas[i]) * T) < 1.0  # int64 timestep: sigma * T truncated
        v = torch.randn(2, 4, 8, 8, generator=g)
        expected = x.double() + (sigmas[i + 1] - sigmas[i]) * v.double()
        x = sched.step(v, t, x, return_dict=False)[0]
        torch.testing.assert_close(x.double(), expected, rtol=1e-5, atol=1e-5)


def test_flow_euler_sampler_is_diffusers_flow_match_euler_with_the_shift_of_the_size():
    cfg = NoiseScheduleConfig(prediction_type="flow_matching", flow_shift=1.5, flow_shift_base_size=4)
    sched = make_sampler("euler", cfg, 8)
    assert type(sched) is FlowMatchEulerDiscreteScheduler and sched.config.shift == 3.0
    assert flow_scheduler_config(cfg, "dpm++", 16)["flow_shift"] == 6.0
    with pytest.raises(ConfigError, match="sampler: 'ddpm' has no flow-matching form"):
        make_sampler("ddpm", cfg, 8)
    with pytest.raises(ConfigError, match="flow_shift_base_size: the shift depends on the latent size"):
        make_sampler("euler", cfg)


def test_a_sampler_of_the_other_objective_is_refused():
    flow = NoiseScheduleConfig(prediction_type="flow_matching")
    eps = NoiseScheduleConfig()
    with pytest.raises(ConfigError, match="train.noise.prediction_type: the model is flow_matching but DDIMScheduler"):
        check_scheduler_objective(make_sampler("ddim", eps), flow)
    with pytest.raises(ConfigError, match="the model is epsilon but FlowMatchEulerDiscreteScheduler"):
        check_scheduler_objective(make_sampler("euler", flow, 8), eps)
    with pytest.raises(ConfigError, match="the model is epsilon but DPMSolverMultistepScheduler"):
        check_scheduler_objective(make_sampler("dpm++", flow, 8), eps)
    with pytest.raises(ConfigError, match="predicts v_prediction, DDIMScheduler expects epsilon"):
        check_scheduler_objective(make_sampler("ddim", eps), NoiseScheduleConfig(prediction_type="v_prediction"))
    for name in ("euler", "ddim", "dpm++"):
        check_scheduler_objective(make_sampler(name, flow, 8), flow)


# --------------------------------------------------------------------------- refused combinations


def _train(**train) -> RunConfig:
    return from_dict(RunConfig, {"train": {"phases": [{"datasets": [{"path": "x"}], "steps": 1}], **train}})


@pytest.mark.parametrize(("train", "message"), [
    ({"min_snr_gamma": 5.0}, "train.min_snr_gamma: not used with flow_matching"),
    ({"offset_noise": 0.1}, "train.offset_noise: flow_matching already ends at pure noise"),
    ({"noise": {"rescale_zero_terminal_snr": True, "timestep_spacing": "trailing"}},
     "train.noise.rescale_zero_terminal_snr: flow_matching ends at pure noise"),
    ({"noise": {"beta_schedule": "linear"}}, "train.noise.beta_schedule: not used by flow_matching"),
    ({"noise": {"timestep_spacing": "trailing"}}, "train.noise.timestep_spacing: not used by flow_matching"),
    ({"noise": {"flow_logit_std": 0.0}}, "train.noise.flow_logit_std: must be positive"),
    ({"noise": {"flow_shift": -1.0}}, "train.noise.flow_shift: must be positive"),
    ({"sampling": {"prompts": ["a"], "sampler": "ddpm"}}, "train.sampling.sampler: ddpm has no flow-matching form"),
])
def test_flow_matching_refuses_settings_that_make_no_sense(train, message):
    noise = {"prediction_type": "flow_matching", **train.pop("noise", {})}
    with pytest.raises(ConfigError, match=message):
        _train(noise=noise, **train)


@pytest.mark.parametrize("field", ["flow_shift", "flow_logit_mean", "flow_shift_base_size"])
def test_flow_settings_are_refused_for_eps_and_v(field):
    value = {"flow_shift": 3.0, "flow_logit_mean": 0.5, "flow_shift_base_size": 32}[field]
    with pytest.raises(ConfigError, match=f"train.noise.{field}: only used with prediction_type flow_matching, not "
                                          "v_prediction"):
        _train(noise={"prediction_type": "v_prediction", field: value})


def test_flow_matching_accepts_its_own_settings():
    cfg = _train(noise={"prediction_type": "flow_matching", "flow_shift": 3.0, "flow_shift_base_size": 32,
                        "flow_logit_mean": 0.2, "flow_logit_std": 1.2, "flow_time_sampling": "uniform"})
    assert cfg.train.noise.flow_shift == 3.0
