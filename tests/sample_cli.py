"""``latentforge sample`` through the CLI and its PNGs read back: the images a user gets from it."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image

from latentforge.cli import main


def read_samples(out: str | Path, num: int) -> np.ndarray:
    """The first ``num`` images that ``latentforge sample`` wrote to ``out`` (0000.png, ...) as
    (num, H, W, 3) floats in [0, 1]."""
    return np.stack([np.asarray(Image.open(Path(out) / f"{i:04d}.png").convert("RGB")) for i in range(num)]) / 255.0


def sample_cli(run: str | Path, out: str | Path, prompts: Sequence[str], seed: int, steps: int, cfg: float,
               *extra: str) -> np.ndarray:
    """``latentforge sample`` of ``run`` for ``prompts`` (one image each; ``extra``: more CLI
    arguments, e.g. ``--sampler euler``) -> its images, as :func:`read_samples` returns them."""
    args = ["sample", "--checkpoint", str(run), "--out", str(out), "--cfg", str(cfg), "--steps", str(steps),
            "--seed", str(seed), *extra]
    for p in prompts:
        args += ["--prompt", p]
    assert main(args) == 0
    return read_samples(out, len(prompts))
