"""Patch masking of the transformer's training steps (train.masking, train/masking.py).

The masked forward is checked against diffusers' own unmasked forward with the dropped tokens
hidden from the self-attention by its ``attention_mask``; the masked loss against a squared error
written in plain torch over the kept pixels of the full-size output; ratio 0 against the
unmasked loss written out; the masks' draw against its stated properties (per position, seeded,
uniform). The training run, its exact resume and the learning test live in test_dit.py and
test_learning.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from latentforge.cli import main
from latentforge.config import from_dict
from latentforge.errors import ConfigError
from latentforge.models.denoiser import DiTDenoiser
from latentforge.models.dit import DiTConfig, gather_tokens, patchify
from latentforge.train.masking import MaskingConfig, check_kept_tokens, num_kept_tokens, sample_keep
from latentforge.train.trainer import PhaseConfig, TrainConfig, Trainer, sample_noise
from latentforge.data.loader import StreamConfig
from latentforge.train import trainer as trainer_module
from latent_fixtures import latent_data  # noqa: F401  (session fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT_DIM, TEXT_LEN, SIDE, P = 16, 6, 16, 2  # 16x16 latents, patch 2: 64 tokens on an 8x8 grid
GRID = SIDE // P


def tiny_dit() -> tuple[DiTDenoiser, nn.Module]:
    torch.manual_seed(0)
    den = DiTDenoiser(DiTConfig(preset="tiny")).with_data(4, SIDE, TEXT_DIM)
    return den, den.build().eval()


def inputs(batch: int = 3, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, SIDE, SIDE, generator=g)
    t = torch.randint(0, 1000, (batch,), generator=g)
    text = torch.randn(batch, TEXT_LEN, TEXT_DIM, generator=g)
    mask = torch.ones(batch, TEXT_LEN)
    mask[:, 4:] = 0  # padding the cross-attention must ignore
    return x, t, text, mask


class HideDropped(nn.Module):
    """A transformer block whose self-attention sees only the kept tokens: diffusers' own
    ``attention_mask`` (an additive bias of -10000 on the keys of the dropped tokens)."""

    def __init__(self, block: nn.Module, kept: torch.Tensor):
        super().__init__()
        self.block, self.bias = block, ((1 - kept) * -10000.0).unsqueeze(1)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        return self.block(hidden_states, attention_mask=self.bias, **kwargs)


def reference_output(model: nn.Module, x, t, text, mask, keep: torch.Tensor, mixer_blocks: int) -> torch.Tensor:
    """The full-size (B, C, H, W) output of diffusers' unmasked forward in which blocks
    ``mixer_blocks``.. let no token attend to a dropped one. Every other operation of the
    transformer works token by token, so at the kept tokens this is what a forward on the kept
    tokens alone computes (up to exp(-10000) = 0)."""
    kept = torch.zeros(x.shape[0], GRID * GRID).scatter_(1, keep, 1.0)
    original = model.transformer_blocks
    model.transformer_blocks = nn.ModuleList(
        [b if i < mixer_blocks else HideDropped(b, kept) for i, b in enumerate(original)])
    try:
        return model(x, encoder_hidden_states=text, timestep=t, encoder_attention_mask=mask).sample
    finally:
        model.transformer_blocks = original


def kept_pixels(keep: torch.Tensor, channels: int) -> torch.Tensor:
    """(B, C, H, W) 0/1: the pixels of the kept patches (token n = grid row n // GRID, column n % GRID)."""
    out = torch.zeros(keep.shape[0], channels, SIDE, SIDE)
    for b, row in enumerate(keep.tolist()):
        for n in row:
            r, c = divmod(n, GRID)
            out[b, :, r * P:(r + 1) * P, c * P:(c + 1) * P] = 1.0
    return out


# ------------------------------------------------------------------ the masked forward


@pytest.mark.parametrize("mixer_blocks", [0, 1], ids=["masked-after-embedding", "after-a-1-block-mixer"])
def test_the_masked_forward_is_the_full_model_with_the_dropped_tokens_hidden(mixer_blocks):
    den, model = tiny_dit()
    x, t, text, mask = inputs()
    keep = sample_keep(3, [10, 11, 12], GRID * GRID, num_kept_tokens(GRID * GRID, 0.75))
    with torch.no_grad():
        ours = den.forward_tokens(model, x, t, text, mask, keep, mixer_blocks)
        ref = reference_output(model, x, t, text, mask, keep, mixer_blocks)
        unhidden = model(x, encoder_hidden_states=text, timestep=t, encoder_attention_mask=mask).sample
    assert ours.shape == (3, 16, P * P * 4) and "forward" not in vars(model)  # the model's own forward is back
    expected = gather_tokens(patchify(ref, P), keep)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    # Guard: the dropped tokens do matter to an unmasked forward, so the check above can fail.
    assert (gather_tokens(patchify(unhidden, P), keep) - expected).abs().max() > 1e-2


def test_every_token_kept_is_the_models_own_forward_bit_for_bit():
    """keep = None (every token, in order) is diffusers' forward patchified; with the tokens in a
    permuted order the predictions follow their tokens (checks patchify's layout against the
    model's unpatchify)."""
    den, model = tiny_dit()
    x, t, text, mask = inputs()
    perm = torch.stack([torch.randperm(GRID * GRID, generator=torch.Generator().manual_seed(i)) for i in range(3)])
    with torch.no_grad():
        full = den.forward(model, x, t, text, mask)
        all_tokens = den.forward_tokens(model, x, t, text, mask, None)
        permuted = den.forward_tokens(model, x, t, text, mask, perm)
    # patchify written out: token (r, c) holds out[:, ch, 2r + i, 2c + j] at i * 2 * C + j * C + ch
    manual = torch.stack([torch.stack([full[:, :, r * P + i, c * P + j] for i in range(P) for j in range(P)], 1)
                          for r in range(GRID) for c in range(GRID)], 1).flatten(2)
    assert torch.equal(patchify(full, P), manual)
    assert torch.equal(all_tokens, patchify(full, P))
    torch.testing.assert_close(permuted, gather_tokens(manual, perm), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ the masked loss


def make_trainer(model: nn.Module, masking: MaskingConfig, phase_ratio: float | None = None) -> Trainer:
    cfg = TrainConfig(model="dit", seed=7, ema=None, loggers=[], device="cpu", precision="fp32", masking=masking,
                      phases=[PhaseConfig(datasets=[StreamConfig(path="unused")], steps=1, masking_ratio=phase_ratio)])
    return Trainer(cfg, model, make_loader=lambda *_: None, run_dir="unused",
                   latent_meta={"vae": {"scaling_factor": 0.5, "shift_factor": 0.1}}, device=torch.device("cpu"),
                   progress=False)


def a_batch(batch: int = 4) -> dict:
    g = torch.Generator().manual_seed(5)
    mask = torch.ones(batch, TEXT_LEN)
    mask[:, 5:] = 0
    return {"latent_mean": torch.randn(batch, 4, SIDE, SIDE, generator=g),
            "latent_std": 0.1 * torch.rand(batch, 4, SIDE, SIDE, generator=g),
            "text_hidden": torch.randn(batch, TEXT_LEN, TEXT_DIM, generator=g), "text_mask": mask,
            "_position": [40, 41, 42, 43][:batch]}


def noised(trainer: Trainer, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_t, eps, t) written out: x0 = (mean + std * n - shift) * scale, x_t = sqrt(abar) x0 + sqrt(1 - abar) eps."""
    t, eps, post = sample_noise(7, batch["_position"], (4, SIDE, SIDE), 1000, 0.0, True)
    x0 = (batch["latent_mean"] + batch["latent_std"] * post - 0.1) * 0.5
    abar = trainer.alphas_cumprod[t].reshape(-1, 1, 1, 1)
    return abar.sqrt() * x0 + (1 - abar).sqrt() * eps, eps, t


def test_ratio_0_is_the_unmasked_loss_bit_for_bit():
    """Masking off, or a phase's masking_ratio 0 under train.masking.ratio 0.5 (a final unmasked
    phase): the loss is the unmasked epsilon loss written out, bit for bit."""
    den, model = tiny_dit()
    batch = a_batch()
    for trainer in (make_trainer(model, MaskingConfig()), make_trainer(model, MaskingConfig(ratio=0.5), 0.0)):
        with torch.no_grad():
            loss = trainer.loss_on(batch)
            x_t, eps, t = noised(trainer, batch)
            pred = model(x_t, encoder_hidden_states=batch["text_hidden"], timestep=t,
                         encoder_attention_mask=batch["text_mask"]).sample
        assert trainer.masking_ratio() == 0.0
        assert torch.equal(loss, ((pred - eps) ** 2).mean(dim=(1, 2, 3)).mean())


@pytest.mark.parametrize("ratio, mixer_blocks", [(0.5, 0), (0.75, 1)])
def test_the_masked_loss_is_the_squared_error_over_the_kept_patches_only(ratio, mixer_blocks):
    """The trainer's masked loss against plain torch: the full-size output of the reference forward
    (dropped tokens hidden), its squared error against eps summed over the pixels of the kept
    patches, divided by their count, averaged over the samples. A phase's ratio overrides the
    run's."""
    den, model = tiny_dit()
    batch = a_batch()
    trainer = make_trainer(model, MaskingConfig(ratio=0.3, mixer_blocks=mixer_blocks), ratio)
    assert trainer.masking_ratio() == ratio
    keep = sample_keep(7, batch["_position"], GRID * GRID, num_kept_tokens(GRID * GRID, ratio))
    assert keep.shape == (4, {0.5: 32, 0.75: 16}[ratio])
    with torch.no_grad():
        loss = trainer.loss_on(batch)
        x_t, eps, t = noised(trainer, batch)
        out = reference_output(model, x_t, t, batch["text_hidden"], batch["text_mask"], keep, mixer_blocks)
        unmasked = make_trainer(model, MaskingConfig()).loss_on(batch)
    w = kept_pixels(keep, 4)
    expected = (((out - eps) ** 2 * w).sum(dim=(1, 2, 3)) / w.sum(dim=(1, 2, 3))).mean()
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    assert abs(float(loss) - float(unmasked)) > 1e-3 * float(unmasked)  # guard: the masking changed the loss


# ------------------------------------------------------------------ the masks


def test_masks_are_per_position_seeded_and_uniform():
    a = sample_keep(0, [5, 6, 7], 64, 16)
    assert a.dtype == torch.int64 and a.shape == (3, 16)
    for row in a:
        assert torch.equal(row, row.unique()) and 0 <= int(row.min()) and int(row.max()) < 64  # sorted, distinct
    assert torch.equal(sample_keep(0, [7, 5], 64, 16), a[[2, 0]])  # a position's mask, whatever its batch
    assert not torch.equal(sample_keep(1, [5, 6, 7], 64, 16), a)  # another seed, other masks
    assert not torch.equal(a[0], a[1])
    # Each token is kept with probability 16/64 = 0.25: over 2,000 masks its count is Binomial(2000, 0.25),
    # standard deviation 19.4; every one of the 64 counts within 5 of them of 500.
    counts = torch.bincount(sample_keep(3, list(range(2000)), 64, 16).flatten(), minlength=64)
    assert int(counts.sum()) == 32_000 and int((counts - 500).abs().max()) < 97, counts


def test_kept_token_count_rounds_and_must_be_at_least_one():
    assert [num_kept_tokens(64, r) for r in (0.0, 0.5, 0.75, 0.9, 0.99)] == [64, 32, 16, 6, 1]  # 6.4, 0.64 round
    assert num_kept_tokens(16, 0.96875) == 1  # 0.5 rounds up
    check_kept_tokens(16, 0.9, "16 tokens", "train.masking.ratio")
    with pytest.raises(ConfigError, match=r"^train\.masking\.ratio: 0\.97 keeps no patch of the 16 "):
        check_kept_tokens(16, 0.97, "16 tokens", "train.masking.ratio")


# ------------------------------------------------------------------ bad input, one line


def test_masking_a_unet_run_is_one_line(capsys):
    code = main(["config", "show", "--recipe", "tiny-cpu", "train.masking.ratio=0.5"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("latentforge: error: train.masking.ratio: 0.5 masks the transformer's patch tokens"), err


def test_a_ratio_that_keeps_no_patch_at_the_runs_latent_size_is_refused(latent_data, tmp_path):
    """8x8 latents at patch 2 are 16 tokens: 0.97 keeps round(0.48) = 0 of them."""
    from latentforge.train.run import RunConfig, train

    cfg = from_dict(RunConfig, {"train": {
        "model": "dit", "masking": {"ratio": 0.5}, "device": "cpu", "loggers": [],
        "phases": [{"datasets": [{"path": str(latent_data["latent16"])}], "steps": 1, "masking_ratio": 0.97}]},
        "data": {"num_workers": 0, "cache_dir": str(latent_data["cache"])}})
    with pytest.raises(ConfigError, match=r"^train\.phases\[0\]\.masking_ratio: 0\.97 keeps no patch of the 16 of "
                                          r"the 8x8 latents of train\.phases\[0\]"):
        train(cfg, tmp_path / "run", progress=False)
    assert not list((tmp_path / "run").glob("step-*"))


def test_masked_forward_flops_count_the_kept_tokens_only():
    """FLOPs per training image (3x forward, on meta) of a masked step against the matmuls written
    out as in test_dit: the patch embedding on all 64 tokens, the mixer blocks on 64, the other
    blocks and the output projection on the kept 16."""
    from latentforge.plan.flops import train_flops_per_image

    den = DiTDenoiser(DiTConfig(preset="tiny")).with_data(4, 16, 384)
    d, text_len, text = 64, 24, 384

    def block(n: int) -> int:
        return (2 * n * d * d * 4 + 2 * 2 * n * n * d + 2 * n * d * d * 2 + 2 * text_len * d * d * 2
                + 2 * 2 * n * text_len * d + 2 * n * d * 4 * d * 2)

    def rest(kept: int) -> int:
        return (2 * 64 * 4 * P * P * d + 2 * (256 * d + d * d + d * 6 * d) + 2 * text_len * (text * d + d * d)
                + 2 * kept * d * P * P * 4)

    assert train_flops_per_image(den, 16, text_len) == 3 * (2 * block(64) + rest(64))
    assert train_flops_per_image(den, 16, text_len, 0.75) == 3 * (2 * block(16) + rest(16))
    assert train_flops_per_image(den, 16, text_len, 0.75, 1) == 3 * (block(64) + block(16) + rest(16))


# ------------------------------------------------------------------ learning with half the patches

LEARN_STEPS = 100
# Calibration on this machine (learn_and_measure, held-out loss measured unmasked, ratio 0.5):
#   seeds 0-2: 1.338-1.408 before, 0.2407-0.2449 after 100 steps (unmasked training, seed 0: 0.2390);
#   seeds 0-2, the misaligned target (learn_misaligned_and_measure): 1.030-1.055 after 100 steps.
# The bound 0.5 is twice the worst trained loss and under half the misaligned ones.
LEARN_BOUND = 0.5


def learn_and_measure(data: dict, run_dir, seed: int, ratio: float, steps: int) -> tuple[float, float]:
    """test_learning's run (micro batch 16, AdamW 2e-3, the 64-sample latent16 set) with the tiny
    transformer (8x8 latents: 16 tokens) trained with ``ratio`` of its patches masked: (held-out
    loss of the initial weights, of the trained weights), both measured unmasked (the model that
    samples) with test_learning's held_out_loss."""
    import json

    from latentforge import checkpoint as ckpt
    from latentforge.train.run import train
    from latent_fixtures import TEXT_DIM as DATA_TEXT_DIM
    from test_learning import held_out_loss, run_config

    train(run_config(data, seed, steps, model="dit", dit={"preset": "tiny"}, masking={"ratio": ratio}), run_dir,
          progress=False)
    meta = json.loads((run_dir / "data_meta.json").read_text())

    def fresh() -> nn.Module:
        return DiTDenoiser(DiTConfig(preset="tiny")).with_data(4, 8, DATA_TEXT_DIM).build()

    torch.manual_seed(seed)  # train() initialises the model right after seeding with train.seed
    initial = fresh().state_dict()
    trained = ckpt.load_checkpoint(ckpt.find_latest(run_dir)).tensors["model"]
    return held_out_loss(data, initial, meta, model=fresh()), held_out_loss(data, trained, meta, model=fresh())


def misaligned_target(tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """A wrong masked target: each kept token is given the target of the next kept patch."""
    return gather_tokens(tokens, keep.roll(1, dims=1))


def learn_misaligned_and_measure(data: dict, run_dir, seed: int, ratio: float, steps: int) -> tuple[float, float]:
    with pytest.MonkeyPatch.context() as m:
        m.setattr(trainer_module, "gather_tokens", misaligned_target)
        return learn_and_measure(data, run_dir, seed, ratio, steps)


def test_training_on_half_the_patches_lowers_the_unmasked_held_out_loss(latent_data, tmp_path):
    """100 steps of the tiny transformer with 50% of the patches masked; see LEARN_BOUND."""
    initial, trained = learn_and_measure(latent_data, tmp_path / "run", 0, 0.5, LEARN_STEPS)
    assert initial > 0.9  # an untrained model predicts nothing: about the noise's variance
    assert trained < LEARN_BOUND, f"held-out loss {trained:.4f} after {LEARN_STEPS} masked steps ({initial:.4f})"


@pytest.mark.slow
def test_a_misaligned_masked_target_fails_the_bound(latent_data, tmp_path):
    """The same run with each kept token trained on the next kept patch's target stays above the bound."""
    _, broken = learn_misaligned_and_measure(latent_data, tmp_path / "run", 0, 0.5, LEARN_STEPS)
    assert broken > LEARN_BOUND, f"a misaligned masked target reached {broken:.4f}, under {LEARN_BOUND}"
