"""Prompt alignment on the built-in dataset: a small judge classifier of colour and shape.

The judge is a small CNN trained on real images of the built-in dataset (both splits: it is an
instrument, not part of the generative model, and seeing every combination keeps it unbiased on
the held-out ones). Generated images for a prompt naming (colour, shape) count as aligned when the
judge predicts that colour, that shape, or both. Its own accuracy on freshly rendered real images
(another seed) is reported beside, so a weak judge cannot pass for a good model.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from latentforge.data.synth import COLORS, SHAPES
from latentforge.errors import UserError


@dataclass
class JudgeConfig:
    epochs: int = field(default=6, metadata={"help": "passes over the real images"})
    batch_size: int = field(default=64, metadata={"help": "images per step"})
    lr: float = field(default=3e-3, metadata={"help": "AdamW learning rate"})
    blur_prob: float = field(default=0.5, metadata={"help": "share of training images blurred, like decoded samples"})
    seed: int = field(default=0, metadata={"help": "initialisation and augmentation seed"})


class Judge(nn.Module):
    """Colour and shape heads on a 4-conv trunk (about 0.1M parameters)."""

    def __init__(self, num_colors: int, num_shapes: int, width: int = 32):
        super().__init__()
        c = width
        self.trunk = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.ReLU(),
            nn.AdaptiveMaxPool2d(1), nn.Flatten(),
        )
        self.color = nn.Linear(2 * c, num_colors)
        self.shape = nn.Linear(2 * c, num_shapes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.color(h), self.shape(h)


def to_tensor(images: Sequence[Image.Image], size: int) -> torch.Tensor:
    arr = np.stack([np.asarray(im.convert("RGB").resize((size, size), Image.Resampling.LANCZOS)) for im in images])
    return torch.from_numpy(arr).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def load_labelled(synth_dir: Path, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str], list[str]]:
    """Real images of a ``data synth`` output (both splits) with their colour and shape labels."""
    labels_file = synth_dir / "labels.jsonl"
    if not labels_file.exists():
        raise UserError(f"{synth_dir}: no labels.jsonl (not a `latentforge data synth` output)")
    rows = [json.loads(line) for line in labels_file.read_text().splitlines() if line]
    info = json.loads((synth_dir / "synth.json").read_text())
    colors, shapes = list(info["config"]["colors"]), list(info["config"]["shapes"])
    images = [Image.open(synth_dir / r["file"]) for r in rows]
    x = to_tensor(images, size)
    yc = torch.tensor([colors.index(r["color"]) for r in rows])
    ys = torch.tensor([shapes.index(r["shape"]) for r in rows])
    return x, yc, ys, colors, shapes


def _augment(x: torch.Tensor, blur_prob: float, g: torch.Generator) -> torch.Tensor:
    """Blur a share of the batch (decoded samples are softer than renders) and add mild noise."""
    blur = torch.rand(len(x), generator=g) < blur_prob
    if blur.any():
        k = torch.tensor([1.0, 2.0, 1.0])
        k = (k[:, None] * k[None, :]) / 16
        w = k.expand(3, 1, 3, 3).contiguous()
        x = x.clone()
        x[blur] = F.conv2d(F.pad(x[blur], (1, 1, 1, 1), mode="replicate"), w, groups=3)
    return x + 0.03 * torch.randn(x.shape, generator=g)


def train_judge(x: torch.Tensor, yc: torch.Tensor, ys: torch.Tensor, num_colors: int, num_shapes: int,
                cfg: JudgeConfig) -> Judge:
    g = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = Judge(num_colors, num_shapes)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    n = len(x)
    for _ in range(cfg.epochs):
        perm = torch.randperm(n, generator=g)
        for i in range(0, n, cfg.batch_size):
            idx = perm[i:i + cfg.batch_size]
            lc, ls = model(_augment(x[idx], cfg.blur_prob, g))
            loss = F.cross_entropy(lc, yc[idx]) + F.cross_entropy(ls, ys[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return model.eval()


@torch.no_grad()
def predict(model: Judge, x: torch.Tensor, batch: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    cs, ss = [], []
    for i in range(0, len(x), batch):
        lc, ls = model(x[i:i + batch])
        cs.append(lc.argmax(1))
        ss.append(ls.argmax(1))
    return torch.cat(cs), torch.cat(ss)


def accuracy(model: Judge, x: torch.Tensor, yc: torch.Tensor, ys: torch.Tensor) -> dict[str, float]:
    pc, ps = predict(model, x)
    color, shape = pc == yc, ps == ys
    return {"color": float(color.float().mean()), "shape": float(shape.float().mean()),
            "both": float((color & shape).float().mean()), "num": len(x)}


def chance(num_colors: int, num_shapes: int) -> dict[str, float]:
    return {"color": 1 / num_colors, "shape": 1 / num_shapes, "both": 1 / (num_colors * num_shapes)}


def build_judge(train_dirs: Sequence[Path], check_dir: Path, size: int, cfg: JudgeConfig) -> tuple[Judge, dict]:
    """Train on the real images of the ``data synth`` outputs ``train_dirs``; measure on those of
    ``check_dir`` (renders with another seed)."""
    t0 = time.perf_counter()
    parts = [load_labelled(Path(d), size) for d in train_dirs]
    colors, shapes = parts[0][3], parts[0][4]
    x = torch.cat([p[0] for p in parts])
    yc = torch.cat([p[1] for p in parts])
    ys = torch.cat([p[2] for p in parts])
    model = train_judge(x, yc, ys, len(colors), len(shapes), cfg)
    cx, cyc, cys, c_colors, c_shapes = load_labelled(Path(check_dir), size)
    if (c_colors, c_shapes) != (colors, shapes):
        raise UserError(f"{check_dir}: other colour/shape classes than the judge's training images")
    report = {"real_accuracy": accuracy(model, cx, cyc, cys), "train_images": len(x),
              "seconds": round(time.perf_counter() - t0, 1), "colors": colors, "shapes": shapes}
    return model, report


def judge_images(model: Judge, images: Sequence[Image.Image], combos: Sequence[tuple[str, str]],
                 colors: list[str], shapes: list[str], size: int) -> dict[str, float]:
    """Alignment of ``images[i]`` with the (colour, shape) of ``combos[i]``."""
    x = to_tensor(images, size)
    yc = torch.tensor([colors.index(c) for c, _ in combos])
    ys = torch.tensor([shapes.index(s) for _, s in combos])
    return accuracy(model, x, yc, ys)


__all__ = ["COLORS", "SHAPES", "Judge", "JudgeConfig", "build_judge", "judge_images", "chance", "accuracy"]
