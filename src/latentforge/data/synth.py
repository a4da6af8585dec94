"""A procedural captioned image dataset, so that everything runs offline and a small diffusion
model can visibly learn text conditioning on a CPU in minutes (``latentforge data synth``).

Each image is one flat-coloured shape on a gray background:

- shapes: circle, square, triangle, star, cross (a plus sign), diamond (taller than wide, so it
  is never a rotated square);
- colours: red, yellow, green, cyan, blue, purple (hues about 60 degrees apart; see
  :data:`COLORS` for the RGB values);
- sizes: small (diameter about 0.3 of the image side), large (about 0.44);
- positions: a 3x3 grid, "top left", "top", "top right", "left", "center", "right",
  "bottom left", "bottom", "bottom right";
- backgrounds: "light" (gray 170-225) or "dark" (gray 25-70), each with a random linear
  gradient (up to 30 levels) and faint noise (sigma up to 4 levels). Neutral gray is far from
  every shape colour, so colour stays identifiable at 32x32 px.

Shapes are drawn at 4x resolution and box-downsampled (exact area coverage), then blended over
the background, so the inside of a shape has exactly its nominal colour. Small jitter of position
(+-1.5% of the side), size (+-8%) and rotation (+-10 degrees) keeps images varied. Captions come
from several templates (:data:`TEMPLATES`), e.g. "a small red triangle in the top left",
"top left: red triangle, small", "a red triangle, small, in the top left corner"; with
``partial_captions`` that share of the training captions come from :data:`PARTIAL_TEMPLATES`,
which leave out the size, the position or both ("a red triangle on a dark background"); with
``extra_templates`` that share come from :data:`EXTRA_TEMPLATES`, six more that name everything in
other orders ("small triangle, red, in the top left corner").

Held out for testing generalisation (:data:`HELDOUT_COMBOS`, the default of
``SynthConfig.heldout``): red star, yellow circle, green triangle, cyan diamond, blue square,
purple cross. Each colour and each shape is held out exactly once, so every colour still appears
in training with five shapes and every shape with five colours; the training split has the other
30 combinations and the held-out split only these six.

Output (an ordinary image folder, so the normal ingest reads it)::

    OUT/train/000000.png + 000000.txt    caption in the .txt (no trailing newline)
    OUT/heldout/000000.png + 000000.txt  only held-out colour/shape combinations
    OUT/labels.jsonl   one line per image: {"file": "train/000000.png", "split": "train",
                       "shape", "color", "size", "position", "background", "caption"}
    OUT/synth.json     config, class lists, held-out combos, counts; written last, so a
                       directory without it is incomplete (synth.partial.json marks a run
                       in progress, and a rerun with the same config finishes it)

Deterministic: the same config (num, seed, ...) gives byte-identical files. All randomness comes
from numpy Generators seeded from ``(seed, split)`` and ``(seed, split, index)``; no global RNG.
Cost: about 1 ms per 64 px image on one CPU core.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

from latentforge import storage
from latentforge.config import to_dict, with_defaults
from latentforge.errors import ConfigError, UserError

__all__ = [
    "SHAPES",
    "COLORS",
    "SIZES",
    "POSITIONS",
    "BACKGROUNDS",
    "TEMPLATES",
    "PARTIAL_TEMPLATES",
    "EXTRA_TEMPLATES",
    "HELDOUT_COMBOS",
    "SynthConfig",
    "parse_combo",
    "placement",
    "render",
    "caption_for",
    "prompts_for_combos",
    "generate",
]

FORMAT = "latentforge-synth"
VERSION = 1
SUMMARY = "synth.json"  # completion marker, written last
PARTIAL = "synth.partial.json"  # config of a run in progress
LABELS = "labels.jsonl"
SPLITS = ("train", "heldout")

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "cross", "diamond")

# Hues about 60 degrees apart (0, 52, 128, 187, 227, 285), saturated, far from any gray.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "yellow": (240, 210, 30),
    "green": (40, 170, 60),
    "cyan": (40, 200, 220),
    "blue": (40, 80, 230),
    "purple": (170, 50, 210),
}

# Nominal shape diameter as a fraction of the image side.
SIZES: dict[str, float] = {"small": 0.3, "large": 0.44}

# Centre of each grid cell as (x, y) fractions of the side; 0.26/0.74 keep a large shape inside.
_GRID = (0.26, 0.5, 0.74)
POSITIONS: dict[str, tuple[float, float]] = {
    "top left": (_GRID[0], _GRID[0]),
    "top": (_GRID[1], _GRID[0]),
    "top right": (_GRID[2], _GRID[0]),
    "left": (_GRID[0], _GRID[1]),
    "center": (_GRID[1], _GRID[1]),
    "right": (_GRID[2], _GRID[1]),
    "bottom left": (_GRID[0], _GRID[2]),
    "bottom": (_GRID[1], _GRID[2]),
    "bottom right": (_GRID[2], _GRID[2]),
}

# Gray level range of each background tone (0-255).
BACKGROUNDS: dict[str, tuple[float, float]] = {"light": (170.0, 225.0), "dark": (25.0, 70.0)}

# {size} {color} {shape} {bg}; {where}: "in the top left" / "at the top" / "in the center";
# {where_long}: "in the top left corner" / "at the top edge" / "in the middle"; {pos}: "top left".
TEMPLATES: tuple[str, ...] = (
    "a {size} {color} {shape} {where}",
    "{pos}: {color} {shape}, {size}",
    "a {color} {shape}, {size}, {where_long}",
    "a {size} {color} {shape} on a {bg} background, {where}",
    "a picture of a {size} {color} {shape} {where_long}",
    "{where}, a {size} {color} {shape}",
)

# Captions that leave out the size, the position, or both (two templates each), for the share
# ``SynthConfig.partial_captions`` of the training captions: real captions name only some of what
# an image shows. Template ``len(TEMPLATES) + k`` of :func:`caption_for` is ``PARTIAL_TEMPLATES[k]``.
# None of them is a wording the evaluation prompts with (evaluate/alignment.py checks every one).
PARTIAL_TEMPLATES: tuple[str, ...] = (
    "a {color} {shape} {where}",
    "{where}, a {color} {shape}",
    "a {size} {color} {shape} on a {bg} background",
    "{color} {shape}, {size}",
    "a {color} {shape} on a {bg} background",
    "{bg} background, {color} {shape}",
)
# More templates that name everything, in other orders and phrasings (the shape before its colour,
# the place first, a sentence), for the share ``SynthConfig.extra_templates`` of the training
# captions. Template ``len(TEMPLATES) + len(PARTIAL_TEMPLATES) + k`` is ``EXTRA_TEMPLATES[k]``.
# None is a wording the evaluation prompts with (evaluate/alignment.py checks every one).
EXTRA_TEMPLATES: tuple[str, ...] = (
    "there is a {size} {color} {shape} {where}",
    "{size} {shape}, {color}, {where_long}",
    "a {shape} in {color}, {size}, {where}",
    "{bg} background: a {size} {color} {shape} {where_long}",
    "the {color} {shape} is {size} and sits {where}",
    "{pos}, {size}: one {color} {shape}",
)
_ALL_TEMPLATES = TEMPLATES + PARTIAL_TEMPLATES + EXTRA_TEMPLATES  # the index space of caption_for's ``template``

HELDOUT_COMBOS: tuple[tuple[str, str], ...] = (
    ("red", "star"),
    ("yellow", "circle"),
    ("green", "triangle"),
    ("cyan", "diamond"),
    ("blue", "square"),
    ("purple", "cross"),
)

_SUPERSAMPLE = 4  # shapes are drawn at 4x and box-downsampled: exact area anti-aliasing
_POS_JITTER = 0.015  # +- fraction of the side
_SIZE_JITTER = 0.08  # +- relative
_ROT_JITTER = 10.0  # +- degrees


def _star(points: int = 5, inner: float = 0.45) -> list[tuple[float, float]]:
    angles = -np.pi / 2 + np.arange(2 * points) * np.pi / points
    radii = np.where(np.arange(2 * points) % 2 == 0, 1.0, inner)
    return list(zip(radii * np.cos(angles), radii * np.sin(angles)))


def _circle(num_vertices: int = 48) -> list[tuple[float, float]]:
    angles = np.arange(num_vertices) * 2 * np.pi / num_vertices
    return list(zip(0.88 * np.cos(angles), 0.88 * np.sin(angles)))


def _triangle() -> list[tuple[float, float]]:
    # Equilateral, pointing up, moved down so its area centre sits at the position.
    angles = np.deg2rad([-90.0, 30.0, 150.0])
    return list(zip(np.cos(angles), np.sin(angles) + 0.12))


_ARM = 0.3  # half-width of the cross arms
# Outlines in unit coordinates (radius about 1, y down), scaled by half the diameter.
_OUTLINES: dict[str, list[tuple[float, float]]] = {
    "circle": _circle(),
    "square": [(-0.75, -0.75), (0.75, -0.75), (0.75, 0.75), (-0.75, 0.75)],
    "triangle": _triangle(),
    "star": _star(),
    "cross": [
        (-_ARM, -0.9), (_ARM, -0.9), (_ARM, -_ARM), (0.9, -_ARM), (0.9, _ARM), (_ARM, _ARM),
        (_ARM, 0.9), (-_ARM, 0.9), (-_ARM, _ARM), (-0.9, _ARM), (-0.9, -_ARM), (-_ARM, -_ARM),
    ],
    "diamond": [(0.0, -1.0), (0.7, 0.0), (0.0, 1.0), (-0.7, 0.0)],
}

_WHERE = {
    "top left": ("in the top left", "in the top left corner"),
    "top": ("at the top", "at the top edge"),
    "top right": ("in the top right", "in the top right corner"),
    "left": ("on the left", "on the left side"),
    "center": ("in the center", "in the middle"),
    "right": ("on the right", "on the right side"),
    "bottom left": ("in the bottom left", "in the bottom left corner"),
    "bottom": ("at the bottom", "at the bottom edge"),
    "bottom right": ("in the bottom right", "in the bottom right corner"),
}


def _check_names(name: str, values: Sequence[str], known: Sequence[str]) -> None:
    if not values:
        raise ConfigError(f"{name}: empty; list at least one of {', '.join(known)}")
    for v in values:
        if v not in known:
            raise ConfigError(f"{name}: unknown {v!r} (known: {', '.join(known)})")
    dup = sorted({v for v in values if list(values).count(v) > 1})
    if dup:
        raise ConfigError(f"{name}: {dup[0]!r} is listed twice")


def parse_combo(text: str) -> tuple[str, str]:
    """``"red star"`` -> ``("red", "star")``; raises ``ConfigError("heldout: ...")``."""
    parts = text.split()
    if len(parts) != 2 or parts[0] not in COLORS or parts[1] not in SHAPES:
        raise ConfigError(
            f"heldout: {text!r} is not '<colour> <shape>' (colours: {', '.join(COLORS)}; "
            f"shapes: {', '.join(SHAPES)})"
        )
    return parts[0], parts[1]


@dataclass
class SynthConfig:
    """What ``latentforge data synth`` generates (see the module docstring for the classes)."""

    num: int = field(default=2000, metadata={"help": "number of training images"})
    num_heldout: int = field(
        default=200, metadata={"help": "number of images of the held-out colour/shape combos (0: none)"}
    )
    seed: int = field(default=0, metadata={"help": "random seed; same config => byte-identical files"})
    image_size: int = field(default=64, metadata={"help": "side of the square images in pixels (>= 16)"})
    shapes: list[str] = field(
        default_factory=lambda: list(SHAPES), metadata={"help": f"shapes to draw, from: {', '.join(SHAPES)}"}
    )
    colors: list[str] = field(
        default_factory=lambda: list(COLORS), metadata={"help": f"colours to use, from: {', '.join(COLORS)}"}
    )
    sizes: list[str] = field(
        default_factory=lambda: list(SIZES), metadata={"help": f"sizes to use, from: {', '.join(SIZES)}"}
    )
    positions: list[str] = field(
        default_factory=lambda: list(POSITIONS),
        metadata={"help": f"grid positions to use, from: {', '.join(POSITIONS)}"},
    )
    partial_captions: float = field(
        default=0.0,
        metadata={
            "help": "share of the training captions that leave out the size, the position or both "
            "(PARTIAL_TEMPLATES, one of six at random); the labels keep every attribute and the "
            "held-out split keeps full captions. 0: every caption names everything"
        },
    )
    extra_templates: float = field(
        default=0.0,
        metadata={
            "help": "share of the training captions drawn from EXTRA_TEMPLATES (six more that name "
            "everything, in other orders and phrasings) instead of TEMPLATES; the held-out split keeps "
            "TEMPLATES. 0: the six TEMPLATES only (the demo lost new-wording prompts with 0.5, docs/demo.md run 31)"
        },
    )
    heldout: list[str] = field(
        default_factory=lambda: [f"{c} {s}" for c, s in HELDOUT_COMBOS],
        metadata={
            "help": "'<colour> <shape>' combos kept out of the training split and put only in the "
            "held-out split (every colour and shape must still appear in training)"
        },
    )

    def validate(self) -> None:
        if self.num < 1:
            raise ConfigError(f"num: must be at least 1, got {self.num}")
        if self.num_heldout < 0:
            raise ConfigError(f"num_heldout: must be 0 or more, got {self.num_heldout}")
        if self.seed < 0:
            raise ConfigError(f"seed: must be 0 or more, got {self.seed}")
        if not 0.0 <= self.partial_captions <= 1.0:
            raise ConfigError(f"partial_captions: must be a share in [0, 1], got {self.partial_captions}")
        if not 0.0 <= self.extra_templates <= 1.0:
            raise ConfigError(f"extra_templates: must be a share in [0, 1], got {self.extra_templates}")
        if self.partial_captions + self.extra_templates > 1.0:
            raise ConfigError(f"extra_templates: {self.extra_templates} with partial_captions {self.partial_captions}: "
                              "shares of one set of captions, together at most 1")
        if self.image_size < 16:
            raise ConfigError(
                f"image_size: must be at least 16 px (shapes are unreadable below), got {self.image_size}"
            )
        _check_names("shapes", self.shapes, SHAPES)
        _check_names("colors", self.colors, list(COLORS))
        _check_names("sizes", self.sizes, list(SIZES))
        _check_names("positions", self.positions, list(POSITIONS))
        combos = [parse_combo(t) for t in self.heldout]
        for text, (color, shape) in zip(self.heldout, combos):
            if color not in self.colors:
                raise ConfigError(f"heldout: {text!r} uses colour {color!r}, which is not in colors")
            if shape not in self.shapes:
                raise ConfigError(f"heldout: {text!r} uses shape {shape!r}, which is not in shapes")
            if combos.count((color, shape)) > 1:
                raise ConfigError(f"heldout: {text!r} is listed twice")
        held = set(combos)
        for color in self.colors:
            if all((color, s) in held for s in self.shapes):
                raise ConfigError(
                    f"heldout: holds out every shape in {color}, so training never sees {color}; "
                    f"remove one '{color} <shape>' combo"
                )
        for shape in self.shapes:
            if all((c, shape) in held for c in self.colors):
                raise ConfigError(
                    f"heldout: holds out {shape} in every colour, so training never sees a {shape}; "
                    f"remove one '<colour> {shape}' combo"
                )
        if self.num_heldout > 0 and not held:
            raise ConfigError(f"num_heldout: is {self.num_heldout} but heldout is empty; set num_heldout=0")

    def heldout_combos(self) -> list[tuple[str, str]]:
        return [parse_combo(t) for t in self.heldout]

    def train_combos(self) -> list[tuple[str, str]]:
        held = set(self.heldout_combos())
        return [(c, s) for c in self.colors for s in self.shapes if (c, s) not in held]


def _background(tone: str, image_size: int, rng: np.random.Generator) -> np.ndarray:
    """Gray level + linear gradient in a random direction + faint noise, float32 (H, W, 1)."""
    lo, hi = BACKGROUNDS[tone]
    level = rng.uniform(lo, hi)
    amplitude = rng.uniform(0.0, 30.0)  # gray levels across the image
    angle = rng.uniform(0.0, 2 * np.pi)
    sigma = rng.uniform(0.0, 4.0)
    t = (np.arange(image_size, dtype=np.float32) + 0.5) / image_size - 0.5
    ramp = np.cos(angle) * t[None, :] + np.sin(angle) * t[:, None]  # in [-0.71, 0.71]
    noise = rng.standard_normal((image_size, image_size), dtype=np.float32) * sigma
    return (level + amplitude * ramp + noise)[:, :, None].astype(np.float32)


def placement(size: str, position: str, side: int, rng: np.random.Generator) -> tuple[float, float, float, float]:
    """(centre x, centre y, radius, rotation in radians) of a shape on a canvas of ``side`` px, with
    the dataset's jitter of position, size and rotation (four draws from ``rng``, in that order)."""
    cx, cy = POSITIONS[position]
    cx = (cx + rng.uniform(-_POS_JITTER, _POS_JITTER)) * side
    cy = (cy + rng.uniform(-_POS_JITTER, _POS_JITTER)) * side
    radius = SIZES[size] / 2 * rng.uniform(1 - _SIZE_JITTER, 1 + _SIZE_JITTER) * side
    rot = np.deg2rad(rng.uniform(-_ROT_JITTER, _ROT_JITTER))
    return cx, cy, radius, rot


def _mask(shape: str, size: str, position: str, image_size: int, rng: np.random.Generator) -> np.ndarray:
    """Coverage of the shape per pixel in [0, 1], float32 (H, W, 1)."""
    side = image_size * _SUPERSAMPLE
    cx, cy, radius, rot = placement(size, position, side, rng)
    pts = np.asarray(_OUTLINES[shape], dtype=np.float64)
    c, s = np.cos(rot), np.sin(rot)
    pts = pts @ np.array([[c, s], [-s, c]]) * radius + (cx, cy)
    canvas = Image.new("L", (side, side), 0)
    ImageDraw.Draw(canvas).polygon([tuple(p) for p in pts], fill=255)
    small = canvas.reduce(_SUPERSAMPLE)  # box average = exact area coverage
    return (np.asarray(small, dtype=np.float32) / 255.0)[:, :, None]


def render(
    shape: str, color: str, size: str, position: str, background: str, image_size: int, rng: np.random.Generator
) -> Image.Image:
    """One RGB image: a ``color`` ``shape`` of ``size`` at ``position`` on a ``background`` tone.

    ``rng`` supplies the jitter (position, size, rotation) and the background's gray level,
    gradient and noise; the inside of the shape is exactly ``COLORS[color]``.
    """
    bg = _background(background, image_size, rng)
    alpha = _mask(shape, size, position, image_size, rng)
    rgb = np.asarray(COLORS[color], dtype=np.float32)
    out = bg * (1.0 - alpha) + rgb * alpha
    return Image.fromarray(np.clip(np.rint(out), 0, 255).astype(np.uint8), "RGB")


def caption_for(shape: str, color: str, size: str, position: str, background: str, template: int) -> str:
    """The caption of template ``template`` of ``TEMPLATES + PARTIAL_TEMPLATES + EXTRA_TEMPLATES`` for these attributes."""
    where, where_long = _WHERE[position]
    return _ALL_TEMPLATES[template].format(
        size=size, color=color, shape=shape, bg=background, where=where, where_long=where_long, pos=position
    )


def prompts_for_combos(
    combos: Sequence[tuple[str, str]], rng: np.random.Generator | int, num_per_combo: int = 1
) -> list[str]:
    """Captions for ``(color, shape)`` combos (e.g. :data:`HELDOUT_COMBOS`), ``num_per_combo``
    each in combo order, with random size, position, background and template."""
    rng = np.random.default_rng(rng) if isinstance(rng, int) else rng
    prompts = []
    for color, shape in combos:
        if color not in COLORS or shape not in SHAPES:
            raise UserError(f"combo {color!r} {shape!r}: unknown colour or shape")
        for _ in range(num_per_combo):
            prompts.append(
                caption_for(
                    shape,
                    color,
                    str(rng.choice(list(SIZES))),
                    str(rng.choice(list(POSITIONS))),
                    str(rng.choice(list(BACKGROUNDS))),
                    int(rng.integers(len(TEMPLATES))),
                )
            )
    return prompts


def _plan(cfg: SynthConfig, split: str) -> list[dict]:
    """Attributes of every image of ``split``; combos are tiled then shuffled, so each appears
    ``num // num_combos`` or one more times (all of them once ``num >= num_combos``)."""
    split_id = SPLITS.index(split)
    combos = cfg.train_combos() if split == "train" else cfg.heldout_combos()
    num = cfg.num if split == "train" else cfg.num_heldout
    rng = np.random.default_rng([cfg.seed, split_id])
    order = rng.permutation(np.resize(np.arange(len(combos)), num))
    sizes = rng.integers(len(cfg.sizes), size=num)
    positions = rng.integers(len(cfg.positions), size=num)
    tones = rng.integers(len(BACKGROUNDS), size=num)
    templates = rng.integers(len(TEMPLATES), size=num)
    if split == "train" and cfg.partial_captions > 0:
        # A stream of its own, so that the images, their attributes and the other captions are
        # those of partial_captions=0.
        sub = np.random.default_rng(np.random.SeedSequence([cfg.seed, split_id], spawn_key=(1,)))
        partial = sub.random(num) < cfg.partial_captions
        kinds = sub.integers(len(PARTIAL_TEMPLATES), size=num)
        templates = np.where(partial, len(TEMPLATES) + kinds, templates)
    if split == "train" and cfg.extra_templates > 0:
        # A stream of its own as well; a caption is partial or extra, never both (the shares add up).
        sub = np.random.default_rng(np.random.SeedSequence([cfg.seed, split_id], spawn_key=(2,)))
        u = sub.random(num)
        kinds = sub.integers(len(EXTRA_TEMPLATES), size=num)
        extra = (u < cfg.extra_templates) & (templates < len(TEMPLATES))
        templates = np.where(extra, len(TEMPLATES) + len(PARTIAL_TEMPLATES) + kinds, templates)
    tone_names = list(BACKGROUNDS)
    plan = []
    for i in range(num):
        color, shape = combos[order[i]]
        item = {
            "file": f"{split}/{i:06d}.png",
            "split": split,
            "shape": shape,
            "color": color,
            "size": cfg.sizes[sizes[i]],
            "position": cfg.positions[positions[i]],
            "background": tone_names[tones[i]],
        }
        item["caption"] = caption_for(
            shape, color, item["size"], item["position"], item["background"], int(templates[i])
        )
        item["render_seed"] = [cfg.seed, split_id, i]
        plan.append(item)
    return plan


def _write(path: Path, data: bytes) -> None:
    """Temp file + rename: a file under its final name is always whole. No fsync per file
    (thousands of small files); :func:`generate` syncs once before the completion marker."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _summary(cfg: SynthConfig) -> dict:
    return {
        "format": FORMAT,
        "version": VERSION,
        "config": to_dict(cfg),
        "shapes": list(cfg.shapes),
        "colors": {c: list(COLORS[c]) for c in cfg.colors},
        "sizes": list(cfg.sizes),
        "positions": list(cfg.positions),
        "backgrounds": list(BACKGROUNDS),
        "heldout_combos": [list(c) for c in cfg.heldout_combos()],
        "counts": {"train": cfg.num, "heldout": cfg.num_heldout},
        "labels": LABELS,
    }


def _json_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()


def _config_diff(old: dict, new: dict) -> str:
    for key in new:
        if old.get(key) != new[key]:
            return f"{key} {old.get(key)!r} there, {new[key]!r} now"
    return "a different config"


def _previous_config(out: Path) -> tuple[dict | None, bool]:
    """(config of an earlier synth run in ``out``, whether it completed), or (None, False)."""
    for name, complete in ((SUMMARY, True), (PARTIAL, False)):
        path = out / name
        if path.is_file():
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                raise UserError(f"{path}: unreadable; delete {out} or choose another --out") from None
            if isinstance(data, dict) and data.get("format") == FORMAT:
                return data.get("config"), complete
    return None, False


def _complete(out: Path, cfg: SynthConfig) -> bool:
    for split, num in (("train", cfg.num), ("heldout", cfg.num_heldout)):
        for i in range(num):
            stem = out / split / f"{i:06d}"
            if not stem.with_suffix(".png").is_file() or not stem.with_suffix(".txt").is_file():
                return False
    return (out / LABELS).is_file()


def generate(out_dir: str | Path, cfg: SynthConfig, progress: bool = True) -> dict:
    """Write the dataset of ``cfg`` into ``out_dir`` (see the module docstring) and return the
    summary written to ``synth.json``. A rerun with the same config returns at once when the
    output is complete and finishes it otherwise; any other non-empty directory is refused."""
    if storage.is_s3(str(out_dir)):
        raise UserError(f"{out_dir}: synth writes a local directory (ingest reads it from there)")
    cfg.validate()
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is not a directory; choose another --out")
    summary = _summary(cfg)
    wanted = json.loads(json.dumps(summary["config"]))  # tuples -> lists, as read back from JSON
    if out.is_dir() and any(out.iterdir()):
        previous, complete = _previous_config(out)
        if previous is None:
            raise UserError(f"{out}: not empty and not a synth output; choose an empty or new --out")
        # An option added since that run is absent from its config: its default is what that run did.
        previous = with_defaults(previous, json.loads(json.dumps(to_dict(SynthConfig()))))
        if previous != wanted:
            raise UserError(
                f"{out}: holds a synth dataset made with another config ({_config_diff(previous, wanted)}); "
                "choose another --out or delete it"
            )
        if complete and _complete(out, cfg):
            return json.loads((out / SUMMARY).read_text())
        (out / SUMMARY).unlink(missing_ok=True)  # files are missing: the marker is no longer true
    for split in SPLITS:
        (out / split).mkdir(parents=True, exist_ok=True)
        for stale in (out / split).glob(".*.tmp-*"):  # left by a killed run
            stale.unlink()
    storage.atomic_write_bytes(out / PARTIAL, _json_bytes({"format": FORMAT, "config": summary["config"]}))

    plans = {split: _plan(cfg, split) for split in SPLITS}
    lines = []
    with tqdm(total=cfg.num + cfg.num_heldout, disable=not progress, unit="img", desc="synth") as bar:
        for split in SPLITS:
            for item in plans[split]:
                rng = np.random.default_rng(item.pop("render_seed"))
                image = render(
                    item["shape"], item["color"], item["size"], item["position"], item["background"],
                    cfg.image_size, rng,
                )
                buf = io.BytesIO()
                image.save(buf, format="PNG")  # no timestamps in PIL's PNG: bytes depend on pixels only
                png = out / item["file"]
                _write(png, buf.getvalue())
                _write(png.with_suffix(".txt"), item["caption"].encode())
                lines.append(json.dumps(item))
                bar.update(1)
    _write(out / LABELS, ("\n".join(lines) + "\n").encode())
    os.sync()  # one flush of every image before the marker says the dataset is complete
    storage.atomic_write_bytes(out / SUMMARY, _json_bytes(summary))
    (out / PARTIAL).unlink()
    storage.fsync_dir(out)
    return summary

