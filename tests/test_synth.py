"""The procedural captioned dataset: determinism, splits, captions, pixels, config, reruns."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from latentforge.config import from_dict
from latentforge.data import synth
from latentforge.data.synth import (
    COLORS,
    EXTRA_TEMPLATES,
    HELDOUT_COMBOS,
    PARTIAL_TEMPLATES,
    POSITIONS,
    SHAPES,
    SIZES,
    TEMPLATES,
    SynthConfig,
    caption_for,
    generate,
    prompts_for_combos,
    render,
)
from latentforge.errors import ConfigError, UserError

# 40 >= the 30 training combos, so the tiling puts every combo in train at least once.
SMALL = dict(num=40, num_heldout=12, image_size=32)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _labels(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "labels.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "out"
    generate(out, SynthConfig(**SMALL), progress=False)
    return out


def test_same_seed_same_bytes_other_seed_differs(dataset, tmp_path):
    again = tmp_path / "again"
    generate(again, SynthConfig(**SMALL), progress=False)
    assert _files(again) == _files(dataset)

    other = tmp_path / "other"
    generate(other, SynthConfig(**SMALL, seed=1), progress=False)
    a, b = _files(dataset), _files(other)
    assert a.keys() == b.keys()
    assert sum(a[k] != b[k] for k in a if k.endswith(".png")) > 40  # most images differ


def test_layout_and_counts(dataset):
    for split, num in (("train", 40), ("heldout", 12)):
        assert sorted(p.name for p in (dataset / split).glob("*.png")) == [f"{i:06d}.png" for i in range(num)]
        assert len(list((dataset / split).glob("*.txt"))) == num
        assert sorted(p.name for p in (dataset / split).iterdir() if p.suffix not in (".png", ".txt")) == []
    assert sorted(p.name for p in dataset.iterdir()) == ["heldout", "labels.jsonl", "synth.json", "train"]
    summary = json.loads((dataset / "synth.json").read_text())
    assert summary["counts"] == {"train": 40, "heldout": 12}
    assert summary["config"]["num"] == 40
    assert summary["heldout_combos"] == [list(c) for c in HELDOUT_COMBOS]
    assert summary["colors"] == {k: list(v) for k, v in COLORS.items()}
    labels = _labels(dataset)
    assert [x["split"] for x in labels] == ["train"] * 40 + ["heldout"] * 12


def test_heldout_combos_only_in_heldout_and_train_covers_everything(dataset):
    held = set(HELDOUT_COMBOS)
    labels = _labels(dataset)
    train = {(x["color"], x["shape"]) for x in labels if x["split"] == "train"}
    heldout = {(x["color"], x["shape"]) for x in labels if x["split"] == "heldout"}
    assert not train & held
    assert heldout == held
    assert {c for c, _ in train} == set(COLORS)
    assert {s for _, s in train} == set(SHAPES)
    assert len(train) == len(COLORS) * len(SHAPES) - len(held)


def test_default_heldout_leaves_each_colour_and_shape_five_training_partners():
    combos = SynthConfig().heldout_combos()
    assert combos == list(HELDOUT_COMBOS)
    assert sorted(c for c, _ in combos) == sorted(COLORS)
    assert sorted(s for _, s in combos) == sorted(SHAPES)


def test_captions_match_labels_and_images_are_rgb(dataset):
    for x in _labels(dataset):
        png = dataset / x["file"]
        assert png.with_suffix(".txt").read_text() == x["caption"]
        words = x["caption"].replace(",", " ").replace(":", " ").split()
        assert x["color"] in words and x["shape"] in words and x["size"] in words
        with Image.open(png) as im:
            assert im.mode == "RGB" and im.size == (32, 32)


def test_caption_templates():
    attrs = ("triangle", "red", "small", "top left", "dark")
    assert caption_for(*attrs, 0) == "a small red triangle in the top left"
    assert caption_for(*attrs, 1) == "top left: red triangle, small"
    assert caption_for(*attrs, 2) == "a red triangle, small, in the top left corner"
    for t in range(len(TEMPLATES)):
        for pos in POSITIONS:
            text = caption_for("star", "cyan", "large", pos, "light", t)
            assert "cyan star" in text and "large" in text and "{" not in text


def test_partial_templates_leave_out_size_position_or_both():
    attrs = ("triangle", "red", "small", "top left", "dark")
    texts = [caption_for(*attrs, len(TEMPLATES) + k) for k in range(len(PARTIAL_TEMPLATES))]
    assert texts[0] == "a red triangle in the top left" and texts[4] == "a red triangle on a dark background"
    named = [("small" in t, "top left" in t) for t in texts]
    assert named == [(False, True)] * 2 + [(True, False)] * 2 + [(False, False)] * 2
    assert all("red triangle" in t and "{" not in t for t in texts)


def test_partial_captions_change_only_training_captions(dataset, tmp_path):
    out = tmp_path / "partial"
    generate(out, SynthConfig(**SMALL, partial_captions=0.5), progress=False)
    full, part = _files(dataset), _files(out)
    assert full.keys() == part.keys()
    # every image and every held-out caption is byte for byte that of partial_captions=0
    assert all(full[k] == part[k] for k in full if k.endswith(".png") or k.startswith("heldout/"))
    a, b = _labels(dataset), _labels(out)
    drop = lambda x: {k: v for k, v in x.items() if k != "caption"}
    assert [drop(x) for x in a] == [drop(x) for x in b]
    changed = [(x, y) for x, y in zip(a, b) if x["caption"] != y["caption"]]
    assert all(x["split"] == "train" for x, _ in changed)
    assert 10 <= len(changed) <= 30  # about half of the 40 training captions
    for x, y in changed:
        assert y["caption"] in {caption_for(x["shape"], x["color"], x["size"], x["position"], x["background"],
                                            len(TEMPLATES) + k) for k in range(len(PARTIAL_TEMPLATES))}
        assert (out / y["file"]).with_suffix(".txt").read_text() == y["caption"]


def test_extra_templates_name_everything_in_other_orders():
    attrs = ("triangle", "red", "small", "top left", "dark")
    first = len(TEMPLATES) + len(PARTIAL_TEMPLATES)
    texts = [caption_for(*attrs, first + k) for k in range(len(EXTRA_TEMPLATES))]
    assert texts[1] == "small triangle, red, in the top left corner"  # the shape before its colour
    assert texts[4] == "the red triangle is small and sits in the top left"
    assert all("red" in t and "triangle" in t and "small" in t and "top left" in t and "{" not in t for t in texts)
    assert not set(texts) & {caption_for(*attrs, t) for t in range(first)}


def test_extra_templates_change_only_training_captions_and_add_to_partial(dataset, tmp_path):
    out = tmp_path / "extra"
    generate(out, SynthConfig(**SMALL, extra_templates=0.5), progress=False)
    full, extra = _files(dataset), _files(out)
    assert all(full[k] == extra[k] for k in full if k.endswith(".png") or k.startswith("heldout/"))
    a, b = _labels(dataset), _labels(out)
    changed = [(x, y) for x, y in zip(a, b) if x["caption"] != y["caption"]]
    assert all(x["split"] == "train" for x, _ in changed) and 10 <= len(changed) <= 30
    first = len(TEMPLATES) + len(PARTIAL_TEMPLATES)
    for x, y in changed:
        assert y["caption"] in {caption_for(x["shape"], x["color"], x["size"], x["position"], x["background"],
                                            first + k) for k in range(len(EXTRA_TEMPLATES))}
    # with partial captions too: a partial caption stays partial, the extra share comes out of the rest
    both = tmp_path / "both"
    generate(both, SynthConfig(**SMALL, partial_captions=0.3, extra_templates=0.5), progress=False)
    partial = tmp_path / "partial"
    generate(partial, SynthConfig(**SMALL, partial_captions=0.3), progress=False)
    for x, p, q in zip(a, _labels(partial), _labels(both)):
        if p["caption"] != x["caption"]:
            assert q["caption"] == p["caption"]  # partial in both
        elif q["caption"] != x["caption"]:
            assert q["caption"] in {caption_for(x["shape"], x["color"], x["size"], x["position"], x["background"],
                                                first + k) for k in range(len(EXTRA_TEMPLATES))}


def test_prompts_for_combos_deterministic_and_on_topic():
    a = prompts_for_combos(HELDOUT_COMBOS, 3, num_per_combo=2)
    assert a == prompts_for_combos(HELDOUT_COMBOS, np.random.default_rng(3), num_per_combo=2)
    assert len(a) == 2 * len(HELDOUT_COMBOS)
    for (color, shape), text in zip([c for c in HELDOUT_COMBOS for _ in range(2)], a):
        assert f"{color} {shape}" in text
    assert a != prompts_for_combos(HELDOUT_COMBOS, 4, num_per_combo=2)
    with pytest.raises(UserError, match="combo 'red' 'hexagon': unknown colour or shape"):
        prompts_for_combos([("red", "hexagon")], 0)


def test_colours_are_far_apart():
    rgb = np.asarray(list(COLORS.values()), dtype=np.float64)
    dist = np.linalg.norm(rgb[:, None] - rgb[None], axis=-1)
    assert dist[~np.eye(len(rgb), dtype=bool)].min() > 90


@pytest.mark.parametrize("background", ["light", "dark"])
def test_render_shape_has_nominal_colour_and_background_is_far(background):
    for i, (name, rgb) in enumerate(COLORS.items()):
        im = render("square", name, "large", "center", background, 32, np.random.default_rng(i))
        px = np.asarray(im, dtype=np.int16)
        centre = px[14:18, 14:18].reshape(-1, 3)
        assert np.abs(centre - np.asarray(rgb)).max() <= 1, name
        corners = np.concatenate([px[:3, :3].reshape(-1, 3), px[-3:, -3:].reshape(-1, 3)])
        for other in COLORS.values():
            assert np.linalg.norm(corners - np.asarray(other), axis=1).min() > 60, (name, background)


def test_render_shapes_differ_and_positions_move_the_shape():
    def mask(shape: str, position: str = "center") -> np.ndarray:
        im = render(shape, "red", "large", position, "dark", 64, np.random.default_rng(0))
        return np.asarray(im)[:, :, 0] > 128  # red channel: shape 220, dark background <= 115

    masks = {s: mask(s) for s in SHAPES}
    for a in SHAPES:
        assert masks[a].sum() > 100, a
        for b in SHAPES:
            if a < b:
                iou = (masks[a] & masks[b]).sum() / (masks[a] | masks[b]).sum()
                assert iou < 0.85, (a, b, iou)
    ys, xs = np.nonzero(mask("circle", "top left"))
    assert xs.mean() < 24 and ys.mean() < 24
    ys, xs = np.nonzero(mask("circle", "bottom right"))
    assert xs.mean() > 40 and ys.mean() > 40
    small = render("circle", "red", "small", "center", "dark", 64, np.random.default_rng(0))
    assert (np.asarray(small)[:, :, 0] > 128).sum() < 0.7 * masks["circle"].sum()
    assert SIZES["small"] < SIZES["large"]


@pytest.mark.parametrize(
    "data, field",
    [
        ({"shapes": ["circle", "hexagon"]}, "shapes"),
        ({"colors": ["red", "pink"]}, "colors"),
        ({"colors": ["red", "red", "blue"]}, "colors"),
        ({"positions": ["middle"]}, "positions"),
        ({"image_size": 8}, "image_size"),
        ({"num": 0}, "num"),
        ({"heldout": ["redstar"]}, "heldout"),
        ({"heldout": ["red star", "red star"]}, "heldout"),
        ({"heldout": [f"red {s}" for s in SHAPES]}, "heldout"),  # red never trained
        ({"heldout": [f"{c} star" for c in COLORS]}, "heldout"),  # star never trained
        ({"colors": ["red", "blue"]}, "heldout"),  # default combos name colours not listed
        ({"heldout": [], "num_heldout": 5}, "num_heldout"),
        ({"partial_captions": 1.5}, "partial_captions"),
        ({"partial_captions": -0.1}, "partial_captions"),
        ({"extra_templates": 1.1}, "extra_templates"),
        ({"partial_captions": 0.6, "extra_templates": 0.6}, "extra_templates"),
    ],
)
def test_config_validation_names_the_field(data, field):
    with pytest.raises(ConfigError, match=rf"^{field}: "):
        from_dict(SynthConfig, data)


def test_restricted_config_is_valid():
    data = {"colors": ["red", "blue"], "shapes": ["circle", "square"], "heldout": ["red circle"]}
    cfg = from_dict(SynthConfig, data)
    assert cfg.train_combos() == [("red", "square"), ("blue", "circle"), ("blue", "square")]


def test_rerun_same_config_does_nothing(dataset):
    before = {p: p.stat().st_mtime_ns for p in dataset.rglob("*")}
    summary = generate(dataset, SynthConfig(**SMALL), progress=False)
    assert summary == json.loads((dataset / "synth.json").read_text())
    assert {p: p.stat().st_mtime_ns for p in dataset.rglob("*")} == before


def test_refuses_foreign_or_other_config_dir(dataset, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not a synth output"):
        generate(foreign, SynthConfig(**SMALL), progress=False)
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    with pytest.raises(UserError, match="num 40 there, 41 now"):
        generate(dataset, SynthConfig(**{**SMALL, "num": 41}), progress=False)
    with pytest.raises(UserError, match="local directory"):
        generate("s3://bucket/synth", SynthConfig(**SMALL), progress=False)


def test_rerun_of_an_output_older_than_an_option_resumes(dataset, tmp_path):
    """An output written before an option existed (its saved config lacks the key) is the dataset of
    the option's default: a rerun with the default takes it as it is, another value is refused."""
    out = tmp_path / "older"
    shutil.copytree(dataset, out)
    summary = json.loads((out / "synth.json").read_text())
    del summary["config"]["extra_templates"]
    (out / "synth.json").write_text(json.dumps(summary))
    before = _files(out)
    assert generate(out, SynthConfig(**SMALL), progress=False) == summary
    assert _files(out) == before
    with pytest.raises(UserError, match="extra_templates 0.0 there, 0.5 now"):
        generate(out, SynthConfig(**{**SMALL, "extra_templates": 0.5}), progress=False)


def test_killed_run_is_incomplete_and_rerun_finishes_it(dataset, tmp_path, monkeypatch):
    out = tmp_path / "crashed"
    calls = 0
    real_render = synth.render

    def crash_after_ten(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls > 10:
            raise KeyboardInterrupt
        return real_render(*args, **kwargs)

    monkeypatch.setattr(synth, "render", crash_after_ten)
    with pytest.raises(KeyboardInterrupt):
        generate(out, SynthConfig(**SMALL), progress=False)
    assert not (out / "synth.json").exists() and (out / "synth.partial.json").exists()
    assert len(list((out / "train").glob("*.png"))) == 10
    (out / "train" / ".000010.png.tmp-1").write_bytes(b"half")  # as a killed write leaves it

    monkeypatch.setattr(synth, "render", real_render)
    with pytest.raises(UserError, match="another config"):
        generate(out, SynthConfig(**{**SMALL, "seed": 5}), progress=False)
    generate(out, SynthConfig(**SMALL), progress=False)
    assert _files(out) == _files(dataset)


def test_missing_files_are_regenerated(dataset, tmp_path):
    out = tmp_path / "copy"
    summary = generate(out, SynthConfig(**SMALL), progress=False)
    assert summary == json.loads((out / "synth.json").read_text())
    (out / "train" / "000003.png").unlink()
    generate(out, SynthConfig(**SMALL), progress=False)
    assert _files(out) == _files(dataset)
