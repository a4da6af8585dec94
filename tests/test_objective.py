"""The assembled training loss against a reference written from the papers.

``Trainer.loss_on`` combines the VAE scale and shift, the posterior sample, the noise, the
epsilon or v target, min-SNR-gamma weighting and (through the loader) caption dropout. The
reference below recomputes that loss in float64 with a few lines of plain torch and no
latentforge code:

- betas: linear (Ho et al. 2020, sec. 4), scaled_linear (Rombach et al. 2022, linear in
  sqrt(beta)), cosine (Nichol & Dhariwal 2021, eq. 17, betas capped at 0.999);
- zero terminal SNR (Lin et al. 2024, "Common Diffusion Noise Schedules and Sample Steps are
  Flawed", Algorithm 1): shift sqrt(alpha-bar) so its last value is 0, rescale so its first is kept;
- x_t = sqrt(a) x0 + sqrt(1 - a) eps (Ho et al. 2020, eq. 4);
- v = sqrt(a) eps - sqrt(1 - a) x0 (Salimans & Ho 2022, sec. 4);
- min-SNR-gamma (Hang et al. 2023, sec. 3.4): the loss weight is min(SNR, gamma) in x0 units,
  i.e. min(SNR, gamma) / SNR for an epsilon loss and min(SNR, gamma) / (SNR + 1) for a v loss;
- latents: z = (posterior mean + posterior std * n - shift) * scale (the VAE's shift_factor and
  scaling_factor, as diffusers' pipelines undo them in ``decode``).

The random draws (timesteps, diffusion noise, posterior noise) are the only inputs taken from the
code under test (``sample_noise``); their roles, and their statistics, are checked separately.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from latentforge.data.loader import LoaderConfig, StreamConfig, build_loader
from latentforge.diffusion.schedule import NoiseScheduleConfig
from latentforge.models.unet import UNetConfig, build_unet
from latentforge.train.trainer import PhaseConfig, TrainConfig, Trainer, sample_noise
from latent_fixtures import TEXT_DIM, TEXT_LEN, latent_data  # noqa: F401  (session fixture)

SCALE, SHIFT = 0.37, 0.21  # deliberately not SD's 0.18215 / 0
SHAPE = (4, 8, 8)  # latent channels, height, width
T = 1000

# --------------------------------------------------------------------------- the reference (papers)


def ref_alphas_cumprod(schedule: str, beta_start: float, beta_end: float, zero_terminal_snr: bool) -> torch.Tensor:
    """alpha-bar_t, t = 0 .. T-1, in float64 (see the module docstring for the sources)."""
    if schedule == "linear":
        betas = torch.linspace(beta_start, beta_end, T, dtype=torch.float64)
    elif schedule == "scaled_linear":
        betas = torch.linspace(beta_start ** 0.5, beta_end ** 0.5, T, dtype=torch.float64) ** 2
    else:  # cosine: alpha-bar(t) = f(t) / f(0), f(t) = cos((t/T + s) / (1 + s) * pi / 2)^2, s = 0.008
        f = [math.cos((i / T + 0.008) / 1.008 * math.pi / 2) ** 2 for i in range(T + 1)]
        betas = torch.tensor([min(1 - f[i + 1] / f[i], 0.999) for i in range(T)], dtype=torch.float64)
    abar = torch.cumprod(1 - betas, dim=0)
    if zero_terminal_snr:
        s = abar.sqrt()
        s = (s - s[-1]) * s[0] / (s[0] - s[-1])
        abar = s ** 2
    return abar


def ref_loss(mean, std, post_noise, noise, t, hidden, model, abar, prediction_type, gamma, scale=SCALE, shift=SHIFT,
             floor=0.0, sample_weights=None):
    """The mean over the batch of the (min-SNR weighted, noisy side floored, or ``sample_weights``
    weighted) per-sample MSE, in float64."""
    x0 = mean.double()
    if post_noise is not None:
        x0 = x0 + std.double() * post_noise.double()
    x0 = (x0 - shift) * scale
    a = abar[t].view(-1, 1, 1, 1)
    eps = noise.double()
    x_t = a.sqrt() * x0 + (1 - a).sqrt() * eps
    target = eps if prediction_type == "epsilon" else a.sqrt() * eps - (1 - a).sqrt() * x0
    pred = model(x_t, t, hidden.double())
    per_sample = ((pred - target) ** 2).mean(dim=(1, 2, 3))
    if gamma:
        per_sample = per_sample * ref_min_snr_weights(abar, gamma, floor, prediction_type)[t]
    if sample_weights is not None:
        per_sample = per_sample * sample_weights
    return per_sample.mean(), x_t


def ref_min_snr_weights(abar: torch.Tensor, gamma: float, floor: float = 0.0,
                        prediction_type: str = "v_prediction") -> torch.Tensor:
    """The min-SNR weight of every timestep (Hang et al. 2023), the noisy side floored, float64."""
    s = abar / (1 - abar)
    if prediction_type == "epsilon":
        w = torch.where(s > 0, torch.minimum(s, torch.tensor(gamma, dtype=s.dtype)) / s, torch.ones_like(s))
    else:
        w = torch.minimum(s, torch.tensor(gamma, dtype=s.dtype)) / (s + 1)
    return torch.where(s < gamma, torch.clamp(w, min=floor), w) if floor else w


def probe_function(x_t, t, hidden):
    """A fixed, non-trivial 'denoiser' (the same formula in the reference and in the probe module):
    it depends on x_t, t and the text states, so all three must reach the model right."""
    return 0.7 * x_t - 0.3 * (t.to(x_t.dtype) / T).view(-1, 1, 1, 1) + hidden.mean(dim=(1, 2)).view(-1, 1, 1, 1)


class Probe(torch.nn.Module):
    """Calls ``probe_function`` in float32 and records what the trainer handed it."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(1))  # the optimizer needs a parameter
        self.seen: dict[str, torch.Tensor] = {}

    def forward(self, x_t, t, encoder_hidden_states, return_dict=False):
        self.seen = {"x_t": x_t.detach().clone(), "t": t.clone(), "hidden": encoder_hidden_states.clone()}
        return (probe_function(x_t, t, encoder_hidden_states),)


def make_trainer(model: torch.nn.Module, noise: NoiseScheduleConfig, **train) -> Trainer:
    cfg = TrainConfig(noise=noise, ema=None, loggers=[], device="cpu", precision="fp32", seed=11,
                      phases=[PhaseConfig(datasets=[StreamConfig(path="unused")], steps=1)], **train)
    meta = {"vae": {"scaling_factor": SCALE, "shift_factor": SHIFT}}
    return Trainer(cfg, model, make_loader=lambda *_: None, run_dir="unused", latent_meta=meta,
                   device=torch.device("cpu"), progress=False)


def position_with_timestep(seed: int, timestep: int) -> int:
    """The first global position whose drawn timestep is ``timestep`` (to put the ends of the
    schedule, t = 0 and t = T-1, into the fixed batch)."""
    for p in range(0, 100_000, 64):
        t, _, _ = sample_noise(seed, list(range(p, p + 64)), (1, 1, 1), T, 0.0, False)
        hits = (t == timestep).nonzero()
        if len(hits):
            return p + int(hits[0])
    raise AssertionError(f"no position with t = {timestep}")


@pytest.fixture(scope="module")
def fixed_batch() -> dict:
    """Four samples: the ends of the schedule (t = 0 and t = T-1) and two arbitrary positions."""
    g = torch.Generator().manual_seed(1234)
    positions = [position_with_timestep(11, 0), position_with_timestep(11, T - 1), 5, 77]
    n = len(positions)
    return {
        "latent_mean": torch.randn((n, *SHAPE), generator=g).to(torch.float16),  # stored as fp16 by encode
        "latent_std": (0.05 + 0.3 * torch.rand((n, *SHAPE), generator=g)).to(torch.float16),
        "text_hidden": torch.randn((n, TEXT_LEN, TEXT_DIM), generator=g).to(torch.float16),
        "_position": positions,
    }


SCHEDULES = {
    "scaled_linear": NoiseScheduleConfig(),
    "linear": NoiseScheduleConfig(beta_schedule="linear", beta_start=0.0001, beta_end=0.02),
    "cosine": NoiseScheduleConfig(beta_schedule="squaredcos_cap_v2"),
    "zero_snr": NoiseScheduleConfig(prediction_type="v_prediction", rescale_zero_terminal_snr=True,
                                    timestep_spacing="trailing"),
}


def cases():
    for name, schedule in SCHEDULES.items():
        for prediction_type in ("epsilon", "v_prediction"):
            if schedule.rescale_zero_terminal_snr and prediction_type == "epsilon":
                continue  # refused by the config (epsilon is degenerate at SNR 0)
            for gamma in (0.0, 5.0):
                yield pytest.param(name, prediction_type, gamma, id=f"{name}-{prediction_type}-gamma{gamma:g}")


# --------------------------------------------------------------------------- the loss


@pytest.mark.parametrize(("schedule", "prediction_type", "gamma"), list(cases()))
@pytest.mark.parametrize("posterior", [True, False], ids=["posterior", "mean"])
@pytest.mark.parametrize("offset", [0.0, 0.1], ids=["no-offset", "offset"])
def test_loss_on_equals_the_papers(fixed_batch, schedule, prediction_type, gamma, posterior, offset):
    noise_cfg = NoiseScheduleConfig(**{**vars(SCHEDULES[schedule]), "prediction_type": prediction_type})
    probe = Probe()
    trainer = make_trainer(probe, noise_cfg, min_snr_gamma=gamma, sample_posterior=posterior, offset_noise=offset)
    loss = trainer.loss_on(fixed_batch)

    t, noise, post = sample_noise(11, fixed_batch["_position"], SHAPE, T, offset, posterior)
    assert (post is not None) == posterior
    abar = ref_alphas_cumprod(noise_cfg.beta_schedule, noise_cfg.beta_start, noise_cfg.beta_end,
                              noise_cfg.rescale_zero_terminal_snr)
    expected, x_t = ref_loss(fixed_batch["latent_mean"], fixed_batch["latent_std"], post, noise, t,
                             fixed_batch["text_hidden"], probe_function, abar, prediction_type, gamma)
    assert t[0] == 0 and t[1] == T - 1
    assert torch.equal(probe.seen["t"], t)
    torch.testing.assert_close(probe.seen["x_t"].double(), x_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(probe.seen["hidden"], fixed_batch["text_hidden"].float())
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), expected, rtol=2e-5, atol=1e-7)


def test_a_min_snr_floor_lifts_the_noisy_samples_weight_in_the_loss(fixed_batch):
    """min_snr_floor 0.3 with v-prediction: the loss is the reference's with the noisy side's
    weights raised to 0.3 (the batch holds t = T-1, weighted about 0.005 without the floor)."""
    noise_cfg = NoiseScheduleConfig(prediction_type="v_prediction")
    probe = Probe()
    plain = make_trainer(probe, noise_cfg, min_snr_gamma=5.0).loss_on(fixed_batch)
    loss = make_trainer(probe, noise_cfg, min_snr_gamma=5.0, min_snr_floor=0.3).loss_on(fixed_batch)
    t, noise, post = sample_noise(11, fixed_batch["_position"], SHAPE, T, 0.0, True)
    abar = ref_alphas_cumprod(noise_cfg.beta_schedule, noise_cfg.beta_start, noise_cfg.beta_end, False)
    expected, _ = ref_loss(fixed_batch["latent_mean"], fixed_batch["latent_std"], post, noise, t,
                           fixed_batch["text_hidden"], probe_function, abar, "v_prediction", 5.0, floor=0.3)
    torch.testing.assert_close(loss.double(), expected, rtol=2e-5, atol=1e-7)
    assert not torch.isclose(loss, plain, rtol=1e-3)


def test_a_phase_s_own_min_snr_floor_applies_in_that_phase_only(fixed_batch):
    """Two phases, the second with min_snr_floor 0.3 (the run's is 0): phase 0's loss is plain
    min-SNR, phase 1's the floored one; a phase without its own floor takes train.min_snr_floor."""
    noise_cfg = NoiseScheduleConfig(prediction_type="v_prediction")
    probe = Probe()
    plain = make_trainer(probe, noise_cfg, min_snr_gamma=5.0).loss_on(fixed_batch)
    floored = make_trainer(probe, noise_cfg, min_snr_gamma=5.0, min_snr_floor=0.3).loss_on(fixed_batch)
    phases = [PhaseConfig(datasets=[StreamConfig(path="unused")], steps=1),
              PhaseConfig(datasets=[StreamConfig(path="unused")], steps=1, min_snr_floor=0.3)]
    trainer = make_trainer(probe, noise_cfg, min_snr_gamma=5.0)
    trainer.cfg = replace(trainer.cfg, phases=phases)
    assert [trainer.cfg.min_snr_floor_of(i) for i in (0, 1)] == [0.0, 0.3]
    assert torch.equal(trainer.loss_on(fixed_batch), plain)
    trainer.phase = 1
    assert torch.equal(trainer.loss_on(fixed_batch), floored)
    assert not torch.isclose(plain, floored, rtol=1e-3)
    inherit = replace(trainer.cfg, min_snr_floor=0.3, phases=[phases[0], replace(phases[1], min_snr_floor=0.0)])
    assert [inherit.min_snr_floor_of(i) for i in (0, 1)] == [0.3, 0.0]


@pytest.mark.parametrize("power", [0.0, 0.5, 1.0])
def test_importance_sampling_keeps_the_expected_weighted_loss(power):
    """Timesteps drawn with density p proportional to w**power and weighted w / (T p): the expected
    loss is the mean over all T timesteps of w * loss, for any per-timestep loss; power 0 is
    uniform timesteps with weight w, power 1 a constant weight, the mean of w."""
    from latentforge.diffusion.objectives import importance_density, importance_weight

    w = ref_min_snr_weights(ref_alphas_cumprod("scaled_linear", 0.00085, 0.012, False), 5.0, 0.05)
    density = importance_density(w.float(), power)
    ref = w ** power / (w ** power).sum()
    torch.testing.assert_close(density, ref, rtol=1e-6, atol=1e-12)
    t = torch.arange(T)
    weight = importance_weight(w.float(), density, t).double()
    losses = torch.rand(T, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    torch.testing.assert_close((density * weight * losses).sum(), (w * losses).mean(), rtol=1e-6, atol=0)
    if power == 0:
        torch.testing.assert_close(weight, w, rtol=1e-6, atol=0)
    if power == 1:
        torch.testing.assert_close(weight, torch.full_like(weight, w.mean().item()), rtol=1e-6, atol=0)
    with pytest.raises(Exception, match="must be in"):
        importance_density(w.float(), 1.5)


@pytest.mark.parametrize("power", [0.5, 1.0])
def test_loss_on_with_timestep_importance_equals_the_reference(fixed_batch, power):
    """train.timestep_importance: each sample's timestep is drawn from the reference density (w ** power,
    w the floored v-loss min-SNR weight) by its own generator, and its MSE weighted w / (T p); in a
    phase with its own floor the density and the weights follow that floor."""
    noise_cfg = NoiseScheduleConfig(prediction_type="v_prediction")
    abar = ref_alphas_cumprod("scaled_linear", 0.00085, 0.012, False)
    probe = Probe()
    trainer = make_trainer(probe, noise_cfg, min_snr_gamma=5.0, min_snr_floor=0.05, timestep_importance=power)
    phases = [PhaseConfig(datasets=[StreamConfig(path="unused")], steps=1),
              PhaseConfig(datasets=[StreamConfig(path="unused")], steps=1, min_snr_floor=0.3)]
    trainer.cfg = replace(trainer.cfg, phases=phases)
    for phase, floor in ((0, 0.05), (1, 0.3)):
        trainer.phase = phase
        loss = trainer.loss_on(fixed_batch)
        w = ref_min_snr_weights(abar, 5.0, floor)
        p = w ** power / (w ** power).sum()
        t, noise, post = sample_noise(11, fixed_batch["_position"], SHAPE, T, 0.0, True,
                                      lambda g: torch.multinomial(p, 1, generator=g))
        assert torch.equal(probe.seen["t"], t)
        expected, _ = ref_loss(fixed_batch["latent_mean"], fixed_batch["latent_std"], post, noise, t,
                               fixed_batch["text_hidden"], probe_function, abar, "v_prediction", 0.0,
                               sample_weights=w[t] / (T * p[t]))
        torch.testing.assert_close(loss.double(), expected, rtol=2e-5, atol=1e-7)


def test_timestep_importance_draws_follow_the_density():
    """Over 6,000 positions the timesteps loss_on hands the model follow w / sum(w) (power 1): the
    noisiest 300 timesteps, floored at 0.05, get about 5% of the draws instead of 30%."""
    probe = Probe()
    trainer = make_trainer(probe, NoiseScheduleConfig(prediction_type="v_prediction"), min_snr_gamma=5.0,
                           min_snr_floor=0.05, timestep_importance=1.0)
    n = 6000
    batch = {"latent_mean": torch.zeros((n, 1, 2, 2)), "latent_std": torch.ones((n, 1, 2, 2)),
             "text_hidden": torch.zeros((n, 2, 3)), "_position": list(range(n))}
    trainer.loss_on(batch)
    t = probe.seen["t"]
    w = ref_min_snr_weights(ref_alphas_cumprod("scaled_linear", 0.00085, 0.012, False), 5.0, 0.05)
    mass = torch.stack([w[i * 100:(i + 1) * 100].sum() for i in range(10)]) / w.sum()
    counts = torch.bincount(t // 100, minlength=10).double()
    expected = mass * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 30, (counts, expected)  # 9 degrees of freedom: P(chi2 > 30) ~ 4e-4
    assert float(counts[7:].sum()) < 0.1 * n  # uniform draws would put 30% there


def test_zero_terminal_snr_reference_ends_at_pure_noise():
    """The reference's own claims (Lin et al. 2024): SNR(T-1) = 0, alpha-bar_0 is unchanged."""
    plain = ref_alphas_cumprod("scaled_linear", 0.00085, 0.012, False)
    rescaled = ref_alphas_cumprod("scaled_linear", 0.00085, 0.012, True)
    assert rescaled[-1] == 0
    assert rescaled[0] == pytest.approx(plain[0].item(), rel=1e-12)
    assert bool((rescaled[1:] < rescaled[:-1]).all())


def test_terminal_step_weights(fixed_batch):
    """At SNR 0 (t = T-1 of a zero-terminal schedule) a v-loss sample keeps its plain MSE without
    min-SNR, and weight min(0, gamma) / (0 + 1) = 0 with it: only the other samples count."""
    probe = Probe()
    noise_cfg = SCHEDULES["zero_snr"]
    plain = make_trainer(probe, noise_cfg).loss_on(fixed_batch)
    weighted = make_trainer(probe, noise_cfg, min_snr_gamma=5.0).loss_on(fixed_batch)
    t, noise, post = sample_noise(11, fixed_batch["_position"], SHAPE, T, 0.0, True)
    abar = ref_alphas_cumprod("scaled_linear", 0.00085, 0.012, True)
    keep = torch.tensor([True, False, True, True])  # sample 1 has t = T-1
    sub = {k: (v[keep] if torch.is_tensor(v) else v) for k, v in fixed_batch.items()}
    rest, _ = ref_loss(sub["latent_mean"], sub["latent_std"], post[keep], noise[keep], t[keep], sub["text_hidden"],
                       probe_function, abar, "v_prediction", 5.0)
    torch.testing.assert_close(weighted.double(), rest * 3 / 4, rtol=2e-5, atol=1e-7)
    assert plain > weighted


def test_loss_on_with_the_tiny_unet(fixed_batch):
    """The real U-Net in place of the probe: the reference calls it on the reference x_t."""
    torch.manual_seed(0)
    unet = build_unet(UNetConfig(preset="tiny", in_channels=4, out_channels=4, sample_size=8,
                                 cross_attention_dim=TEXT_DIM)).eval()
    noise_cfg = NoiseScheduleConfig(prediction_type="v_prediction")
    trainer = make_trainer(unet, noise_cfg, min_snr_gamma=5.0)
    with torch.no_grad():
        loss = trainer.loss_on(fixed_batch)
        t, noise, post = sample_noise(11, fixed_batch["_position"], SHAPE, T, 0.0, True)
        abar = ref_alphas_cumprod("scaled_linear", 0.00085, 0.012, False)

        def model(x_t, t, hidden):
            return unet(x_t.float(), t, encoder_hidden_states=hidden.float(), return_dict=False)[0].double()

        expected, _ = ref_loss(fixed_batch["latent_mean"], fixed_batch["latent_std"], post, noise, t,
                               fixed_batch["text_hidden"], model, abar, "v_prediction", 5.0)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------- the random draws


def test_sample_noise_statistics_and_roles():
    """Timesteps uniform on {0, ..., T-1}; diffusion and posterior noise standard normal and
    independent of each other; offset noise adds a per-channel constant of std ``offset``."""
    positions = list(range(4000))
    t, noise, post = sample_noise(5, positions, (4, 4, 4), T, 0.0, True)
    assert t.dtype == torch.int64 and int(t.min()) >= 0 and int(t.max()) <= T - 1
    counts = np.bincount(t.numpy() // 100, minlength=10)  # 10 bins of 100 timesteps: ~400 each
    chi2 = float(((counts - 400) ** 2 / 400).sum())
    assert chi2 < 30, counts  # 9 degrees of freedom: P(chi2 > 30) ~ 4e-4
    for x in (noise, post):
        assert abs(x.mean().item()) < 0.01 and abs(x.std().item() - 1) < 0.01
    corr = torch.corrcoef(torch.stack([noise.flatten(), post.flatten()]))[0, 1]
    assert abs(corr.item()) < 0.01

    t2, with_offset, _ = sample_noise(5, positions, (4, 4, 4), T, 0.3, True)
    assert torch.equal(t2, t)
    shift = with_offset - noise  # the base draw is the same; the difference is the offset
    assert torch.allclose(shift, shift[:, :, :1, :1].expand_as(shift), atol=1e-6)
    assert abs(shift[:, :, 0, 0].std().item() - 0.3) < 0.01
    # one offset per sample and channel (Guttenberg's noise + 0.1 * randn(b, c, 1, 1)), drawn independently:
    # the channels' offsets uncorrelated (standard error 1 / sqrt(4000) = 0.016), not one offset per sample
    offsets = shift[:, :, 0, 0].T
    assert not torch.allclose(offsets[0], offsets[1])
    assert abs(torch.corrcoef(offsets)[0, 1].item()) < 0.08


def test_sample_noise_is_a_function_of_the_position():
    """A sample's draws do not depend on the rest of its batch, and differ between positions and seeds."""
    t, noise, post = sample_noise(5, [10, 11, 12], SHAPE, T, 0.1, True)
    t1, noise1, post1 = sample_noise(5, [12], SHAPE, T, 0.1, True)
    assert torch.equal(t[2:], t1) and torch.equal(noise[2:], noise1) and torch.equal(post[2:], post1)
    assert not torch.equal(noise[0], noise[1])
    _, other_seed, _ = sample_noise(6, [12], SHAPE, T, 0.1, True)
    assert not torch.equal(other_seed, noise1)


# --------------------------------------------------------------------------- caption dropout


def test_caption_dropout_reaches_the_model_as_the_empty_prompt(latent_data, tmp_path):
    """Caption dropout happens in the loader (``LoaderDataset.__getitems__``): a dropped sample's
    text states become the stored empty-prompt embedding, which must equal a direct call of the
    text encoder on the empty caption, and loss_on hands exactly the batch's states to the model."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(latent_data["bert"])
    bert = AutoModel.from_pretrained(latent_data["bert"]).eval()
    with torch.no_grad():
        ids = tok([""], padding="max_length", max_length=TEXT_LEN, truncation=True, return_tensors="pt")
        empty = bert(**ids).last_hidden_state[0]

    cfg = LoaderConfig(datasets=[StreamConfig(path=str(latent_data["latent16"]))], seed=4, caption_dropout=0.5,
                       num_workers=0, shuffle_window_shards=2, cache_dir=str(latent_data["cache"]))
    plain_cfg = LoaderConfig(**{**vars(cfg), "caption_dropout": 0.0})
    loader, plain = build_loader(cfg, 16), build_loader(plain_cfg, 16)
    batch, reference = next(iter(loader)), next(iter(plain))
    loader.close()
    plain.close()
    dropped = batch["_caption_dropped"]
    assert 0 < int(dropped.sum()) < 16, "the test needs dropped and kept captions in one batch"
    assert torch.equal(batch["_position"], reference["_position"])
    for i in range(16):
        if dropped[i]:
            torch.testing.assert_close(batch["text_hidden"][i].float(), empty, atol=2e-3, rtol=2e-3)  # stored fp16
            assert not torch.allclose(reference["text_hidden"][i].float(), empty, atol=2e-3)
        else:
            assert torch.equal(batch["text_hidden"][i], reference["text_hidden"][i])
        assert torch.equal(batch["latent_mean"][i], reference["latent_mean"][i])  # latents untouched

    probe = Probe()
    make_trainer(probe, NoiseScheduleConfig()).loss_on(batch)
    assert torch.equal(probe.seen["hidden"], batch["text_hidden"].float())


# --------------------------------------------------------------------------- text-state noise


def test_text_noise_is_scaled_to_each_caption_and_spares_dropped_ones(latent_data):
    """``train.text_noise``: loss_on hands the model each kept caption's states plus noise of std
    ``text_noise`` x that caption's RMS, drawn per global position (the same draw for the same
    sample, whatever its batch), and the dropped (empty) captions' states unchanged."""
    from latentforge.train.trainer import text_state_noise

    cfg = LoaderConfig(datasets=[StreamConfig(path=str(latent_data["latent16"]))], seed=4, caption_dropout=0.5,
                       num_workers=0, shuffle_window_shards=2, cache_dir=str(latent_data["cache"]))
    loader = build_loader(cfg, 16)
    batch = next(iter(loader))
    loader.close()
    dropped = batch["_caption_dropped"].bool()
    assert 0 < int(dropped.sum()) < 16, "the test needs dropped and kept captions in one batch"

    probe = Probe()
    make_trainer(probe, NoiseScheduleConfig(), text_noise=0.3).loss_on(batch)
    states = batch["text_hidden"].float()
    added = probe.seen["hidden"] - states
    assert torch.equal(added[dropped], torch.zeros_like(added[dropped]))
    rms = states[~dropped].pow(2).mean(dim=(1, 2)).sqrt()
    ratio = added[~dropped].std(dim=(1, 2)) / rms
    assert torch.allclose(ratio, torch.full_like(ratio, 0.3), atol=0.08), ratio  # 8 x 16 draws a caption: +-6%
    draws = text_state_noise(11, batch["_position"].tolist(), tuple(states.shape[1:]))
    torch.testing.assert_close(added[~dropped], (0.3 * rms.view(-1, 1, 1)) * draws[~dropped])
    one = text_state_noise(11, [int(batch["_position"][-1])], tuple(states.shape[1:]))
    assert torch.equal(one[0], draws[-1])
    assert not torch.equal(draws[0], draws[1])
    other_seed = text_state_noise(12, [int(batch["_position"][-1])], tuple(states.shape[1:]))
    assert not torch.equal(other_seed[0], draws[-1])
    # a different stream from the diffusion noise of the same seed and position
    _, noise, _ = sample_noise(11, [int(batch["_position"][-1])], tuple(states.shape[1:]), T, 0.0, False)
    assert not torch.allclose(noise[0], one[0])


def test_text_noise_off_by_default_and_validated():
    assert TrainConfig().text_noise == 0.0
    with pytest.raises(Exception, match="text_noise"):
        TrainConfig(text_noise=-0.1, phases=[PhaseConfig(datasets=[StreamConfig(path="x")], steps=1)]).validate()
