"""Per-sample decode/normalise/filter/resize: every bad input is a Reject with a reason."""

import io

import numpy as np
import pytest
from PIL import Image

from latentforge.data import imageproc as ip


def _bytes(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


CFG = ip.ImageConfig(resolution=32, format="png")
FILTERS = ip.FilterConfig()


def _decode_out(p: ip.ProcessedImage) -> np.ndarray:
    img = Image.open(io.BytesIO(p.data))
    assert img.mode == "RGB" and img.size == (p.width, p.height)
    return np.asarray(img)


@pytest.mark.parametrize("mode", ["RGB", "L", "1", "RGBA", "LA", "P", "CMYK", "I;16", "I", "F"])
def test_every_mode_becomes_rgb(mode):
    rgb = Image.new("RGB", (48, 40), (200, 30, 40))
    img = rgb.convert(mode) if mode not in ("I;16", "I", "F") else Image.new(mode, (48, 40), 1000 if mode != "F" else 0.5)
    fmt = {"CMYK": "JPEG", "I": "TIFF", "F": "TIFF"}.get(mode, "PNG")
    out = ip.process_image(_bytes(img, fmt), CFG, FILTERS)
    arr = _decode_out(out)
    assert arr.shape == (32, 32, 3)
    assert (out.orig_width, out.orig_height) == (48, 40)
    if mode in ("RGB", "CMYK"):
        assert abs(int(arr[..., 0].mean()) - 200) < 12 and arr[..., 1].mean() < 60


def test_alpha_is_composited_on_white():
    img = Image.new("RGBA", (32, 32), (255, 0, 0, 0))  # fully transparent red
    arr = _decode_out(ip.process_image(_bytes(img, "PNG"), CFG, FILTERS))
    assert arr.min() == 255


def test_palette_with_transparency():
    img = Image.new("P", (32, 32), 0)
    img.putpalette([0, 0, 0] * 256)
    img.info["transparency"] = 0
    arr = _decode_out(ip.process_image(_bytes(img, "PNG", transparency=0), CFG, FILTERS))
    assert arr.min() == 255


def test_16bit_is_scaled_not_clipped():
    img = Image.new("I;16", (32, 32), 65535 // 2)
    arr = _decode_out(ip.process_image(_bytes(img, "PNG"), CFG, FILTERS))
    assert 120 <= arr.mean() <= 135


@pytest.mark.parametrize(("orientation", "corner"), [(1, "top-left"), (6, "top-right"), (8, "bottom-left"),
                                                     (3, "bottom-right")])
def test_exif_orientation_is_applied(orientation, corner):
    """A 64x32 stored image, blue with a red marker block at x 16..31, y 0..15 (top row, left of
    centre). EXIF orientation 6 means "rotate 90 degrees clockwise to display": the stored left
    column becomes the top row and the top row the right column, so after the 32x64 portrait is
    center-cropped to rows 16..47 the marker must fill the top-right quadrant. 8 (counter-clockwise)
    puts it bottom-left, 3 (180 degrees, landscape: columns 16..47 kept) bottom-right; 1 leaves it
    top-left. Ignoring the tag, or turning the wrong way, puts it in another corner."""
    img = Image.new("RGB", (64, 32), (0, 0, 255))
    img.paste((255, 0, 0), (16, 0, 32, 16))
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = _bytes(img, "JPEG", exif=exif.tobytes(), quality=95)
    out = ip.process_image(data, ip.ImageConfig(resolution=16, format="png"), FILTERS)
    portrait = orientation in (6, 8)
    assert (out.orig_width, out.orig_height) == ((32, 64) if portrait else (64, 32))
    arr = _decode_out(out).astype(int)
    assert arr.shape == (16, 16, 3)
    quadrants = {"top-left": arr[1:7, 1:7], "top-right": arr[1:7, 9:15],
                 "bottom-left": arr[9:15, 1:7], "bottom-right": arr[9:15, 9:15]}  # 1 px off the seams
    for name, q in quadrants.items():
        red = q[..., 0].mean() > 200 and q[..., 2].mean() < 60
        blue = q[..., 2].mean() > 200 and q[..., 0].mean() < 60
        assert (red, blue) == ((True, False) if name == corner else (False, True)), (name, q.mean(axis=(0, 1)))


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "empty_file"),
        (b"this is not an image at all", "not_an_image"),
        (_bytes(Image.new("RGB", (64, 64), (1, 2, 3)), "PNG")[:60], "corrupt_image"),
    ],
)
def test_bad_bytes_are_rejected(data, reason):
    with pytest.raises(ip.Reject) as e:
        ip.process_image(data, CFG, FILTERS)
    assert e.value.reason == reason


def test_truncated_jpeg_is_rejected():
    rng = np.random.default_rng(0)
    data = _bytes(Image.fromarray(rng.integers(0, 255, (128, 128, 3), dtype=np.uint8)), "JPEG")
    with pytest.raises(ip.Reject) as e:
        ip.process_image(data[: len(data) // 2], CFG, FILTERS)
    assert e.value.reason == "corrupt_image"


def test_decompression_bomb():
    data = _bytes(Image.new("RGB", (100, 100)), "PNG")
    with pytest.raises(ip.Reject) as e:
        ip.process_image(data, ip.ImageConfig(resolution=32, max_pixels=5000), FILTERS)
    assert e.value.reason == "decompression_bomb"


def test_size_filters():
    data = _bytes(Image.new("RGB", (100, 20)), "PNG")
    with pytest.raises(ip.Reject, match="too_small"):
        ip.process_image(data, CFG, ip.FilterConfig(min_side=32))
    with pytest.raises(ip.Reject, match="bad_aspect"):
        ip.process_image(data, CFG, ip.FilterConfig(max_aspect=2.0))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])  # JPEG: the filters run on the header, before decoding
def test_default_filters_reject_tiny_images_and_slivers(fmt):
    """Defaults (auto): shorter side >= half the resolution, aspect <= 2x the widest target's."""
    cfg = ip.ImageConfig(resolution=256, format="png")
    assert ip.size_limits(ip.FilterConfig(), cfg) == (128, 2.0)
    with pytest.raises(ip.Reject, match=r"too_small: 8x8: shorter side 8 < min_side 128"):
        ip.process_image(_bytes(Image.new("RGB", (8, 8)), fmt), cfg, FILTERS)
    with pytest.raises(ip.Reject, match=r"bad_aspect: 2000x200: aspect 10.00 > max_aspect 2.0"):
        ip.process_image(_bytes(Image.new("RGB", (2000, 200)), fmt), cfg, FILTERS)
    with pytest.raises(ip.Reject, match="too_small"):  # 20x2000: too narrow before its aspect is looked at
        ip.process_image(_bytes(Image.new("RGB", (20, 2000)), fmt), cfg, FILTERS)
    # At the bounds: kept. 128 px is a 2x upscale; 2:1 keeps half the image in the crop.
    assert ip.process_image(_bytes(Image.new("RGB", (128, 128)), fmt), cfg, FILTERS).width == 256
    assert ip.process_image(_bytes(Image.new("RGB", (512, 256)), fmt), cfg, FILTERS).width == 256
    # 0 turns each off: the 8x8 image is upscaled, the sliver cropped.
    off = ip.FilterConfig(min_side=0, max_aspect=0)
    assert ip.process_image(_bytes(Image.new("RGB", (8, 8)), fmt), cfg, off).width == 256
    assert ip.process_image(_bytes(Image.new("RGB", (20, 2000)), fmt), cfg, off).height == 256


def test_with_buckets_the_aspect_bound_follows_the_widest_bucket():
    cfg = ip.ImageConfig(resolution=64, crop="buckets", bucket_step=16, bucket_max_aspect=4.0, format="png")
    buckets = ip.bucket_sizes(64, 16, 4.0)
    widest = max(w / h for w, h in buckets)
    assert widest == 4.0  # 128x32
    assert ip.size_limits(ip.FilterConfig(), cfg) == (32, 8.0)
    assert ip.process_image(_bytes(Image.new("RGB", (320, 40)), "PNG"), cfg, FILTERS).width == 128  # 8:1
    with pytest.raises(ip.Reject, match="bad_aspect: 360x40: aspect 9.00 > max_aspect 8.0"):
        ip.process_image(_bytes(Image.new("RGB", (360, 40)), "PNG"), cfg, FILTERS)
    narrow = ip.ImageConfig(resolution=64, crop="buckets", bucket_step=16, bucket_max_aspect=1.5, format="png")
    assert ip.bucket_sizes(64, 16, 1.5) == [(64, 64)]  # 80x48 would be 1.67:1
    assert ip.size_limits(ip.FilterConfig(), narrow)[1] == 2.0


def test_center_crop_keeps_the_center():
    img = Image.new("RGB", (96, 32), (0, 0, 0))
    img.paste((255, 255, 255), (32, 0, 64, 32))  # white center third
    arr = _decode_out(ip.process_image(_bytes(img, "PNG"), CFG, ip.FilterConfig(max_aspect=0)))  # 3:1, filter off
    assert arr.mean() > 250


def test_buckets_keep_aspect():
    cfg = ip.ImageConfig(resolution=64, crop="buckets", bucket_step=16, format="png")
    buckets = ip.bucket_sizes(64, 16, 2.0)
    assert (64, 64) in buckets and all(w * h <= 64 * 64 for w, h in buckets)
    assert all(max(w, h) / min(w, h) <= 2.0 for w, h in buckets)
    assert {(w, h) for w, h in buckets} == {(h, w) for w, h in buckets}
    out = ip.process_image(_bytes(Image.new("RGB", (300, 200)), "PNG"), cfg, FILTERS)
    assert out.width > out.height and (out.width, out.height) in buckets


def test_caption_checks():
    f = ip.FilterConfig(min_caption_chars=3, max_caption_chars=10)
    assert ip.check_caption("  a  red\ncat ", f) == "a red cat"
    assert ip.check_caption("\ufeffa red cat", f) == "a red cat"
    for cap, reason in [(None, "no_caption"), ("   ", "empty_caption"), ("ab", "caption_too_short"),
                        ("x" * 11, "caption_too_long")]:
        with pytest.raises(ip.Reject) as e:
            ip.check_caption(cap, f)
        assert e.value.reason == reason


def test_value_thresholds():
    f = ip.FilterConfig(min_values={"aesthetic": 5.0}, max_values={"punsafe": 0.5})
    ip.check_values({"aesthetic": 5.0, "punsafe": 0.1}, f)
    for meta, reason in [({"aesthetic": 4.9, "punsafe": 0.1}, "below_threshold"),
                         ({"punsafe": 0.1}, "below_threshold"),
                         ({"aesthetic": 6, "punsafe": 0.9}, "above_threshold")]:
        with pytest.raises(ip.Reject) as e:
            ip.check_values(meta, f)
        assert e.value.reason == reason
