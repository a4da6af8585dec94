"""The demo's judge and its scores: the judge must recognise unseen renders and say "none" to what
is not a shape of the set (else its scores mean nothing), agree with labels assigned by eye on
generated images, and every rate must carry its interval."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from scipy.stats import binomtest

from latentforge.data.synth import COLORS, POSITIONS, SynthConfig, TEMPLATES, caption_for, generate
from latentforge.errors import ConfigError
from latentforge.evaluate import alignment
from latentforge.evaluate.alignment import Prompt, check_new_wordings, make_prompts, score
from latentforge.evaluate.judge import (NONE, JudgeConfig, agreement, blur, build_judge, chance, down_up,
                                        load_labelled, validate_judge, verdicts, verdicts_of_tensor)
from latentforge.evaluate.nonshapes import NONSHAPE_KINDS, nonshape_set
from latentforge.evaluate.stats import wilson_interval

FIXTURE = Path(__file__).parent / "fixtures" / "judge"


def test_wilson_interval_matches_scipy_and_a_published_value():
    # Newcombe (1998), Statistics in Medicine 17, Table II, example 81/263: score interval 0.2553-0.3662
    lo, hi = wilson_interval(81, 263)
    assert (round(lo, 4), round(hi, 4)) == (0.2553, 0.3662)
    for k, n in [(0, 10), (10, 10), (48, 96), (3, 7), (95, 96)]:
        ref = binomtest(k, n).proportion_ci(method="wilson")
        assert wilson_interval(k, n) == pytest.approx((ref.low, ref.high), abs=1e-12)
    with pytest.raises(ValueError):
        wilson_interval(5, 4)


def test_new_wordings_are_no_training_caption(monkeypatch):
    check_new_wordings()
    prompts = make_prompts([("red", "star")], "draw", 18, seed=0)
    assert prompts[0].text.startswith("draw a ") and "red star" in prompts[0].text
    # sizes and positions are each asked about equally often
    assert sorted(p.position for p in prompts) == sorted(2 * list(POSITIONS))
    assert [p.size for p in prompts].count("small") == 9
    assert all(p.size is None and p.position is None for p in make_prompts([("red", "star")], "plain", 4, 0))
    caption = make_prompts([("blue", "cross")], "caption", 4, 0)
    assert all(p.size and p.position and "blue cross" in p.text for p in caption)
    # a "new" wording that is really a training template is caught
    monkeypatch.setitem(alignment.NEW_WORDINGS, "copy", TEMPLATES[0])
    with pytest.raises(ConfigError, match="is a training caption"):
        check_new_wordings()
    assert caption_for("star", "red", "small", "top left", "light", 0) == "a small red star in the top left"


def test_score_counts_only_what_each_prompt_names():
    prompts = [Prompt("a", "caption", "red", "star", "small", "top"), Prompt("b", "plain", "red", "star", None, None),
               Prompt("c", "draw", "blue", "cross", "large", "left")]
    found = {"color": ["red", "red", "blue"], "shape": ["star", NONE, "cross"], "size": ["small", "large", "small"],
             "position": ["top", "top", "left"]}
    s = score(prompts, found)
    assert (s["color"]["right"], s["color"]["num"]) == (3, 3)
    assert (s["both"]["right"], s["both"]["num"]) == (2, 3)
    assert (s["size"]["right"], s["size"]["num"]) == (1, 2)  # the plain prompt names no size
    assert (s["position"]["right"], s["position"]["num"]) == (2, 2)
    assert (s["size"]["lo"], s["size"]["hi"]) == wilson_interval(1, 2)


def test_nonshapes_are_deterministic_and_labelled():
    a, b = nonshape_set(40, 5, 64), nonshape_set(40, 5, 64)
    assert [np.asarray(x.image).tobytes() for x in a] == [np.asarray(x.image).tobytes() for x in b]
    assert {x.kind for x in nonshape_set(200, 1, 64)} == set(NONSHAPE_KINDS)
    for x in nonshape_set(300, 5, 64):
        assert x.image.size == (64, 64)
        if x.kind not in ("two-colour", "dull"):  # those two keep an in-set outline's shape
            assert x.shape == NONE, x.kind
        assert x.kind != "two-colour" or x.shape != NONE
        assert (x.color is None) == (x.kind in ("two-colour", "two-colour-blob", "dull", "empty"))
        assert (x.position is None) == (x.kind in ("merged", "pair", "empty"))
        if x.kind == "dull":  # gray or brown: every pixel far from every colour of the six
            rgb = np.asarray(x.image, dtype=float).reshape(-1, 1, 3)
            assert np.linalg.norm(rgb - np.asarray(list(COLORS.values()), dtype=float), axis=2).min() > 60
    empty = [x for x in nonshape_set(200, 1, 64) if x.kind == "empty"][0]
    assert np.asarray(empty.image).std(axis=2).max() == 0  # gray background only


def test_degradations_keep_the_mean_and_soften():
    x = torch.zeros(1, 3, 16, 16)
    x[..., 5:9, 5:9] = 1.0  # odd-aligned: 2x down-sampling mixes it with the background
    for f in (blur, down_up):
        y = f(x)
        assert y.shape == x.shape
        assert float(y.max()) < 1.0 and float(y.sum()) == pytest.approx(float(x.sum()), rel=0.05)


def test_judge_learns_every_attribute_and_says_none(tmp_path, one_thread):
    """A short training (the demo's settings are checked by the slow test below)."""
    cfg = SynthConfig(num=600, num_heldout=60, seed=3, image_size=64)
    generate(tmp_path / "train", cfg, progress=False)
    generate(tmp_path / "check", replace(cfg, seed=99, num=120, num_heldout=30), progress=False)
    jcfg = JudgeConfig(epochs=12, batch_size=32, num_nonshapes=300)
    judge, report = build_judge([tmp_path / "train"], 32, jcfg)
    assert (report["train_images"], report["train_nonshapes"]) == (660, 300)
    v = validate_judge(judge, tmp_path / "check", 32, jcfg, autoencode=lambda x: x)  # identity "VAE" = clean
    clean = v["real"]["clean"]
    assert clean["num"] == 150
    assert clean["color"] > 0.9 and clean["position"] > 0.8 and clean["size"] > 0.8, clean
    assert v["real"]["vae"] == clean
    assert v["nonshapes"]["shape_rejected"] > 0.5, v["nonshapes"]
    # shapes without the confidence floor (this short training is not yet confident on them)
    x, labels, _ = load_labelled(tmp_path / "check", 32)
    argmax = verdicts_of_tensor(judge, x, floor=0.0)
    assert np.mean([f == w for f, w in zip(argmax["shape"], labels["shape"])]) > 0.5
    # noise is no shape: almost always "none", so alignment of noise is far under chance
    rng = np.random.default_rng(0)
    noise = [Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)) for _ in range(36)]
    found = verdicts(judge, noise, 32, jcfg.floor)
    assert sum(s != NONE for s in found["shape"]) <= 6, found["shape"]
    assert chance(judge.classes)["both"] == 1 / 36 and chance(judge.classes)["position"] == 1 / 9


@pytest.fixture(scope="module")
def demo_judge_on_fixture(tmp_path_factory):
    """The judge exactly as the demo trains it (recipe tiny-cpu: its synth data and demo.judge), its
    verdicts on tests/fixtures/judge/ (generated images labelled by looking at each) and the labels."""
    from latentforge.recipe import load_recipe

    recipe = load_recipe("tiny-cpu")
    synth = tmp_path_factory.mktemp("demo-judge") / "synth"
    generate(synth, recipe.synth, progress=False)
    judge, _ = build_judge([synth], recipe.ingest.image.resolution, recipe.demo.judge)
    rows = [json.loads(line) for line in (FIXTURE / "labels.jsonl").read_text().splitlines() if line]
    assert len(rows) >= 60
    images = [Image.open(FIXTURE / r["file"]) for r in rows]
    found = verdicts(judge, images, recipe.ingest.image.resolution, recipe.demo.judge.floor)
    wanted = {a: [r[a] for r in rows] for a in ("color", "shape", "size", "position")}
    wrong = [(r["file"], a, found[a][i], r[a]) for i, r in enumerate(rows) for a in wanted
             if r[a] is not None and found[a][i] != r[a]]
    return agreement(found, wanted), wrong


@pytest.mark.slow
@pytest.mark.parametrize("attribute", ["color", "size", "position"])
def test_judge_at_the_demo_settings_agrees_with_labels_assigned_by_eye(demo_judge_on_fixture, attribute):
    counts, wrong = demo_judge_on_fixture
    assert counts[attribute]["right"] >= 0.95 * counts[attribute]["num"], (attribute, counts, wrong)


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason=(
    "measured: the judge at the demo's settings agrees on the shape of 115 of the 126 fixture images (91%, "
    "under 95%): it names a shape for 10 near-misses labelled none (a shield, a blob and X-shaped blobs as "
    "squares, blobs and a smudge as diamonds, a blurred and a clipped round blob as circles, a small "
    "rotated-square blob as a cross) and rejects one circle; see docs/demo.md. Strict: remove this mark "
    "once the judge passes."))
def test_judge_at_the_demo_settings_agrees_with_shapes_assigned_by_eye(demo_judge_on_fixture):
    counts, wrong = demo_judge_on_fixture
    assert counts["shape"]["right"] >= 0.95 * counts["shape"]["num"], (counts, wrong)
