"""Model FLOPs per image (the MFU numerator), counted on the meta device."""

import pytest
import torch

from latentforge.models.unet import UNetConfig
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
    peak, how = device_peak_flops(torch.device("cpu"), "fp32")
    assert peak > 1e9 and "measured" in how
