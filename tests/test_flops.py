"""Model FLOPs per image (the MFU numerator), counted on the meta device."""

import pytest
import torch

from latentforge.models.unet import UNetConfig
from latentforge.plan import flops
from latentforge.plan.flops import device_peak_flops, mfu, train_flops_per_image, unet_forward_flops


def test_sd2_base_forward_flops_match_the_published_figures():
    cfg = UNetConfig(preset="sd2-base")
    assert unet_forward_flops(cfg, 32, 77) / 1e9 == pytest.approx(181, rel=0.01)  # 256 px
    assert unet_forward_flops(cfg, 64, 77) / 1e9 == pytest.approx(804, rel=0.01)  # 512 px
    assert train_flops_per_image(cfg, 32, 77) == 3 * unet_forward_flops(cfg, 32, 77)


def test_flops_grow_with_resolution_and_mfu_arithmetic():
    cfg = UNetConfig(preset="tiny", in_channels=4, out_channels=4, sample_size=8)
    small, large = unet_forward_flops(cfg, 8, 16), unet_forward_flops(cfg, 16, 16)
    assert 3.0 < large / small < 5.0  # most work (convolutions) is proportional to the latent pixels
    assert mfu(100.0, 1e9, 1e12) == pytest.approx(0.1)


@pytest.mark.slow  # the default suite keeps under 15 minutes; this test took 12-49 s on a quiet machine
def test_cpu_peak_is_the_best_of_the_timed_matmuls(monkeypatch):
    """2 n^3 FLOPs over the fastest of the repeats, on a clock that reads 0.5, 0.25 and 0.4 s for
    the three timed matmuls (the warm-up is not timed); device_peak_flops on CPU is that figure."""
    ticks = iter([0.0, 0.5, 10.0, 10.25, 20.0, 20.4])
    flops.measured_cpu_peak_flops.cache_clear()
    monkeypatch.setattr(flops.time, "perf_counter", lambda: next(ticks))
    try:
        assert flops.measured_cpu_peak_flops(64, 3) == 2 * 64**3 / 0.25
        assert next(ticks, "used up") == "used up"  # every repeat was timed
        ticks = iter([0.0, 2.0] * 5)  # the default 5 repeats of 2 s each, fp32
        assert device_peak_flops(torch.device("cpu"), "fp32") == (2 * 1024**3 / 2.0, "measured fp32 matmul peak")
        ticks = iter([0.0, 4.0] * 5)
        assert device_peak_flops(torch.device("cpu"), "bf16") == (2 * 1024**3 / 4.0, "measured bf16 matmul peak")
    finally:
        flops.measured_cpu_peak_flops.cache_clear()  # later tests measure the real CPU
