"""The training math against values derived by hand or from the published formulas, not from the
code under test: the learning-rate schedules, AdamW's and Muon's wiring and Newton-Schulz
iteration, the VAE's loss (reconstruction plus the weighted per-pixel KL of a posterior sample),
the latent scale measurement, and the patch masks' random stream. Each check was verified against
a planted bug of its kind (run 46's audit: each of those bugs passed every other test)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from latentforge.train.optim import OptimConfig, build_optimizer, lr_multiplier, orthogonalize
from test_vae import raw, vae_config  # noqa: F401  (module fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

# Jordan et al. 2024 ("Muon"), the quintic Newton-Schulz coefficients, written out independently.
NS_A, NS_B, NS_C = 3.4445, -4.7750, 2.0315


def _quintic(s: torch.Tensor, steps: int) -> torch.Tensor:
    """The Newton-Schulz iteration acts on each singular value alone: s <- a s + b s^3 + c s^5."""
    for _ in range(steps):
        s = NS_A * s + NS_B * s**3 + NS_C * s**5
    return s


def _matrix_with_known_svd(rows: int, cols: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, rows, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=g, dtype=torch.float64))
    k = min(rows, cols)
    s = torch.linspace(1.0, 0.05, k, dtype=torch.float64)
    return (u[:, :k] * s) @ v[:, :k].T, u[:, :k], s, v[:, :k]




def test_linear_decay_ends_at_min_lr_ratio():
    """Catches a planted bug (linear schedule ignoring min_lr_ratio). The existing test only checks linear with
    min_lr_ratio 0. Linear from 1 at the end of warmup to 0.2 at step 110: 1 - 0.8 * progress."""
    lin = OptimConfig(warmup_steps=10, schedule="linear", min_lr_ratio=0.2)
    assert lr_multiplier(9, lin, 110) == pytest.approx(1.0)
    assert lr_multiplier(35, lin, 110) == pytest.approx(0.8)  # progress 0.25
    assert lr_multiplier(60, lin, 110) == pytest.approx(0.6)  # progress 0.5
    assert lr_multiplier(110, lin, 110) == pytest.approx(0.2)
    assert lr_multiplier(500, lin, 110) == pytest.approx(0.2)  # stays at the floor


@pytest.mark.parametrize("fused", [True, False])
def test_adamw_takes_the_configured_betas_eps_and_weight_decay(fused):
    """Catches a planted bug (betas or eps not passed to torch's AdamW: the defaults 0.9/0.999/1e-8 are used
    silently). Two AdamW steps (Loshchilov & Hutter 2019, Algorithm 2, with bias correction)
    written out in float64 for a 1x3 matrix (decayed) and a bias (not decayed), with betas, eps and
    weight decay far from torch's defaults so that each one changes the result."""
    lr, (b1, b2), eps, wd = 0.1, (0.5, 0.8), 0.1, 0.5
    w0 = torch.tensor([[1.0, -2.0, 0.5]])
    b0 = torch.tensor([0.3])
    grads = [(torch.tensor([[0.2, -1.0, 3.0]]), torch.tensor([-0.4])),
             (torch.tensor([[1.0, 0.5, -2.0]]), torch.tensor([0.7]))]

    def reference(p0: torch.Tensor, gs: list[torch.Tensor], decay: float) -> torch.Tensor:
        p, m, v = p0.double(), torch.zeros_like(p0, dtype=torch.float64), torch.zeros_like(p0, dtype=torch.float64)
        for t, g in enumerate(gs, start=1):
            g = g.double()
            p = p * (1 - lr * decay)
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
            p = p - lr * m_hat / (v_hat.sqrt() + eps)
        return p.float()

    weight = torch.nn.Parameter(w0.clone())
    bias = torch.nn.Parameter(b0.clone())
    opt = build_optimizer([weight, bias], OptimConfig(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, fused=fused),
                          "cpu")
    for gw, gb in grads:
        weight.grad, bias.grad = gw.clone(), gb.clone()
        opt.step()
    torch.testing.assert_close(weight.detach(), reference(w0, [g[0] for g in grads], wd), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bias.detach(), reference(b0, [g[1] for g in grads], 0.0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("shape", [(6, 10), (10, 6)])
def test_orthogonalize_applies_the_quintic_polynomial_to_the_singular_values(steps, shape):
    """Catches a planted bug (one Newton-Schulz iteration fewer) and pins the coefficients much tighter than the
    existing singular-value band (a typo 2.0315 -> 2.3015 is caught only by the band). The
    iteration maps G = U S V^T to U p^k(S / ||G||_F) V^T, p(s) = a s + b s^3 + c s^5."""
    m, u, s, v = _matrix_with_known_svd(*shape)
    expected = (u * _quintic(s / s.norm(), steps)) @ v.T
    got = orthogonalize(m.float(), steps=steps, dtype=torch.float32).double()
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-4)


def test_muon_step_uses_the_configured_newton_schulz_steps():
    """Catches a planted bug (muon_ns_steps not passed to MuonAdamW: every run uses 5). One Muon step from a
    zero momentum buffer on a (4, 2, 3, 3) kernel: the Nesterov update is (1 - mu)(1 + mu) g, a
    multiple of g, so after the Frobenius normalisation it is p^k(S/||S||) in g's singular basis;
    the step is lr * 0.2 * sqrt(max(4, 18)) times that, after the decoupled decay (Liu et al. 2025)."""
    lr, wd, k = 0.05, 0.1, 2
    g2d, u, s, v = _matrix_with_known_svd(4, 18, seed=3)
    conv = torch.nn.Conv2d(2, 4, 3, bias=False)
    p0 = conv.weight.detach().clone()
    opt = build_optimizer(conv.parameters(), OptimConfig(name="muon", lr=lr, weight_decay=wd, muon_ns_steps=k,
                                                         muon_ns_dtype="float32"), "cpu", hidden=[conv.weight])
    conv.weight.grad = g2d.float().reshape(4, 2, 3, 3)
    opt.step()
    ortho = (u * _quintic(s / s.norm(), k)) @ v.T
    expected = p0.double() * (1 - lr * wd) - lr * 0.2 * math.sqrt(18) * ortho.reshape(4, 2, 3, 3)
    torch.testing.assert_close(conv.weight.detach().double(), expected, rtol=0, atol=1e-5)




class _FixedPosteriorVAE:
    """Stands in for an AutoencoderKL whose posterior is a given (mean, logvar) for every image."""

    def __init__(self, mean: torch.Tensor, logvar: torch.Tensor):
        self.mean, self.logvar = mean, logvar

    def eval(self):
        return self

    def encode(self, x):
        from types import SimpleNamespace

        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        n = x.shape[0]
        params = torch.cat([self.mean.expand(n, -1, -1, -1), self.logvar.expand(n, -1, -1, -1)], dim=1)
        return SimpleNamespace(latent_dist=DiagonalGaussianDistribution(params))


def test_measure_latent_std_is_the_population_std_of_the_sampled_latents():
    """Catches a planted bug (root mean square instead of std: no mean subtraction); also catches (posterior
    var instead of std) and (the mode instead of a sample) without training a VAE.
    (1) A deterministic posterior (logvar -30: std 3e-7) whose means are 1 and 3 in equal numbers:
        std exactly 1 (the RMS would be sqrt(5)). (2) Means 0 and posterior std 2 (logvar log 4):
        the sampled latents have std 2 (4096 x 8 draws: within 3%; var would give 4, the mode ~0)."""
    from latentforge.train.vae import measure_latent_std

    batches = [{"pixels": torch.zeros(8, 3, 16, 16)} for _ in range(4)]
    mean = torch.tensor([1.0, 3.0, 1.0, 3.0]).reshape(1, 4, 1, 1).expand(1, 4, 8, 8)
    vae = _FixedPosteriorVAE(mean, torch.full((1, 4, 8, 8), -30.0))
    std = measure_latent_std(vae, iter(batches), "cpu", 16, torch.Generator().manual_seed(0))
    assert std == pytest.approx(1.0, abs=1e-4)

    vae = _FixedPosteriorVAE(torch.zeros(1, 4, 8, 8), torch.full((1, 4, 8, 8), math.log(4.0)))
    std = measure_latent_std(vae, iter(batches), "cpu", 32, torch.Generator().manual_seed(0))
    assert std == pytest.approx(2.0, rel=0.03)


def _vae_cfg(raw: dict[str, Path], steps: int):
    """test_vae's tiny VAE run, logging every step."""
    cfg = vae_config(raw, 0, steps=steps)
    cfg.log_every = 1
    return cfg


def test_train_vae_loss_is_reconstruction_plus_weighted_per_pixel_kl_of_a_posterior_sample(raw, tmp_path,
                                                                                          monkeypatch):
    """Catches planted bugs: the KL summed over the batch, not per pixel, its sign flipped, kl_weight
    ignored, the posterior sampled with var instead of std, or its mean decoded with no sample.
    The first step of a run with kl_weight 0.25: the decoder input is mean + exp(logvar / 2) * n, n the
    first draw of a generator seeded with vae.seed; the logged KL is KL(N(mu, sigma^2) || N(0, 1)) =
    0.5 * sum(mu^2 + sigma^2 - 1 - log sigma^2) over a latent, averaged over the batch, divided by the
    3 * 16 * 16 image values; the logged loss is the reconstruction loss plus 0.25 times that."""
    from latentforge.train import vae as vae_module

    seen: dict[str, torch.Tensor] = {}
    real_build, real_noise, real_rec = vae_module.build_vae, vae_module.noise_latents, vae_module.reconstruction_loss

    def build(cfg):
        vae = real_build(cfg)
        encode = vae.encode

        def spy(x, *a, **k):
            out = encode(x, *a, **k)
            if "mean" not in seen:
                seen["mean"] = out.latent_dist.mean.detach().clone()
                seen["logvar"] = out.latent_dist.logvar.detach().clone()
            return out

        vae.encode = spy
        return vae

    def noise(z, scale, generator):
        seen.setdefault("z", z.detach().clone())
        return real_noise(z, scale, generator)

    def rec_loss(*a, **k):
        terms = real_rec(*a, **k)
        seen.setdefault("rec", terms["loss"].detach().clone())
        return terms

    monkeypatch.setattr(vae_module, "build_vae", build)
    monkeypatch.setattr(vae_module, "noise_latents", noise)
    monkeypatch.setattr(vae_module, "reconstruction_loss", rec_loss)
    cfg = _vae_cfg(raw, steps=1)
    cfg.kl_weight = 0.25
    metrics = vae_module.train_vae(cfg, tmp_path / "vae", progress=False)

    mu, logvar = seen["mean"].double(), seen["logvar"].double()
    n = torch.randn(mu.shape, generator=torch.Generator().manual_seed(cfg.seed)).double()
    torch.testing.assert_close(seen["z"].double(), mu + (0.5 * logvar).exp() * n, rtol=1e-5, atol=1e-5)
    kl = (0.5 * (mu**2 + logvar.exp() - 1 - logvar)).sum(dim=(1, 2, 3)).mean() / (3 * 16 * 16)
    first = metrics["history"][0]
    assert first["step"] == 1
    assert first["kl"] == pytest.approx(float(kl), rel=1e-4)
    assert 0.25 * float(kl) > 1e-3 * float(seen["rec"])  # guard: the KL term is visible in the loss
    assert first["loss"] == pytest.approx(float(seen["rec"]) + 0.25 * float(kl), rel=1e-5)


class _StopAfterSchedule(Exception):
    pass


def test_train_vae_lr_warms_up_then_follows_a_cosine_to_5_percent(raw, tmp_path, monkeypatch):
    """Catches a planted bug (cosine down to 0 instead of 5%) and (warmup off by one). vae.lr's documented
    shape: linear warmup (step + 1) / warmup_steps, then 0.05 + 0.95 * (1 + cos(pi * progress)) / 2;
    constant after warmup when only max_seconds bounds the run. The LambdaLR's function is read
    before any training step."""
    from latentforge.train import vae as vae_module

    lambdas = []
    real_lambda_lr = torch.optim.lr_scheduler.LambdaLR

    class Spy(real_lambda_lr):
        def __init__(self, optimizer, lr_lambda, *a, **k):
            lambdas.append(lr_lambda)
            super().__init__(optimizer, lr_lambda, *a, **k)

    def stop(*a, **k):
        raise _StopAfterSchedule

    monkeypatch.setattr(torch.optim.lr_scheduler, "LambdaLR", Spy)
    monkeypatch.setattr(vae_module, "build_loader", stop)
    with pytest.raises(_StopAfterSchedule):
        vae_module.train_vae(_vae_cfg(raw, steps=110), tmp_path / "a", progress=False)
    cfg = _vae_cfg(raw, steps=0)
    cfg.max_seconds = 5.0
    with pytest.raises(_StopAfterSchedule):
        vae_module.train_vae(cfg, tmp_path / "b", progress=False)
    f, timed = lambdas
    assert [f(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert f(10) == pytest.approx(1.0)
    assert f(35) == pytest.approx(0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert f(60) == pytest.approx(0.525)
    assert f(110) == pytest.approx(0.05) and f(1000) == pytest.approx(0.05)
    assert timed(0) == pytest.approx(0.1) and timed(10) == timed(10**6) == 1.0


def test_train_vae_clips_every_steps_gradient_norm_to_1(raw, tmp_path, monkeypatch):
    """Catches a planted bug (the VAE's gradient clipping removed): each of the 2 steps clips the global norm
    of all the VAE's gradients to 1 (the documented max norm), before the optimizer step."""
    from latentforge.train import vae as vae_module

    calls = []
    real_clip = torch.nn.utils.clip_grad_norm_

    def spy(params, max_norm, *a, **k):
        params = list(params)
        calls.append((len(params), max_norm))
        return real_clip(params, max_norm, *a, **k)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    built = []
    real_build = vae_module.build_vae
    monkeypatch.setattr(vae_module, "build_vae", lambda cfg: built.append(real_build(cfg)) or built[-1])
    vae_module.train_vae(_vae_cfg(raw, steps=2), tmp_path / "vae", progress=False)
    assert calls == [(len(list(built[0].parameters())), 1.0)] * 2




def test_masks_are_drawn_from_their_own_mask_stream():
    """Catches a planted bug (the mask stream constant equal to the text-noise stream, so that a sample's mask and
    its text noise come from one generator). The documented draw: the first num_keep of a randperm
    from a CPU generator seeded by hash64(seed, position, "mask" as a big-endian 32-bit int), sorted."""
    from latentforge.data.order import hash64
    from latentforge.train.masking import sample_keep

    stream = int.from_bytes(b"mask", "big")
    assert stream != int.from_bytes(b"text", "big")
    keys = hash64(np.uint64(3), np.asarray([5, 9], dtype=np.int64), np.uint64(stream))
    expected = torch.stack([torch.randperm(64, generator=torch.Generator().manual_seed(int(k) & (2**63 - 1)))[:16]
                            .sort().values for k in keys.tolist()])
    assert torch.equal(sample_keep(3, [5, 9], 64, 16), expected)
