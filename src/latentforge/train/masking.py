"""Patch masking of the diffusion transformer during training (MaskDiT, MicroDiT).

A masked training step embeds every latent patch (patch embedding + position embedding), keeps a
random ``round((1 - ratio) * N)`` of the N patch tokens of each sample, runs the transformer
blocks on the kept tokens only and takes the loss on the kept patches only (Zheng et al. 2023,
"Fast Training of Diffusion Models with Masked Transformers" (MaskDiT), arXiv:2306.09305, sec. 3:
the denoising loss on the visible patches). With ``mixer_blocks`` = m > 0 the first m blocks see
every token and the masking happens after them (Sehwag et al. 2024, "Stretching Each Dollar:
Diffusion Training from Scratch on a Micro-Budget" (MicroDiT), arXiv:2407.15811, sec. 3.2:
deferred masking behind a patch-mixer). Sampling, inference and export never mask: the weights
are those of the plain transformer.

Which tokens a sample keeps is a pure function of (train.seed, the sample's global position),
like its diffusion noise (``trainer.sample_noise``, docs/decisions.md §4): a resumed run, or a run
on another number of ranks, draws the same masks, and no generator state needs checkpointing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from latentforge.data.order import hash64
from latentforge.errors import ConfigError, Problems

__all__ = ["MaskingConfig", "num_kept_tokens", "sample_keep", "check_kept_tokens"]

# Mixed into the (seed, position) key so that the mask draws are a stream apart from the noise draws.
_MASK_STREAM = 0x6D61736B  # "mask"


@dataclass
class MaskingConfig:
    """Patch masking of the transformer's training steps (``train.model: dit`` only)."""

    ratio: float = field(default=0.0, metadata={
        "help": "fraction of the latent patches dropped in each training sample, 0 <= ratio < 1 (0 = off; "
                "MicroDiT 0.75, MaskDiT 0.5); a phase's masking_ratio overrides it. Sampling never masks"})
    mixer_blocks: int = field(default=0, metadata={
        "help": "the first transformer blocks that see every patch before the masking (MicroDiT's patch-mixer); "
                "0 = mask right after the patch embedding (MaskDiT)"})

    def validate(self) -> None:
        problems = Problems()
        if not 0 <= self.ratio < 1:
            problems.add(f"ratio: must be >= 0 and < 1, got {self.ratio}; the fraction of patches dropped (0 = off, "
                         "0.75 as MicroDiT)")
        if self.mixer_blocks < 0:
            problems.add(f"mixer_blocks: must be >= 0, got {self.mixer_blocks}; 0 = mask right after the patch "
                         "embedding")
        problems.raise_if_any()


def num_kept_tokens(num_tokens: int, ratio: float) -> int:
    """round((1 - ratio) * num_tokens), halves rounded up: the tokens each masked sample keeps."""
    return int(np.floor((1.0 - ratio) * num_tokens + 0.5))


def check_kept_tokens(num_tokens: int, ratio: float, where: str, field_path: str) -> None:
    """Refuse a ratio that keeps no token of ``num_tokens`` (``where``: what the size is, for the message)."""
    if ratio > 0 and num_kept_tokens(num_tokens, ratio) < 1:
        raise ConfigError(f"{field_path}: {ratio} keeps no patch of the {num_tokens} of the {where}; lower it "
                          f"(at most {1 - 0.5 / num_tokens:.4g} keeps one)")


def sample_keep(seed: int, positions: list[int], num_tokens: int, num_keep: int) -> torch.Tensor:
    """The kept token indices (batch, num_keep), int64, ascending, for the samples at global
    ``positions``: each row is the first ``num_keep`` of a uniformly random permutation of
    0 .. num_tokens - 1, drawn from a CPU generator seeded by hash(seed, position, mask stream)."""
    if not 1 <= num_keep <= num_tokens:
        raise ValueError(f"num_keep: {num_keep} outside 1 .. {num_tokens}")
    keys = hash64(np.uint64(seed), np.asarray(positions, dtype=np.int64), np.uint64(_MASK_STREAM))
    rows = []
    for key in keys.tolist():
        g = torch.Generator().manual_seed(int(key) & 0x7FFF_FFFF_FFFF_FFFF)
        rows.append(torch.randperm(num_tokens, generator=g)[:num_keep].sort().values)
    return torch.stack(rows) if rows else torch.empty((0, num_keep), dtype=torch.int64)
