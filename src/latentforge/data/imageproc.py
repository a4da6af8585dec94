"""Per-sample image and caption processing of the ingest: decode, normalise, filter, resize, crop.

Every failure is a :class:`Reject` with a reason from :data:`REASONS`, so the ingest can count
and log it; nothing here raises for bad data.
"""

from __future__ import annotations

import hashlib
import io
import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from PIL import Image, ImageFile, ImageOps

from latentforge.errors import Problems

# Rejection reasons (the keys of summary.json's "rejected"). Sources add their own read errors.
REASONS = (
    "empty_file",  # zero bytes
    "not_an_image",  # Pillow does not recognise the bytes as an image
    "corrupt_image",  # recognised, but decoding failed (truncated, broken data)
    "decompression_bomb",  # more pixels than Pillow's MAX_IMAGE_PIXELS
    "too_small",  # shorter side below filters.min_side (default: half the resolution)
    "bad_aspect",  # long/short side above filters.max_aspect (default: twice the widest target's)
    "no_caption",  # no caption found for the image
    "empty_caption",  # caption present but blank
    "caption_not_text",  # a metadata caption that is a number, list or mapping, not a string
    "caption_too_short",
    "caption_too_long",
    "below_threshold",  # a numeric column below filters.min_values
    "above_threshold",  # a numeric column above filters.max_values
    "duplicate",  # same image bytes (sha256) as an earlier sample
)


# Pillow names the file object it could not read by its memory address ("<_io.BytesIO object at
# 0x7f...>"), which differs between runs: the ledger keeps the message without it, so that two runs
# over the same data write the same rejected.jsonl.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def stable_detail(text: str) -> str:
    """A rejection's message without the memory addresses that make it differ between runs."""
    return _ADDRESS.sub("", text)


class Reject(Exception):
    def __init__(self, reason: str, detail: str = ""):
        detail = stable_detail(detail)
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass
class FilterConfig:
    """Which samples are kept. Thresholds apply to the source image before resizing.

    The size filters are on by default (docs/decisions.md, "Ingest filters"): an image whose
    shorter side is below half the target resolution would be upscaled more than 2x, and one
    whose aspect ratio is more than twice that of the widest target (1:1 for a center crop, the
    widest bucket with buckets) would lose more than half of itself to the crop."""

    min_side: int | Literal["auto"] = field(default="auto", metadata={
        "help": "reject images whose shorter side (px) is below this; auto = half of image.resolution "
                "(rounded up); 0 = off"})
    max_aspect: float | Literal["auto"] = field(default="auto", metadata={
        "help": "reject images with long/short side above this; auto = 2 x the widest target's aspect "
                "(2.0 for a center crop, 2 x the widest bucket's with buckets); 0 = off"})
    min_caption_chars: int = field(default=1, metadata={"help": "reject captions shorter than this (after stripping)"})
    max_caption_chars: int = field(default=1000, metadata={"help": "reject captions longer than this; 0 = off"})
    min_values: dict[str, float] = field(
        default_factory=dict, metadata={"help": "numeric source column -> minimum kept value, e.g. {aesthetic_score: 5.0}"}
    )
    max_values: dict[str, float] = field(
        default_factory=dict, metadata={"help": "numeric source column -> maximum kept value, e.g. {punsafe: 0.5}"}
    )
    dedup: bool = field(default=True, metadata={"help": "reject exact duplicates (same source image bytes)"})

    def validate(self) -> None:
        problems = Problems()
        if self.min_side != "auto" and self.min_side < 0:
            problems.add(f"min_side: must be >= 0, got {self.min_side}; 0 = off, or auto")
        if self.max_aspect != "auto" and self.max_aspect and self.max_aspect < 1:
            problems.add(f"max_aspect: must be >= 1 (long side / short side), got {self.max_aspect}; 0 = off, or auto")
        if self.min_caption_chars < 0:
            problems.add(f"min_caption_chars: must be >= 0, got {self.min_caption_chars}; 0 = keep empty captions")
        if self.max_caption_chars < 0:
            problems.add(f"max_caption_chars: must be >= 0, got {self.max_caption_chars}; 0 = off")
        elif self.max_caption_chars and self.max_caption_chars < self.min_caption_chars:
            problems.add(f"max_caption_chars: {self.max_caption_chars} is below min_caption_chars "
                         f"{self.min_caption_chars}; raise it, or 0 = off")
        problems.raise_if_any()


@dataclass
class ImageConfig:
    """How kept images are resized and stored."""

    resolution: int = field(default=256, metadata={"help": "target size (px) of the square crop, or the bucket area side"})
    crop: Literal["center", "buckets"] = field(
        default="center", metadata={"help": "center: resize the short side and center-crop a square; buckets: keep aspect, snap to a bucket"}
    )
    bucket_step: int = field(default=64, metadata={"help": "bucket sides are multiples of this (px)"})
    bucket_max_aspect: float = field(default=2.0, metadata={"help": "largest bucket aspect ratio"})
    format: Literal["png", "jpeg", "webp"] = field(default="jpeg", metadata={"help": "encoding of the stored image"})
    quality: int = field(default=95, metadata={"help": "jpeg/webp quality of the stored image"})
    max_pixels: int = field(
        default=89_478_485, metadata={"help": "larger images are rejected as decompression bombs (Pillow's default limit)"}
    )

    def validate(self) -> None:
        problems = Problems()
        if self.resolution < 8:
            problems.add(f"resolution: must be >= 8, got {self.resolution}; the image side in px, e.g. 256")
        if self.bucket_step < 8 or self.bucket_step % 8:
            problems.add(f"bucket_step: must be a positive multiple of 8, got {self.bucket_step}; e.g. 64")
        elif self.crop == "buckets" and self.resolution >= 8 and self.resolution % self.bucket_step:
            problems.add(f"resolution: {self.resolution} is not a multiple of bucket_step {self.bucket_step}; "
                         "change one of them")
        if not 1 <= self.quality <= 100:
            problems.add(f"quality: must be in 1..100, got {self.quality}; e.g. 95")
        if self.bucket_max_aspect < 1:
            problems.add(f"bucket_max_aspect: must be >= 1 (long side / short side), got {self.bucket_max_aspect}")
        problems.raise_if_any()


@dataclass
class ProcessedImage:
    data: bytes
    format: str
    width: int
    height: int
    orig_width: int
    orig_height: int


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def bucket_sizes(resolution: int, step: int, max_aspect: float) -> list[tuple[int, int]]:
    """(width, height) buckets of at most ``resolution**2`` pixels, sides multiples of ``step``.

    The NovelAI aspect-bucket scheme: for each width from ``resolution`` up, the largest height
    that keeps the area within ``resolution**2``, while the aspect stays within ``max_aspect``;
    and the same buckets transposed.
    """
    area = resolution * resolution
    out = set()
    w = resolution // step * step
    while True:
        h = area // w // step * step  # the tallest bucket of this width within the area
        if h < step or w / h > max_aspect:
            break
        out.update({(w, h), (h, w)})
        w += step
    return sorted(out)


def nearest_bucket(width: int, height: int, buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose aspect ratio is closest (in log space) to the image's."""
    target = math.log(width / height)
    return min(buckets, key=lambda b: (abs(math.log(b[0] / b[1]) - target), -b[0] * b[1]))


def _to_rgb(img: Image.Image) -> Image.Image:
    """Any Pillow mode to 8-bit RGB: alpha is composited on white, 16-bit/float scaled to 8 bits."""
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        arr = np.asarray(img, dtype=np.float64)
        if img.mode.startswith("I;16"):
            arr = arr / 257.0
        else:  # 32-bit int or float: stretch the used range
            lo, hi = float(arr.min()), float(arr.max())
            arr = (arr - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(arr)
        img = Image.fromarray(np.clip(arr + 0.5, 0, 255).astype(np.uint8), "L")
    if img.mode == "P":
        img = img.convert("RGBA") if "transparency" in img.info else img.convert("RGB")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(background, rgba)
    return img.convert("RGB") if img.mode != "RGB" else img


def _open(data: bytes, max_pixels: int) -> Image.Image:
    """Open image bytes, reading the header only; :class:`Reject` for empty, unknown or bomb-sized input."""
    if not data:
        raise Reject("empty_file")
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise Reject("decompression_bomb", str(e)) from None
    except Image.UnidentifiedImageError:
        raise Reject("not_an_image", "not a recognised image format") from None
    except Exception as e:  # a header Pillow cannot parse
        raise Reject("corrupt_image", f"{type(e).__name__}: {e}") from None
    if img.width * img.height > max_pixels:
        raise Reject("decompression_bomb", f"{img.width}x{img.height} pixels")
    return img


def _load(img: Image.Image) -> Image.Image:
    """Decode an opened image, apply its EXIF orientation, convert to 8-bit RGB."""
    try:
        img.load()
        img = ImageOps.exif_transpose(img)
    except Exception as e:  # truncated or broken image data: Pillow raises OSError/ValueError/SyntaxError
        raise Reject("corrupt_image", f"{type(e).__name__}: {e}") from None
    return _to_rgb(img)


def resize_crop(img: Image.Image, width: int, height: int) -> Image.Image:
    """Resize so the image covers (width, height), then center-crop to exactly that size."""
    scale = max(width / img.width, height / img.height)
    new_w, new_h = max(width, round(img.width * scale)), max(height, round(img.height * scale))
    if (new_w, new_h) != img.size:
        # reducing_gap: a cheap integer box reduction first, then Lanczos (same quality, much faster).
        img = img.resize((new_w, new_h), Image.Resampling.LANCZOS, reducing_gap=3.0)
    left, top = (new_w - width) // 2, (new_h - height) // 2
    return img.crop((left, top, left + width, top + height))


def encode(img: Image.Image, cfg: ImageConfig) -> bytes:
    buf = io.BytesIO()
    if cfg.format == "png":
        img.save(buf, format="PNG", compress_level=1)  # fast; size matters less than ingest speed
    elif cfg.format == "jpeg":
        img.save(buf, format="JPEG", quality=cfg.quality)
    else:
        img.save(buf, format="WEBP", quality=cfg.quality)
    return buf.getvalue()


def size_limits(filters: FilterConfig, cfg: ImageConfig,
                buckets: list[tuple[int, int]] | None = None) -> tuple[int, float]:
    """``(min_side, max_aspect)`` in effect (0 = off), with ``auto`` resolved for this target:
    half the resolution, and twice the aspect of the widest target (1 for a center crop)."""
    min_side = math.ceil(cfg.resolution / 2) if filters.min_side == "auto" else int(filters.min_side)
    if filters.max_aspect == "auto":
        if cfg.crop == "buckets":
            sizes = buckets or bucket_sizes(cfg.resolution, cfg.bucket_step, cfg.bucket_max_aspect)
            widest = max(max(w, h) / min(w, h) for w, h in sizes)
        else:
            widest = 1.0
        max_aspect = round(2.0 * widest, 4)
    else:
        max_aspect = float(filters.max_aspect)
    return min_side, max_aspect


def process_image(data: bytes, cfg: ImageConfig, filters: FilterConfig,
                  buckets: list[tuple[int, int]] | None = None) -> ProcessedImage:
    """Decode (once), check size filters, resize and crop, encode. Raises :class:`Reject`."""
    limits = size_limits(filters, cfg, buckets)
    img = _open(data, cfg.max_pixels)
    header_size = None
    if img.format == "JPEG":
        # JPEG headers carry the EXIF orientation, so the size filters and the target are known
        # before decoding, and the decoder can work at a reduced DCT scale that still covers the
        # target (2-8x less work on large photos).
        w, h = img.size
        header_size = (h, w) if img.getexif().get(0x0112, 1) in (5, 6, 7, 8) else (w, h)
        _check_size(*header_size, *limits)
        tw, th = _target(*header_size, cfg, buckets)
        scale = max(tw, th) / min(w, h)
        img.draft("RGB", (math.ceil(w * scale), math.ceil(h * scale)))
    img = _load(img)
    orig_w, orig_h = header_size or img.size  # the source size, oriented (a draft decode is smaller)
    _check_size(orig_w, orig_h, *limits)
    tw, th = _target(orig_w, orig_h, cfg, buckets)
    out = resize_crop(img, tw, th)
    return ProcessedImage(encode(out, cfg), cfg.format, tw, th, orig_w, orig_h)


def _check_size(w: int, h: int, min_side: int, max_aspect: float) -> None:
    """The size filters; the ledger's detail names the threshold (ingest.filters.* = 0 turns it off)."""
    if min(w, h) < 1:
        raise Reject("corrupt_image", f"{w}x{h} pixels")
    if min_side and min(w, h) < min_side:
        raise Reject("too_small", f"{w}x{h}: shorter side {min(w, h)} < min_side {min_side}")
    if max_aspect and max(w, h) / min(w, h) > max_aspect:
        raise Reject("bad_aspect", f"{w}x{h}: aspect {max(w, h) / min(w, h):.2f} > max_aspect {max_aspect}")


def _target(w: int, h: int, cfg: ImageConfig, buckets: list[tuple[int, int]] | None) -> tuple[int, int]:
    if cfg.crop == "buckets":
        return nearest_bucket(w, h, buckets or bucket_sizes(cfg.resolution, cfg.bucket_step, cfg.bucket_max_aspect))
    return cfg.resolution, cfg.resolution


def check_caption(caption: str | None, filters: FilterConfig) -> str:
    """The cleaned caption, or raise :class:`Reject`."""
    if caption is None:
        raise Reject("no_caption")
    if not isinstance(caption, str):
        raise Reject("caption_not_text", f"{type(caption).__name__}: {str(caption)[:80]}")
    text = " ".join(caption.replace("\ufeff", " ").split())  # a byte-order mark (from some editors) is not text
    if not text:
        raise Reject("empty_caption")
    if len(text) < filters.min_caption_chars:
        raise Reject("caption_too_short", f"{len(text)} < {filters.min_caption_chars} chars")
    if filters.max_caption_chars and len(text) > filters.max_caption_chars:
        raise Reject("caption_too_long", f"{len(text)} > {filters.max_caption_chars} chars")
    return text


def check_values(meta: dict[str, Any], filters: FilterConfig) -> None:
    """Numeric-column thresholds; a missing or non-numeric column fails the threshold."""
    for col, lo in filters.min_values.items():
        v = meta.get(col)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= lo:
            raise Reject("below_threshold", f"{col}={v!r} < {lo}")
    for col, hi in filters.max_values.items():
        v = meta.get(col)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v <= hi:
            raise Reject("above_threshold", f"{col}={v!r} > {hi}")
