"""The U-Net that the benchmarks' recorded figures were measured on (docs/benchmarks.md).

Until run 14 (docs/demo.md) the tiny-cpu recipe trained a [32, 64, 128] U-Net (4.6M parameters);
since then it trains [16, 32, 64] (1.3M). The benchmarks that time "the demo's U-Net" keep the
model their figures were recorded with, so that a rerun measures the same thing.
"""

RUN13_UNET = [
    "train.unet.block_out_channels=[32,64,128]",
    "train.unet.attention_head_dim=[1,2,4]",
    "train.unet.norm_num_groups=16",
]
