"""Renders of what is *not* one of the built-in shapes, for the judge's rejection class.

A judge that only knows the six shapes calls every blob the shape it is closest to. These
renders teach it to say "none": ellipses, pentagons and hexagons, irregular blobs, lobed
"Y"/"X" shapes, rings, two shapes merged into one, broken shapes (a band or a wedge cut out),
and empty backgrounds. Two more kinds are in-set shapes whose *colour* is not one of the six
answers: a shape in two colours.

The style is the dataset's own (:mod:`latentforge.data.synth`): flat colour on the same light or
dark gradient backgrounds, drawn at 4x and box-downsampled (exact area anti-aliasing), the same
size and position grid and the same jitter. Deterministic: every image comes from a numpy
Generator seeded with ``(seed, index)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from latentforge.data.synth import (
    _OUTLINES,
    _SUPERSAMPLE,
    BACKGROUNDS,
    COLORS,
    POSITIONS,
    SIZES,
    _background,
    placement,
)

__all__ = ["NONSHAPE_KINDS", "NonShape", "render_nonshape", "nonshape_set"]

# kind -> share of the rejection set. "two-colour" keeps an in-set shape (its shape verdict
# stays the shape) but has no single colour; "empty" has neither a shape nor a colour.
NONSHAPE_KINDS: dict[str, float] = {
    "ellipse": 0.12,
    "pentagon": 0.1,
    "hexagon": 0.08,
    "blob": 0.16,
    "lobed": 0.14,
    "ring": 0.08,
    "merged": 0.1,
    "broken": 0.12,
    "two-colour": 0.06,
    "empty": 0.04,
}


@dataclass
class NonShape:
    """One render and what a judge should answer for it (None: no single right answer)."""

    image: Image.Image
    kind: str
    shape: str | None  # "none" for every kind but "two-colour" (its in-set shape) and None never
    color: str | None  # None: two colours or no shape
    size: str | None  # None where the extent is not one of the two sizes (merged, empty)
    position: str | None  # None where there is no single centre (merged, empty)


def _polygon(n: int, radius: float = 1.0, phase: float = -np.pi / 2) -> np.ndarray:
    a = phase + np.arange(n) * 2 * np.pi / n
    return np.stack([radius * np.cos(a), radius * np.sin(a)], 1)


def _radial(r_of_theta, num: int = 96) -> np.ndarray:
    a = np.arange(num) * 2 * np.pi / num
    r = r_of_theta(a)
    return np.stack([r * np.cos(a), r * np.sin(a)], 1)


def _place(pts: np.ndarray, cx: float, cy: float, radius: float, rot: float) -> list[tuple[float, float]]:
    c, s = np.cos(rot), np.sin(rot)
    return [tuple(p) for p in pts @ np.array([[c, s], [-s, c]]) * radius + (cx, cy)]


def _coverage(canvas: Image.Image) -> np.ndarray:
    return (np.asarray(canvas.reduce(_SUPERSAMPLE), dtype=np.float32) / 255.0)[:, :, None]


def _outline(kind: str, rng: np.random.Generator) -> np.ndarray:
    """Unit outline (radius about 1, y down) of a simple off-set kind."""
    if kind == "ellipse":  # clearly not round: minor/major 0.4-0.68
        return _radial(lambda a: np.ones_like(a)) * (0.95, 0.95 * rng.uniform(0.4, 0.68))
    if kind == "pentagon":
        return _polygon(5, 0.92, rng.uniform(0, 2 * np.pi))
    if kind == "hexagon":
        return _polygon(6, 0.95, rng.uniform(0, 2 * np.pi))
    if kind == "blob":  # a wobbly closed curve: low harmonics with random phases
        ks = np.arange(2, 6)
        amp = rng.uniform(0.08, 0.28, len(ks)) / np.sqrt(ks - 1)
        ph = rng.uniform(0, 2 * np.pi, len(ks))
        return _radial(lambda a: 0.8 + sum(m * np.cos(k * a + p) for k, m, p in zip(ks, amp, ph)))
    if kind == "lobed":  # rounded lobes with concave gaps: the "Y" triangles and "X" squares of a weak model
        k = int(rng.choice([3, 4, 5]))
        # five lobes only shallow (a pentagon with bumps): deep ones would be a star with round tips
        depth = rng.uniform(0.12, 0.28) if k == 5 else rng.uniform(0.35, 0.55)
        ph = np.pi / 4 if k == 4 else rng.uniform(0, 2 * np.pi)  # a 4-lobed blob as an X, never a plus
        return _radial(lambda a: 1.0 - depth * np.abs(np.sin(k * (a - ph) / 2)) ** 1.5)
    raise ValueError(f"unknown outline kind {kind!r}")


def render_nonshape(kind: str, color: str, size: str, position: str, background: str, image_size: int,
                    rng: np.random.Generator) -> NonShape:
    """One image of ``kind`` (a key of :data:`NONSHAPE_KINDS`) in the dataset's style."""
    side = image_size * _SUPERSAMPLE
    bg = _background(background, image_size, rng)
    cx, cy, radius, rot = placement(size, position, side, rng)
    rgb = np.asarray(COLORS[color], dtype=np.float32)
    canvas = Image.new("L", (side, side), 0)
    draw = ImageDraw.Draw(canvas)
    shape, label_color, label_size, label_pos = "none", color, size, position
    if kind in ("ellipse", "pentagon", "hexagon", "blob", "lobed"):
        pts = _outline(kind, rng)
        draw.polygon(_place(pts, cx, cy, radius, rng.uniform(0, 2 * np.pi) if kind == "ellipse" else rot), fill=255)
    elif kind == "ring":
        draw.polygon(_place(_radial(lambda a: np.full_like(a, 0.9)), cx, cy, radius, 0.0), fill=255)
        draw.polygon(_place(_radial(lambda a: np.full_like(a, rng.uniform(0.45, 0.6))), cx, cy, radius, 0.0), fill=0)
    elif kind == "merged":  # two in-set shapes overlapping (their union is no shape of the set)
        names = list(_OUTLINES)
        a = rng.uniform(0, 2 * np.pi)
        off = rng.uniform(0.3, 0.6) * radius
        for sign in (-1, 1):
            pts = np.asarray(_OUTLINES[str(rng.choice(names))])
            draw.polygon(_place(pts, cx + sign * off * np.cos(a), cy + sign * off * np.sin(a),
                                radius * rng.uniform(0.7, 0.9), rot), fill=255)
        label_size = label_pos = None
    elif kind == "broken":  # an in-set shape with a band or a wedge cut out of it
        draw.polygon(_place(np.asarray(_OUTLINES[str(rng.choice(list(_OUTLINES)))]), cx, cy, radius, rot), fill=255)
        a = rng.uniform(0, 2 * np.pi)
        if rng.random() < 0.5:
            half = rng.uniform(0.13, 0.22) * radius * 2 / 2
            d = rng.uniform(-0.25, 0.25) * radius
            n, t = np.array([np.cos(a), np.sin(a)]), np.array([-np.sin(a), np.cos(a)])
            c0 = np.array([cx, cy]) + d * n
            band = [c0 + (s1 * half) * n + (s2 * 2 * radius) * t for s1, s2 in ((-1, -1), (1, -1), (1, 1), (-1, 1))]
            draw.polygon([tuple(p) for p in band], fill=0)
        else:
            w = np.deg2rad(rng.uniform(70, 120))
            arc = np.linspace(a - w / 2, a + w / 2, 16)
            wedge = [(cx, cy)] + [(cx + 2 * radius * np.cos(t), cy + 2 * radius * np.sin(t)) for t in arc]
            draw.polygon(wedge, fill=0)
    elif kind == "two-colour":  # an in-set shape, half in another colour
        shape = str(rng.choice(list(_OUTLINES)))
        draw.polygon(_place(np.asarray(_OUTLINES[shape]), cx, cy, radius, rot), fill=255)
        alpha = _coverage(canvas)
        other = str(rng.choice([c for c in COLORS if c != color]))
        a = rng.uniform(0, 2 * np.pi)
        yy, xx = (np.mgrid[0:image_size, 0:image_size] + 0.5) * _SUPERSAMPLE
        half = ((xx - cx) * np.cos(a) + (yy - cy) * np.sin(a) > 0)[:, :, None]
        fill = np.where(half, np.asarray(COLORS[other], dtype=np.float32), rgb)
        out = bg * (1.0 - alpha) + fill * alpha
        return NonShape(_to_image(out), kind, shape, None, size, position)
    elif kind == "empty":
        return NonShape(_to_image(bg), kind, "none", None, None, None)
    else:
        raise ValueError(f"unknown non-shape kind {kind!r} (known: {', '.join(NONSHAPE_KINDS)})")
    alpha = _coverage(canvas)
    out = bg * (1.0 - alpha) + rgb * alpha
    return NonShape(_to_image(out), kind, shape, label_color, label_size, label_pos)


def _to_image(arr: np.ndarray) -> Image.Image:
    return Image.fromarray(np.clip(np.rint(np.broadcast_to(arr, arr.shape[:2] + (3,))), 0, 255).astype(np.uint8), "RGB")


def nonshape_set(num: int, seed: int, image_size: int) -> list[NonShape]:
    """``num`` renders, kinds in the proportions of :data:`NONSHAPE_KINDS`, attributes uniform."""
    kinds = list(NONSHAPE_KINDS)
    p = np.asarray(list(NONSHAPE_KINDS.values()))
    plan = np.random.default_rng([seed, 0]).choice(len(kinds), size=num, p=p / p.sum())
    out = []
    for i, k in enumerate(plan):
        rng = np.random.default_rng([seed, 1, i])
        color = str(rng.choice(list(COLORS)))
        size = str(rng.choice(list(SIZES)))
        position = str(rng.choice(list(POSITIONS)))
        background = str(rng.choice(list(BACKGROUNDS)))
        out.append(render_nonshape(kinds[k], color, size, position, background, image_size, rng))
    return out
