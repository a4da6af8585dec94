"""Renders of what is *not* one of the built-in shapes, for the judge's rejection class.

A judge that only knows the six shapes calls every blob the shape it is closest to. These
renders teach it to say "none": ellipses, pentagons and hexagons, irregular blobs, lobed
"Y"/"X" shapes, rings, two shapes merged into one, broken shapes (a band or a wedge cut out),
and empty backgrounds; and the near-misses of a denoiser that almost draws a shape: keyholes
(a shape with a bar stuck to it), shapes stretched to another aspect, shields (half square, half
circle), arrowheads (a triangle with a notched base or bent-in sides), in-set shapes warped by
a strong low-frequency wobble, shapes halfway between two shapes of the set (a square with round
corners, a star with stubby points), and two separate shapes in one image. Three kinds are about the
*colour*: a shape in two colours (its shape stays the answer), a blob in two colours, and a
shape or blob in gray or brown (no colour of the six).

The style is the dataset's own (:mod:`latentforge.data.synth`): flat colour on the same light or
dark gradient backgrounds, drawn at 4x and box-downsampled (exact area anti-aliasing), the same
size and position grid and the same jitter. Deterministic: every image comes from a numpy
Generator seeded with ``(seed, index)``.

Two more sets serve the judge. :data:`EXTRA_NONSHAPE_KINDS` are drawn only when asked (a concave
four-pointed star, an upright egg). :func:`resized_set` renders the six shapes of the set at widths
between or beyond the dataset's two sizes: their shape, colour and position are the answers and
their size is none, or when asked the size a person reads from the width. A denoiser draws such
shapes for prompts that name no size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

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

__all__ = ["EXTRA_NONSHAPE_KINDS", "NONSHAPE_KINDS", "NonShape", "nonshape_set", "render_nonshape", "render_resized",
           "resized_set", "size_of_width"]

# kind -> share of the rejection set (normalised when drawn). "two-colour" keeps an in-set shape
# (its shape verdict stays the shape) but has no single colour, "dull" (gray or brown) keeps its
# outline's shape when that is an in-set one; "empty" has neither a shape nor a colour.
NONSHAPE_KINDS: dict[str, float] = {
    "ellipse": 0.08,
    "pentagon": 0.07,
    "hexagon": 0.06,
    "blob": 0.1,
    "lobed": 0.1,
    "ring": 0.05,
    "merged": 0.06,
    "broken": 0.08,
    "keyhole": 0.1,
    "stretched": 0.07,
    "shield": 0.06,
    "arrowhead": 0.07,
    "warped": 0.08,
    "morph": 0.1,
    "pair": 0.05,
    "two-colour": 0.05,
    "two-colour-blob": 0.05,
    "dull": 0.05,
    "empty": 0.03,
}
# Kinds a judge draws only when asked (``nonshape_set(..., extra=...)``), with their share: the near-misses
# of small crosses and diamonds that a person rejects -- a four-pointed sparkle (a plus whose arms taper to
# points, its sides concave) and an egg (an upright oval, one end blunter than the other).
EXTRA_NONSHAPE_KINDS: dict[str, float] = {"sparkle": 0.08, "egg": 0.08}
# The outlines a two-colour blob or a dull render is drawn with (the in-set ones keep their shape label).
_BLOB_KINDS = ("blob", "lobed", "ellipse", "keyhole", "shield", "arrowhead", "morph")


@dataclass
class NonShape:
    """One render and what a judge should answer for it (None: no single right answer)."""

    image: Image.Image
    kind: str
    shape: str  # "none", or the in-set shape of a "two-colour" render or of a "dull" one drawn with it
    color: str | None  # None: two colours, gray or brown, or no shape
    size: str | None  # None where the extent is not one of the two sizes (merged, pair, empty)
    position: str | None  # None where there is no single centre (merged, pair, empty)


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
    if kind == "sparkle":  # four points up, down, left and right; the sides between them straight and concave
        inner = rng.uniform(0.35, 0.55)
        a = np.arange(8) * np.pi / 4 - np.pi / 2
        r = np.where(np.arange(8) % 2 == 0, 0.95, inner)
        return np.stack([r * np.cos(a), r * np.sin(a)], 1)
    if kind == "egg":  # upright, 0.55-0.8 as wide as tall, one end blunter (y down: e > 0 widens the bottom)
        w, e = rng.uniform(0.55, 0.8), rng.uniform(0.1, 0.3) * rng.choice([-1.0, 1.0])
        a = np.arange(96) * 2 * np.pi / 96
        y = np.sin(a)
        return np.stack([w * np.cos(a) * (1 + e * y), y], 1)
    if kind == "shield":  # half square, half circle (a "D", a tombstone), in any of four orientations
        a = np.arange(48) * np.pi / 47 - np.pi / 2  # the round half: x >= 0
        half = np.stack([0.8 * np.cos(a), 0.8 * np.sin(a)], 1)
        pts = np.concatenate([half, [(-0.8, 0.8), (-0.8, -0.8)]])
        turn = int(rng.integers(4)) * np.pi / 2
        return pts @ np.array([[np.cos(turn), np.sin(turn)], [-np.sin(turn), np.cos(turn)]])
    if kind == "arrowhead":  # an upward triangle with a notched base or with its sides bent in
        t = np.linspace(0, 1, 17)[:-1, None]
        corners = np.asarray(_OUTLINES["triangle"])
        if rng.random() < 0.5:
            notch = rng.uniform(0.35, 0.75)
            return np.array([corners[0], corners[1], (0.0, corners[1][1] - notch), corners[2]])
        depth = rng.uniform(0.18, 0.3)
        pts = []
        for i in range(3):
            p, q = corners[i], corners[(i + 1) % 3]
            edge = p + t * (q - p)
            inward = -(edge - corners.mean(0))
            inward /= np.linalg.norm(inward, axis=1, keepdims=True)
            pts.append(edge + inward * depth * 4 * t * (1 - t))
        return np.concatenate(pts)
    if kind == "warped":  # a square, triangle or diamond with a strong low-frequency wobble of its outline
        base = np.asarray(_OUTLINES[str(rng.choice(["square", "triangle", "diamond"]))])
        dense = np.concatenate([p + np.linspace(0, 1, 24, endpoint=False)[:, None] * (q - p)
                                for p, q in zip(base, np.roll(base, -1, 0))])
        ang = np.arctan2(dense[:, 1], dense[:, 0])
        ks = np.arange(2, 5)
        amp = rng.uniform(0.12, 0.25, len(ks))
        ph = rng.uniform(0, 2 * np.pi, len(ks))
        return dense * (1 + sum(m * np.cos(k * ang + p) for k, m, p in zip(ks, amp, ph)))[:, None]
    raise ValueError(f"unknown outline kind {kind!r}")


def _radius_along(pts: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """Distance from the origin to a closed outline (origin inside, star-shaped) along each angle."""
    d = np.stack([np.cos(angles), np.sin(angles)], 1)[:, None, :]  # (A, 1, 2)
    p, q = pts[None], np.roll(pts, -1, 0)[None]  # edges p -> q, (1, E, 2)
    e = q - p
    cross = lambda a, b: a[..., 0] * b[..., 1] - a[..., 1] * b[..., 0]
    den = cross(d, e)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = cross(p, e) / den  # along the ray
        u = cross(p, d) / den  # along the edge
    ok = (np.abs(den) > 1e-12) & (t > 0) & (u >= -1e-9) & (u <= 1 + 1e-9)
    return np.where(ok, t, np.inf).min(1)


def _morph(rng: np.random.Generator, pair: tuple[str, str] | None = None) -> np.ndarray:
    """An outline halfway between two shapes of the set (radii mixed 40-60%): neither of them. The two
    are drawn at random unless ``pair`` names them."""
    a, b = pair if pair is not None else rng.choice(list(_OUTLINES), size=2, replace=False)
    angles = np.arange(144) * 2 * np.pi / 144
    t = rng.uniform(0.4, 0.6)
    r = (1 - t) * _radius_along(np.asarray(_OUTLINES[str(a)]), angles) + t * _radius_along(
        np.asarray(_OUTLINES[str(b)]), angles)
    return np.stack([r * np.cos(angles), r * np.sin(angles)], 1)


def _bbox_centred(parts: list[np.ndarray]) -> list[np.ndarray]:
    """Shift unit outlines so that the box around all of them is centred at the origin (the
    position of a composite shape is the centre of its region, as a person reads it)."""
    allp = np.concatenate(parts)
    mid = (allp.min(0) + allp.max(0)) / 2
    return [p - mid for p in parts]


def _parts(kind: str, rng: np.random.Generator, morph_pair: tuple[str, str] | None = None) -> list[np.ndarray]:
    """The filled unit outlines of a kind (their union is the shape), centred on their box."""
    if kind == "keyhole":  # a head (an in-set shape, small) with a bar stuck to one side of it
        head = np.asarray(_OUTLINES[str(rng.choice(["diamond", "circle", "triangle", "square"]))]) * rng.uniform(0.5, 0.65)
        w, length = rng.uniform(0.18, 0.3), rng.uniform(0.7, 1.1)
        bar = np.array([(-w, 0.0), (w, 0.0), (w, length), (-w, length)])
        turn = np.pi if rng.random() < 0.3 else 0.0  # mostly the bar below: the keyholes a weak model draws
        rot = np.array([[np.cos(turn), np.sin(turn)], [-np.sin(turn), np.cos(turn)]])
        parts = [head @ rot, bar @ rot]
        if rng.random() < 0.4:  # side bumps on the bar: an arrow with arms
            y, arm = rng.uniform(0.2, 0.6) * length, rng.uniform(0.3, 0.5)
            parts.append(np.array([(-arm, y - w), (arm, y - w), (arm, y + w), (-arm, y + w)]) @ rot)
        parts = _bbox_centred(parts)
        scale = 1.0 / max(float(np.abs(np.concatenate(parts)).max()), 1e-6)  # its long side about the diameter
        return [p * scale for p in parts]
    if kind == "morph":
        return [_morph(rng, morph_pair)]
    if kind == "stretched":  # an in-set shape squeezed across to 0.4-0.6 of its width: no shape of the set
        pts = np.asarray(_OUTLINES[str(rng.choice(["circle", "square", "diamond", "triangle"]))])
        squeeze = rng.uniform(0.4, 0.6)
        if rng.random() < 0.25:  # wide instead of tall
            return [pts * (1.0, squeeze) / 1.0]
        return [pts * (squeeze, 1.0)]
    return [_outline(kind, rng)]


def render_nonshape(kind: str, color: str, size: str, position: str, background: str, image_size: int,
                    rng: np.random.Generator, morph_pair: tuple[str, str] | None = None) -> NonShape:
    """One image of ``kind`` (a key of :data:`NONSHAPE_KINDS`) in the dataset's style; a "morph" is
    halfway between the two shapes of ``morph_pair`` when given (two drawn at random otherwise)."""
    if morph_pair is not None and (kind != "morph" or any(n not in _OUTLINES for n in morph_pair)):
        raise ValueError(f"morph_pair: two shapes of the set for kind 'morph', got {morph_pair!r} for {kind!r}")
    side = image_size * _SUPERSAMPLE
    bg = _background(background, image_size, rng)
    cx, cy, radius, rot = placement(size, position, side, rng)
    rgb = np.asarray(COLORS[color], dtype=np.float32)
    canvas = Image.new("L", (side, side), 0)
    draw = ImageDraw.Draw(canvas)
    shape, label_color, label_size, label_pos = "none", color, size, position
    if kind in ("ellipse", "pentagon", "hexagon", "blob", "lobed", "keyhole", "stretched", "shield", "arrowhead",
                "warped", "morph", "sparkle", "egg"):
        for pts in _parts(kind, rng, morph_pair):
            draw.polygon(_place(pts, cx, cy, radius, rng.uniform(0, 2 * np.pi) if kind == "ellipse" else rot),
                         fill=255)
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
    elif kind == "pair":  # two separate shapes or blobs, alike in size or not: no single region
        a = rng.uniform(0, 2 * np.pi)
        scales = rng.uniform(0.3, 0.7, 2)
        apart = (scales.sum() + rng.uniform(0.3, 0.9)) * radius  # centre to centre: a gap between them
        for sign, scale in zip((-1, 1), scales):
            name = str(rng.choice([*list(_OUTLINES), "blob"]))
            pts = _outline("blob", rng) if name == "blob" else np.asarray(_OUTLINES[name])
            d = apart * scale / scales.sum()
            draw.polygon(_place(pts, cx + sign * d * np.cos(a), cy + sign * d * np.sin(a),
                                radius * scale, rot), fill=255)
        label_size = label_pos = None
    elif kind == "dull":  # a shape or a blob in gray or brown: no colour of the six
        name = str(rng.choice([*list(_OUTLINES), *_BLOB_KINDS]))
        for pts in ([np.asarray(_OUTLINES[name])] if name in _OUTLINES else _parts(name, rng)):
            draw.polygon(_place(pts, cx, cy, radius, rot), fill=255)
        shape = name if name in _OUTLINES else "none"
        if rng.random() < 0.7:  # gray, well apart from the background's level
            level = rng.uniform(50, 120) if background == "light" else rng.uniform(120, 200)
            fill = np.full(3, level, dtype=np.float32)
        else:  # brown
            fill = np.asarray([rng.uniform(110, 160), rng.uniform(65, 95), rng.uniform(20, 50)], dtype=np.float32)
        out = bg * (1.0 - _coverage(canvas)) + fill * _coverage(canvas)
        return NonShape(_to_image(out), kind, shape, None, size, position)
    elif kind in ("two-colour", "two-colour-blob"):  # an in-set shape or a blob, half in another colour
        if kind == "two-colour":
            shape = str(rng.choice(list(_OUTLINES)))
            draw.polygon(_place(np.asarray(_OUTLINES[shape]), cx, cy, radius, rot), fill=255)
        else:
            for pts in _parts(str(rng.choice(_BLOB_KINDS)), rng):
                draw.polygon(_place(pts, cx, cy, radius, rot), fill=255)
        alpha = _coverage(canvas)
        other = str(rng.choice([c for c in COLORS if c != color]))
        a = rng.uniform(0, 2 * np.pi)
        yy, xx = (np.mgrid[0:image_size, 0:image_size] + 0.5) * _SUPERSAMPLE
        # the other colour on one side of a line through the shape (30-70% of it), with a sharp or a
        # soft border (a blend over up to 0.8 radius, as a blurred sample mixes them)
        d = (xx - cx) * np.cos(a) + (yy - cy) * np.sin(a) - rng.uniform(-0.35, 0.35) * radius
        soft = rng.uniform(0.0, 0.8) * radius
        t = np.clip(0.5 + d / max(soft, 1e-6), 0.0, 1.0)[:, :, None] if soft > 0.05 * radius else (d > 0)[:, :, None]
        fill = t * np.asarray(COLORS[other], dtype=np.float32) + (1 - t) * rgb
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


def nonshape_set(num: int, seed: int, image_size: int, extra: Sequence[str] = (),
                 shares: dict[str, float] | None = None) -> list[NonShape]:
    """``num`` renders, kinds in the proportions of :data:`NONSHAPE_KINDS` and of the ``extra`` kinds of
    :data:`EXTRA_NONSHAPE_KINDS`, attributes uniform. ``shares`` replaces the share of any of these kinds
    (0 = never drawn)."""
    unknown = [k for k in extra if k not in EXTRA_NONSHAPE_KINDS]
    if unknown:
        raise ValueError(f"unknown extra non-shape kind {unknown[0]!r} (known: {', '.join(EXTRA_NONSHAPE_KINDS)})")
    shares_all = {**NONSHAPE_KINDS, **{k: EXTRA_NONSHAPE_KINDS[k] for k in extra}}
    for k, v in (shares or {}).items():
        if k not in shares_all or v < 0:
            raise ValueError(f"share of non-shape kind {k!r}: must be one of the kinds drawn and >= 0, got {v}")
        shares_all[k] = float(v)
    kinds = list(shares_all)
    p = np.asarray(list(shares_all.values()))
    if p.sum() <= 0:
        raise ValueError("the non-shape kinds' shares are all 0")
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


def render_resized(shape: str, color: str, position: str, background: str, image_size: int,
                   rng: np.random.Generator, widths: tuple[float, float], sized: bool = False) -> NonShape:
    """An in-set ``shape`` in the dataset's style at a width (a fraction of the side) drawn uniformly from
    ``widths``: its shape, colour and position are the answers; its size is not one (None), or with
    ``sized`` the size a person reads from the width (:func:`size_of_width`). The dataset's small shapes
    span 0.28-0.32 of the side and its large ones 0.40-0.48 (SIZES with their jitter); a denoiser draws
    shapes between and beyond them."""
    side = image_size * _SUPERSAMPLE
    bg = _background(background, image_size, rng)
    cx, cy, _, rot = placement("small", position, side, rng)
    width = rng.uniform(*widths)
    radius = width / 2 * side
    canvas = Image.new("L", (side, side), 0)
    ImageDraw.Draw(canvas).polygon(_place(np.asarray(_OUTLINES[shape]), cx, cy, radius, rot), fill=255)
    alpha = _coverage(canvas)
    out = bg * (1.0 - alpha) + np.asarray(COLORS[color], dtype=np.float32) * alpha
    return NonShape(_to_image(out), "resized", shape, color, size_of_width(width, image_size) if sized else None,
                    position)


def size_of_width(width: float, image_size: int) -> str | None:
    """The size word a person gives a shape ``width`` (a fraction of the side) wide, by the labelling rule
    of tests/fixtures/judge-samples: small or large by the border halfway between the dataset's two sizes,
    None within one pixel of it."""
    border, margin = (SIZES["small"] + SIZES["large"]) / 2, 1.0 / image_size
    if abs(width - border) <= margin:
        return None
    return "small" if width < border else "large"


def resized_set(num: int, seed: int, image_size: int, widths: tuple[float, float],
                sized: bool = False) -> list[NonShape]:
    """``num`` renders of :func:`render_resized`, shape, colour, position and background uniform."""
    out = []
    for i in range(num):
        rng = np.random.default_rng([seed, 2, i])
        shape, color = str(rng.choice(list(_OUTLINES))), str(rng.choice(list(COLORS)))
        position, background = str(rng.choice(list(POSITIONS))), str(rng.choice(list(BACKGROUNDS)))
        out.append(render_resized(shape, color, position, background, image_size, rng, widths, sized))
    return out
