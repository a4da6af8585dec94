"""U-Net presets: the exact SD2-base architecture (on the meta device), tiny/small shapes, validation, loading."""

from __future__ import annotations

import os

import pytest
import torch

from latentforge.config import from_dict
from latentforge.errors import ConfigError, UserError
from latentforge.models.unet import (
    UNetConfig,
    build_unet,
    load_unet,
    unet_diffusers_config,
    unet_num_params,
)

# stabilityai/stable-diffusion-2-base, unet/config.json (diffusers 0.8.0 era keys).
SD2_BASE_CONFIG_JSON = {
    "act_fn": "silu",
    "attention_head_dim": [5, 10, 20, 20],
    "block_out_channels": [320, 640, 1280, 1280],
    "center_input_sample": False,
    "cross_attention_dim": 1024,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "downsample_padding": 1,
    "dual_cross_attention": False,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "num_class_embeds": None,
    "only_cross_attention": False,
    "out_channels": 4,
    "sample_size": 64,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    "use_linear_projection": True,
}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_sd2_base_matches_published_config_and_param_count_on_meta():
    cfg = UNetConfig(preset="sd2-base")
    resolved = unet_diffusers_config(cfg)
    for key, value in SD2_BASE_CONFIG_JSON.items():
        assert resolved[key] == value, key
    assert resolved["transformer_layers_per_block"] == 1  # diffusers' default, written out

    rss_before = _rss_mib()
    with torch.device("meta"):
        model = build_unet(cfg)
    grown_mib = _rss_mib() - rss_before
    assert sum(p.numel() for p in model.parameters()) == 865_910_724
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    assert grown_mib < 200, f"building on meta allocated {grown_mib:.0f} MiB (real weights are 3,303 MiB)"
    # 64-d heads: diffusers' attention_head_dim is the number of heads.
    attn = model.down_blocks[0].attentions[0].transformer_blocks[0].attn1
    assert attn.heads == 5 and attn.to_q.out_features // attn.heads == 64
    assert unet_num_params(cfg) == 865_910_724


def test_preset_param_counts_as_documented():
    assert unet_num_params(UNetConfig(preset="small")) == 38_800_580
    assert unet_num_params(UNetConfig(preset="tiny")) == 343_476
    assert unet_num_params(UNetConfig(preset="tiny", in_channels=16, out_channels=16)) == 346_944
    tiny = build_unet(UNetConfig(preset="tiny"))
    assert sum(p.numel() for p in tiny.parameters()) == 343_476


@pytest.mark.parametrize(
    ("size", "channels", "text_dim"),
    [(4, 4, 384), (8, 4, 384), (16, 4, 384), (8, 16, 384), (4, 48, 384), (16, 16, 768)],
)
def test_tiny_forward_shapes(size, channels, text_dim):
    cfg = UNetConfig(preset="tiny", in_channels=channels, out_channels=channels, sample_size=size, cross_attention_dim=text_dim)
    torch.manual_seed(0)
    model = build_unet(cfg)
    x = torch.randn(3, channels, size, size)
    text = torch.randn(3, 7, text_dim)
    out = model(x, torch.tensor([0, 500, 999]), encoder_hidden_states=text).sample
    assert out.shape == x.shape
    assert torch.isfinite(out).all()
    # The text states reach the output (cross-attention is wired in).
    out2 = model(x, torch.tensor([0, 500, 999]), encoder_hidden_states=text + 1.0).sample
    assert not torch.allclose(out, out2)


def test_tiny_rejects_text_states_of_the_wrong_width():
    model = build_unet(UNetConfig(preset="tiny"))  # 384-d
    with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied \(5x1024 and 384x"):
        model(torch.randn(1, 4, 8, 8), torch.tensor([1]), encoder_hidden_states=torch.randn(1, 5, 1024))


@pytest.mark.parametrize("size", [8, 32])
def test_small_forward_shapes(size):
    cfg = UNetConfig(preset="small", cross_attention_dim=384)
    torch.manual_seed(0)
    model = build_unet(cfg)
    x = torch.randn(1, 4, size, size)
    out = model(x, torch.tensor([10]), encoder_hidden_states=torch.randn(1, 5, 384)).sample
    assert out.shape == x.shape


def test_custom_preset_builds_and_requires_its_fields():
    fields = dict(
        block_out_channels=[32, 32, 64],
        layers_per_block=1,
        attention_head_dim=[1, 1, 2],
        cross_attention_dim=64,
        down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    )
    cfg = from_dict(UNetConfig, {"preset": "custom", "norm_num_groups": 8, **fields})
    model = build_unet(cfg)
    x = torch.randn(2, 4, 16, 16)
    assert model(x, torch.tensor([3, 4]), encoder_hidden_states=torch.randn(2, 3, 64)).sample.shape == x.shape
    assert unet_diffusers_config(cfg)["sample_size"] == 64  # not set: sd2-base's
    del fields["cross_attention_dim"]
    with pytest.raises(ConfigError, match="^unet.cross_attention_dim: required when preset is 'custom'"):
        from_dict(UNetConfig, {"preset": "custom", "norm_num_groups": 8, **fields}, "unet")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"preset": "huge"}, "^preset: must be one of"),
        ({"block_out_channels": [16, 32, 64]}, "^down_block_types: has 2 entries but block_out_channels has 3 levels"),
        ({"block_out_channels": [12, 32]}, "^block_out_channels: 12 is not a positive multiple of norm_num_groups 8"),
        ({"attention_head_dim": [1, 3]}, "^attention_head_dim: 3 heads do not divide 32 channels"),
        ({"down_block_types": ["DownBlock2D", "AttnDownBlock2D"]}, "^down_block_types: unknown block 'AttnDownBlock2D'"),
        ({"in_channels": 0}, "^in_channels: must be a positive integer"),
        ({"transformer_layers_per_block": [1, 0]}, "^transformer_layers_per_block: must be positive"),
        ({"layers_per_block": "two"}, "^layers_per_block: expected"),
        ({"addition_embed_type": "image"}, "^addition_embed_type: expected .text., got .image."),
        ({"addition_embed_type": "text", "addition_embed_type_num_heads": 5},
         "^addition_embed_type_num_heads: 5 heads do not divide cross_attention_dim 384"),
        ({"addition_embed_type_num_heads": 8}, "^addition_embed_type_num_heads: set without addition_embed_type"),
    ],
)
def test_validation_names_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(UNetConfig, {"preset": "tiny", **overrides})


def test_pooled_text_conditioning_reaches_the_timestep_embedding_and_round_trips(tmp_path):
    # No cross-attention in the down/up blocks and the mid block's attention silenced: the caption
    # can only reach the output through the pooled embedding added to the timestep embedding.
    def build(**extra):
        torch.manual_seed(0)
        model = build_unet(from_dict(UNetConfig, {
            "preset": "tiny", "down_block_types": ["DownBlock2D", "DownBlock2D"],
            "up_block_types": ["UpBlock2D", "UpBlock2D"], **extra}))
        proj = model.mid_block.attentions[0].proj_out
        torch.nn.init.zeros_(proj.weight)
        torch.nn.init.zeros_(proj.bias)
        return model.eval()

    x, t = torch.randn(2, 4, 8, 8), torch.tensor([10, 600])
    a, b = torch.randn(2, 6, 384), torch.randn(2, 6, 384)
    with torch.no_grad():
        plain = build()
        assert torch.equal(plain(x, t, encoder_hidden_states=a).sample, plain(x, t, encoder_hidden_states=b).sample)
        pooled = build(addition_embed_type="text", addition_embed_type_num_heads=8)
        out_a = pooled(x, t, encoder_hidden_states=a).sample
        assert not torch.allclose(out_a, pooled(x, t, encoder_hidden_states=b).sample)
    # The pooling's cost in parameters: q/k/v over the 384-d states and a learned query offset, two
    # norms, one projection to the 64-d timestep embedding.
    extra = unet_num_params(UNetConfig(preset="tiny", addition_embed_type="text", addition_embed_type_num_heads=8)) \
        - unet_num_params(UNetConfig(preset="tiny"))
    assert extra == sum(p.numel() for p in pooled.add_embedding.parameters()) == 3 * 384 * 385 + 384 + 2 * 384 + 385 * 64 + 2 * 64
    pooled.save_pretrained(tmp_path / "unet")
    loaded = load_unet(str(tmp_path / "unet")).eval()
    assert loaded.config.addition_embed_type == "text" and loaded.config.addition_embed_type_num_heads == 8
    with torch.no_grad():
        assert torch.equal(loaded(x, t, encoder_hidden_states=a).sample, out_a)


def test_resolved_config_is_a_copy():
    cfg = UNetConfig(preset="tiny")
    unet_diffusers_config(cfg)["block_out_channels"].append(64)
    assert unet_diffusers_config(cfg)["block_out_channels"] == [16, 32]


def test_load_unet_round_trip_safetensors_only(tmp_path):
    torch.manual_seed(0)
    model = build_unet(UNetConfig(preset="tiny", in_channels=16, out_channels=16))
    model.save_pretrained(tmp_path / "good" / "unet")
    loaded = load_unet(str(tmp_path / "good"), subfolder="unet")
    assert loaded.config.in_channels == 16
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name

    model.save_pretrained(tmp_path / "pickled", safe_serialization=False)
    with pytest.raises(UserError, match="safetensors"):
        load_unet(str(tmp_path / "pickled"))
    with pytest.raises(UserError, match="^load_unet .*missing: no such directory"):
        load_unet(str(tmp_path / "missing"))
