"""The demo's judge and its scores: the judge must recognise unseen renders and say "none" to what
is not a shape of the set (else its scores mean nothing), agree with labels assigned by eye on
generated images, and every rate must carry its interval."""

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from scipy.stats import binomtest, norm
from scipy.stats import t as t_dist

from latentforge.data.synth import COLORS, POSITIONS, SHAPES, SIZES, SynthConfig, TEMPLATES, caption_for, generate
from latentforge.errors import ConfigError, UserError
from latentforge.evaluate import alignment
from latentforge.evaluate.alignment import Prompt, check_new_wordings, make_prompts, score
from latentforge.evaluate.judge import (ATTRIBUTES, NONE, Judge, JudgeConfig, JudgeEnsemble, agreed_labels, agreement,
                                        asked_pair, blur, build_judge, chance, down_up, features, labelled_figures,
                                        load_judge, load_labelled, read_labelled_samples, save_judge, shape_by_size,
                                        shape_ceiling, validate_judge, verdicts, verdicts_of_tensor)
from latentforge.evaluate.nonshapes import EXTRA_NONSHAPE_KINDS, NONSHAPE_KINDS, nonshape_set, resized_set
from latentforge.evaluate.stats import Z_95, clustered_interval, student_t_quantile, wilson_interval

FIXTURE = Path(__file__).parent / "fixtures" / "judge"
SAMPLES = Path(__file__).parent / "fixtures" / "judge-samples"


def test_wilson_interval_matches_scipy_and_a_published_value():
    # Newcombe (1998), Statistics in Medicine 17, Table II, example 81/263: score interval 0.2553-0.3662
    lo, hi = wilson_interval(81, 263)
    assert (round(lo, 4), round(hi, 4)) == (0.2553, 0.3662)
    for k, n in [(0, 10), (10, 10), (48, 96), (3, 7), (95, 96)]:
        ref = binomtest(k, n).proportion_ci(method="wilson")
        assert wilson_interval(k, n) == pytest.approx((ref.low, ref.high), abs=1e-12)
    with pytest.raises(ValueError):
        wilson_interval(5, 4)


def test_student_t_quantile_matches_scipy():
    for df in range(1, 61):
        for prob in (0.95, 0.975):
            z = norm.ppf(prob)
            assert student_t_quantile(z, df) == pytest.approx(t_dist.ppf(prob, df), abs=4e-3 if df == 3 else 1e-3)
    assert student_t_quantile(Z_95, 1) == pytest.approx(t_dist.ppf(0.975, 1), rel=1e-12)  # exact at 1 and 2
    assert student_t_quantile(Z_95, 2) == pytest.approx(t_dist.ppf(0.975, 2), rel=1e-12)
    with pytest.raises(ValueError):
        student_t_quantile(Z_95, 0)


def test_clustered_interval_by_hand_and_its_limits():
    # clusters 3/3, 1/3, 2/3, 0/3: p = 0.5, residuals 1.5, -0.5, 0.5, -1.5 -> variance 4/3 * 5 / 144,
    # n_eff = 0.25 / variance = 5.4; Wilson at n = 5.4 with t(3)'s 97.5% point
    lo, hi, n_eff = clustered_interval([3, 1, 2, 0], [3, 3, 3, 3])
    assert n_eff == pytest.approx(5.4)
    q, n = t_dist.ppf(0.975, 3), 5.4
    half = q / (1 + q * q / n) * math.sqrt(0.25 / n + q * q / (4 * n * n))
    assert (lo, hi) == pytest.approx((0.5 - half, 0.5 + half), abs=2e-3)
    # one image per prompt: exactly Wilson's interval
    assert clustered_interval([1] * 30 + [0] * 6, [1] * 36) == (*wilson_interval(30, 36), 36.0)
    # six prompts of six identical images each: six trials, not 36
    lo, hi, n_eff = clustered_interval([6, 0, 6, 6, 6, 6], [6] * 6)
    assert n_eff == 6.0 and hi - lo > 2 * (wilson_interval(30, 36)[1] - wilson_interval(30, 36)[0])
    assert clustered_interval([6] * 6, [6] * 6) == (*wilson_interval(6, 6), 6.0)  # all right: the 6-trial bound
    # homogeneous clusters (each half right): no between-prompt variance, every image counts
    assert clustered_interval([3, 3, 3], [6, 6, 6])[2] == 18.0
    # clusters that vary less than independent images would (p = 0.5, variance 1/300 < p(1-p)/20): the
    # effective size is capped at the 20 images there are (75 without the cap), and so is the interval
    lo, hi, n_eff = clustered_interval([2, 3, 3, 2], [5, 5, 5, 5])
    assert n_eff == 20.0
    q = t_dist.ppf(0.975, 3)
    half = q / (1 + q * q / 20) * math.sqrt(0.25 / 20 + q * q / (4 * 20 * 20))
    assert (lo, hi) == pytest.approx((0.5 - half, 0.5 + half), abs=2e-3)
    assert clustered_interval([], []) == (0.0, 1.0, 0.0)
    with pytest.raises(ValueError):
        clustered_interval([4], [3])
    with pytest.raises(ValueError):
        clustered_interval([1, 2], [3])


def test_clustered_interval_covers_where_wilson_by_image_does_not():
    # 6 prompts x 6 images, each prompt's images copies of one draw with probability 0.7 (as the demo's
    # wordings without size or position are): Wilson over the 36 images covers p far under 95%
    rng = np.random.default_rng(0)
    p, covered_wilson, covered_clustered, runs = 0.8, 0, 0, 1000
    for _ in range(runs):
        ys = [6 * int(rng.random() < p) if rng.random() < 0.7 else int((rng.random(6) < p).sum()) for _ in range(6)]
        lo, hi = wilson_interval(sum(ys), 36)
        covered_wilson += lo <= p <= hi
        lo, hi, _ = clustered_interval(ys, [6] * 6)
        covered_clustered += lo <= p <= hi
    assert covered_wilson / runs < 0.7
    assert covered_clustered / runs >= 0.95


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
    # so is one that a partial caption (synth.partial_captions) can make
    monkeypatch.setitem(alignment.NEW_WORDINGS, "copy", "a {color} {shape} {where}")
    with pytest.raises(ConfigError, match="is a training caption"):
        check_new_wordings()
    # and one that an extra template (synth.extra_templates) can make
    monkeypatch.setitem(alignment.NEW_WORDINGS, "copy", "there is a {size} {color} {shape} {where}")
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
    assert s["both"]["prompts"] == 3 and s["same_layout"] == {"prompts": 0, "same": 0}


def test_score_counts_the_images_of_one_prompt_as_one_cluster():
    # two prompts, three images each: one drawn right three times at one place, one wrong three times
    # at one place; a third prompt's three images right but at two places
    prompts = [Prompt("red star", "plain", "red", "star", None, None)] * 3 + \
              [Prompt("blue cross", "plain", "blue", "cross", None, None)] * 3 + \
              [Prompt("green circle", "plain", "green", "circle", None, None)] * 3
    found = {"color": ["red"] * 3 + ["blue"] * 3 + ["green"] * 3,
             "shape": ["star"] * 3 + [NONE] * 3 + ["circle"] * 3,
             "size": ["small"] * 3 + ["large"] * 3 + ["small", "small", "large"],
             "position": ["top"] * 3 + ["left"] * 3 + ["center"] * 3}
    s = score(prompts, found)
    both = s["both"]
    assert (both["right"], both["num"], both["prompts"]) == (6, 9, 3)
    lo, hi, n_eff = clustered_interval([3, 0, 3], [3, 3, 3])
    assert (both["lo"], both["hi"], both["n_eff"]) == (lo, hi, n_eff) and n_eff == 3.0
    assert hi - lo > wilson_interval(6, 9)[1] - wilson_interval(6, 9)[0]
    assert s["color"]["prompts"] == 3 and s["size"]["num"] == 0  # no prompt names a size
    assert s["same_layout"] == {"prompts": 3, "same": 2}


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


def test_extra_nonshape_kinds_are_drawn_only_when_asked():
    default = nonshape_set(300, 5, 64)
    assert {x.kind for x in default} <= set(NONSHAPE_KINDS)
    extra = nonshape_set(300, 5, 64, ["sparkle", "egg"])
    assert {"sparkle", "egg"} <= {x.kind for x in extra} <= set(NONSHAPE_KINDS) | set(EXTRA_NONSHAPE_KINDS)
    for x in extra:
        if x.kind in EXTRA_NONSHAPE_KINDS:
            assert (x.shape, x.color is not None, x.size is not None, x.position is not None) == (NONE, True, True, True)
    with pytest.raises(ValueError, match="unknown extra non-shape kind 'spark'"):
        nonshape_set(10, 5, 64, ["spark"])


def test_the_share_of_a_nonshape_kind_can_be_set():
    default = nonshape_set(300, 5, 64)
    same = nonshape_set(300, 5, 64, shares={"hexagon": NONSHAPE_KINDS["hexagon"]})
    assert [np.asarray(x.image).tobytes() for x in default] == [np.asarray(x.image).tobytes() for x in same]
    assert "hexagon" in {x.kind for x in default} and "hexagon" not in {x.kind for x in nonshape_set(300, 5, 64,
                                                                                                 shares={"hexagon": 0})}
    only = nonshape_set(40, 5, 64, shares={k: float(k == "ring") for k in NONSHAPE_KINDS})
    assert {x.kind for x in only} == {"ring"}
    with pytest.raises(ValueError, match="share of non-shape kind 'sparkle'"):  # an extra kind not asked for
        nonshape_set(10, 5, 64, shares={"sparkle": 0.1})
    with pytest.raises(ValueError, match="all 0"):
        nonshape_set(10, 5, 64, shares={k: 0 for k in NONSHAPE_KINDS})


def test_the_size_a_person_reads_from_a_width():
    from latentforge.evaluate.nonshapes import size_of_width

    # the border halfway between the dataset's sizes (0.3 and 0.44 of the side), none within a pixel of it
    assert [size_of_width(w, 32) for w in (0.2, 0.3, 0.33, 0.36, 0.37, 0.39, 0.41, 0.44, 0.6)] == [
        "small", "small", "small", None, None, None, "large", "large", "large"]
    assert size_of_width(0.36, 128) == "small" and size_of_width(0.38, 128) == "large"  # a pixel is narrower
    for widths, size in (((0.25, 0.25), "small"), ((0.37, 0.37), None), ((0.47, 0.47), "large")):
        assert {x.size for x in resized_set(12, 4, 32, widths, sized=True)} == {size}
    assert {x.size for x in resized_set(12, 4, 32, (0.25, 0.25))} == {None}  # not asked: no size answer


def _coverage(image) -> float:
    """Pixels that differ from the gray background: how much of the image a coloured shape covers."""
    return float((np.asarray(image, dtype=float).std(axis=2) > 20).mean())


def test_resized_shapes_keep_their_shape_colour_and_position_and_take_the_width_asked():
    a, b = resized_set(60, 4, 64, (0.22, 0.5)), resized_set(60, 4, 64, (0.22, 0.5))
    assert [np.asarray(x.image).tobytes() for x in a] == [np.asarray(x.image).tobytes() for x in b]
    assert {x.shape for x in a} == set(SHAPES) and all(x.kind == "resized" and x.size is None for x in a)
    assert all(x.color in COLORS and x.position in POSITIONS for x in a)
    # the same draws at two fixed widths: the area grows as the width squared (anti-aliased edges aside)
    small, large = resized_set(24, 4, 64, (0.2, 0.2)), resized_set(24, 4, 64, (0.4, 0.4))
    assert [(x.shape, x.position) for x in small] == [(x.shape, x.position) for x in large]
    ratio = np.mean([_coverage(y.image) / _coverage(x.image) for x, y in zip(small, large)])
    assert 3.4 < ratio < 4.6, ratio


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
    # per shape and size through the "VAE": the same verdicts, counted per cell
    by = v["vae_by_shape_size"]
    assert sum(c["num"] for sizes in by.values() for c in sizes.values()) == 150
    assert sum(c["right"] for sizes in by.values() for c in sizes.values()) == round(clean["shape"] * 150)
    assert v["nonshapes"]["shape_rejected"] > 0.5, v["nonshapes"]
    assert [v[k]["num"] for k in ("between_sizes", "below_sizes")] == [120, 120]  # shapes of no dataset size
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


def test_the_ceiling_per_shape_and_size_and_what_it_bounds():
    labels = {"shape": ["star", "star", "star", "circle", "circle", None], "size": ["small", "large", "large", "small",
                                                                                   "large", "small"]}
    found = ["none", "star", "none", "circle", "circle", "star"]
    by = shape_by_size(found, labels)
    assert by == {"star": {"small": {"right": 0, "num": 1}, "large": {"right": 1, "num": 2}},
                  "circle": {"small": {"right": 1, "num": 1}, "large": {"right": 1, "num": 1}}}
    # sizes asked equally often: star (0 + 1/2) / 2 = 1/4, circle 1; a prompt per combination
    assert shape_ceiling(by, ["star", "circle"]) == pytest.approx((0.25 + 1.0) / 2)
    assert shape_ceiling(by, ["star", "star", "circle"]) == pytest.approx((0.25 + 0.25 + 1.0) / 3)
    assert shape_ceiling(by, ["cross"]) is None and shape_ceiling(by, []) is None


def _tiny_judge(seed: int) -> Judge:
    torch.manual_seed(seed)
    return Judge(list(COLORS), list(SHAPES), list(SIZES), list(POSITIONS), width=2).eval()


def test_an_ensemble_of_one_gives_the_judges_verdicts_and_features():
    judge = _tiny_judge(0)
    x = torch.rand(24, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        top = torch.softmax(judge(x)["shape"], 1).max(1).values.sort().values
    floor = float(top[11] + top[12]) / 2  # half the shape verdicts under the floor: "none"
    alone, one = verdicts_of_tensor(judge, x, floor), verdicts_of_tensor(JudgeEnsemble([judge]), x, floor)
    assert one == alone and 0 < alone["shape"].count(NONE) < 24
    assert torch.equal(features(JudgeEnsemble([judge]), x, 32), features(judge, x, 32))


def test_an_ensemble_averages_its_members_probabilities():
    a, b = _tiny_judge(0), _tiny_judge(1)
    x = torch.rand(8, 3, 32, 32) * 2 - 1
    ensemble = JudgeEnsemble([a, b])
    with torch.no_grad():
        for attr, logits in ensemble(x).items():
            mean = (torch.softmax(a(x)[attr], 1) + torch.softmax(b(x)[attr], 1)) / 2
            assert torch.allclose(torch.softmax(logits, 1), mean, atol=1e-6), attr
    assert torch.equal(features(ensemble, x, 32), features(a, x, 32))  # the first member's space
    # two members each sure of a different shape (probability 0.8): alone each names its shape,
    # together neither passes the floor 0.6 (mean probability 0.4 each)
    shapes = a.classes["shape"]
    for judge, sure in ((a, 0), (b, 1)):
        head = judge.heads["shape"]
        head.weight.data.zero_()
        head.bias.data.fill_(0.0)
        head.bias.data[sure] = float(np.log(0.8 / 0.2 * (len(shapes) - 1)))
    assert verdicts_of_tensor(a, x, 0.6)["shape"] == [shapes[0]] * 8
    assert verdicts_of_tensor(b, x, 0.6)["shape"] == [shapes[1]] * 8
    assert verdicts_of_tensor(ensemble, x, 0.6)["shape"] == [NONE] * 8
    with pytest.raises(ValueError):
        JudgeEnsemble([])


def test_build_judge_trains_an_ensemble_whose_first_member_is_the_single_judge(tmp_path, one_thread):
    generate(tmp_path / "train", SynthConfig(num=64, num_heldout=8, seed=3, image_size=32), progress=False)
    cfg = JudgeConfig(epochs=1, batch_size=32, num_nonshapes=16)
    single, report1 = build_judge([tmp_path / "train"], 32, cfg)
    ensemble, report3 = build_judge([tmp_path / "train"], 32, replace(cfg, ensemble=3))
    assert isinstance(ensemble, JudgeEnsemble) and not isinstance(single, JudgeEnsemble)
    assert (report1["members"], report3["members"]) == (1, 3) and ensemble.classes == single.classes
    first, second, third = (m.state_dict() for m in ensemble.members)
    assert all(torch.equal(first[k], v) for k, v in single.state_dict().items())
    assert not torch.equal(first["heads.shape.weight"], second["heads.shape.weight"])  # other seeds
    assert not torch.equal(second["heads.shape.weight"], third["heads.shape.weight"])
    with pytest.raises(ConfigError, match="ensemble: must be >= 1"):
        JudgeConfig(ensemble=0).validate()


def test_the_trunks_levels_and_pooling(tmp_path):
    """levels=3 adds a strided level (8 -> 4 px: a last feature's field is more than the image); max+mean pools
    the last map both ways (twice the heads' inputs). A saved judge of either kind loads with the same
    outputs, and one saved before these settings existed loads as levels 2, max."""
    x = torch.rand(4, 3, 32, 32) * 2 - 1
    base = _tiny_judge(0)
    assert base.features(x).shape == (4, 8) and (base.levels, base.pool) == (2, "max")
    deep = Judge(list(COLORS), list(SHAPES), list(SIZES), list(POSITIONS), width=2, levels=3, pool="max+mean").eval()
    convs = [m for m in deep.trunk if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 7 and [m.stride[0] for m in convs].count(2) == 3
    with torch.no_grad():
        assert deep.features(x).shape == (4, 16) and deep.heads["shape"].in_features == 16
        xs = torch.linspace(-1, 1, 32).view(1, 1, 1, 32).expand(4, 1, 32, 32)
        ys = torch.linspace(-1, 1, 32).view(1, 1, 32, 1).expand(4, 1, 32, 32)
        last = deep.trunk(torch.cat([x, xs, ys], 1))
        assert last.shape == (4, 8, 4, 4)
        assert torch.equal(deep.features(x), torch.cat([last.amax((2, 3)), last.mean((2, 3))], 1))
    with pytest.raises(ValueError):
        Judge(list(COLORS), list(SHAPES), list(SIZES), list(POSITIONS), width=2, pool="mean")
    for name, judge, cfg in (("deep", deep, JudgeConfig(width=2, levels=3, pool="max+mean")),
                             ("old", base, JudgeConfig(width=2))):
        save_judge(judge, cfg, {}, tmp_path / name)
        if name == "old":  # written before the two settings existed
            meta = json.loads((tmp_path / name / "judge.json").read_text())
            for record in (meta, meta["config"]):
                del record["levels"], record["pool"]
            (tmp_path / name / "judge.json").write_text(json.dumps(meta))
        loaded, _ = load_judge(tmp_path / name, cfg)
        assert (loaded.levels, loaded.pool) == (judge.levels, judge.pool)
        with torch.no_grad():
            assert all(torch.equal(loaded(x)[a], v) for a, v in judge(x).items())


@pytest.mark.parametrize("members", [1, 2])
def test_a_saved_judge_loads_with_the_same_outputs_and_only_for_its_settings(tmp_path, members):
    judges = [_tiny_judge(i) for i in range(members)]
    for i, j in enumerate(judges):  # batch-norm statistics are state too: move them off their defaults
        for m in j.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1, generator=torch.Generator().manual_seed(i))
                m.running_var.uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(i))
    judge = judges[0] if members == 1 else JudgeEnsemble(judges)
    cfg, data = JudgeConfig(width=2, ensemble=members), {"synth": {"seed": 3}}
    save_judge(judge, cfg, {"seconds": 1.5}, tmp_path / "judge", data)
    loaded, report = load_judge(tmp_path / "judge", cfg, data)
    assert report == {"seconds": 1.5} and type(loaded) is type(judge) and loaded.classes == judge.classes
    x = torch.rand(6, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        for a, logits in judge.eval()(x).items():
            assert torch.equal(loaded(x)[a], logits), a
    # another setting or other data: no judge (the caller trains one); nothing saved: no judge
    assert load_judge(tmp_path / "judge", replace(cfg, floor=0.7), data) is None
    assert load_judge(tmp_path / "judge", cfg, {"synth": {"seed": 4}}) is None
    assert load_judge(tmp_path / "nothing", cfg, data) is None
    # a setting the saved record lacks (a field added since) counts as its default, and only then
    newer, defaults = {"synth": {"seed": 3, "added": 0.0}}, {"synth": {"seed": 0, "added": 0.0}}
    assert load_judge(tmp_path / "judge", cfg, newer, defaults) is not None
    assert load_judge(tmp_path / "judge", cfg, {"synth": {"seed": 3, "added": 0.5}}, defaults) is None
    assert load_judge(tmp_path / "judge", cfg, newer) is None  # no defaults given: another record
    meta = json.loads((tmp_path / "judge" / "judge.json").read_text())
    del meta["config"]["floor"]
    (tmp_path / "judge" / "judge.json").write_text(json.dumps(meta))
    assert load_judge(tmp_path / "judge", replace(cfg, floor=JudgeConfig().floor), data) is not None
    assert load_judge(tmp_path / "judge", replace(cfg, floor=0.7), data) is None
    # weights that are not safetensors: refused with the file's name, never unpickled
    torch.save(judge.state_dict(), tmp_path / "judge" / "judge.safetensors")
    with pytest.raises(UserError, match="judge.safetensors: not a readable safetensors file"):
        load_judge(tmp_path / "judge", cfg, data)


def _fixture_rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURE / name).read_text().splitlines() if line]


def test_the_fixtures_three_label_sets_name_the_same_images_with_the_datasets_classes():
    """labels.jsonl (the first labeller; the slow tests count it), labels-second.jsonl and
    labels-third.jsonl (two more labellers, each blind to the others and to every judge verdict):
    every image of the folder once, in the same order, each label a class of the dataset, "none"
    where the rule allows it, or null (not labelled)."""
    sets = [_fixture_rows(f) for f in ("labels.jsonl", "labels-second.jsonl", "labels-third.jsonl")]
    files = sorted(p.name for p in FIXTURE.glob("*.png"))
    assert all([r["file"] for r in rows] == files for rows in sets) and len(files) >= 60
    allowed = {"color": {*COLORS, NONE}, "shape": {*SHAPES, NONE}, "size": set(SIZES), "position": set(POSITIONS)}
    assert all(r[a] is None or r[a] in allowed[a] for rows in sets for r in rows for a in allowed)
    a = {"file": "x.png", "color": "red", "shape": "none", "size": None, "position": "top"}
    b = {"file": "x.png", "color": "red", "shape": "star", "size": "small", "position": "top"}
    assert agreed_labels([a], [b]) == {"color": ["red"], "shape": [None], "size": [None], "position": ["top"]}
    assert agreed_labels([a], [a], [dict(a, position="left")])["position"] == [None]
    with pytest.raises(ValueError, match="same images"):
        agreed_labels(sets[0], sets[1][::-1])


@pytest.fixture(scope="module")
def demo_judge():
    """The demo's judge: recipe tiny-cpu's pinned judge (recipes/judges/tiny-cpu), which the demo scores with where
    its training inputs are the run's; that it is the judge those inputs train is checked below (fast: the inputs'
    SHA-256; slow: the weights, trained again)."""
    from latentforge.demo import _pinned_trained_on, pinned_judge_dir
    from latentforge.recipe import load_recipe

    recipe = load_recipe("tiny-cpu")
    loaded = load_judge(pinned_judge_dir(recipe.demo.pinned_judge), recipe.demo.judge, *_pinned_trained_on(recipe))
    assert loaded is not None, "recipes/judges/tiny-cpu is not at the recipe's settings: `latentforge demo --pin-judge`"
    return loaded[0], recipe


def test_the_shipped_pinned_judge_learned_from_the_inputs_the_recipe_gives(tmp_path):
    """The pinned judge's record names the recipe's judge and synth settings, and the SHA-256 of its training inputs
    (renders, non-shapes, targets) and of its training probe (8 steps) equals what this code draws and trains for the
    recipe now: a change to the renderer, the non-shapes, the targets or the training code that would train another
    judge fails here, as far as the probe's steps show it (then pin again)."""
    from latentforge.demo import _pinned_trained_on, pinned_judge_dir
    from latentforge.evaluate.judge import training_fingerprint
    from latentforge.recipe import load_recipe

    recipe = load_recipe("tiny-cpu")
    d = pinned_judge_dir(recipe.demo.pinned_judge)
    assert d == Path(__file__).parents[1] / "recipes" / "judges" / "tiny-cpu"
    _, report = load_judge(d, recipe.demo.judge, *_pinned_trained_on(recipe))
    generate(tmp_path / "synth", recipe.synth, progress=False)
    assert report["training_sha256"] == training_fingerprint([tmp_path / "synth"], recipe.ingest.image.resolution,
                                                             recipe.demo.judge)
    assert report["train_images"] == recipe.synth.num + recipe.synth.num_heldout


@pytest.mark.slow
def test_the_pinned_judge_is_the_judge_the_recipe_trains_here(tmp_path, demo_judge):
    """Trained again from the recipe on this machine, the judge is the pinned one bit for bit (the judge trains on
    ``demo.judge.threads`` threads; on another CPU, whose kernels may differ in the last bits, this test may fail)."""
    judge, recipe = demo_judge
    generate(tmp_path / "synth", recipe.synth, progress=False)
    again, _ = build_judge([tmp_path / "synth"], recipe.ingest.image.resolution, recipe.demo.judge)
    pinned, trained = judge.state_dict(), again.state_dict()
    assert pinned.keys() == trained.keys()
    assert all(torch.equal(pinned[k], trained[k]) for k in pinned)


@pytest.fixture(scope="module")
def demo_judge_on_fixture(demo_judge):
    """The demo's judge, its verdicts on tests/fixtures/judge/ (generated images labelled by looking at
    each) and the labels."""
    judge, recipe = demo_judge
    rows = _fixture_rows("labels.jsonl")
    assert len(rows) >= 60
    images = [Image.open(FIXTURE / r["file"]) for r in rows]
    found = verdicts(judge, images, recipe.ingest.image.resolution, recipe.demo.judge.floor)
    wanted = {a: [r[a] for r in rows] for a in ("color", "shape", "size", "position")}
    wrong = [(r["file"], a, found[a][i], r[a]) for i, r in enumerate(rows) for a in wanted
             if r[a] is not None and found[a][i] != r[a]]
    return agreement(found, wanted), wrong


@pytest.mark.parametrize("attribute", ["color", "size", "position"])
def test_judge_at_the_demo_settings_agrees_with_labels_assigned_by_eye(demo_judge_on_fixture, attribute):
    counts, wrong = demo_judge_on_fixture
    assert counts[attribute]["right"] >= 0.95 * counts[attribute]["num"], (attribute, counts, wrong)


@pytest.mark.xfail(strict=True, reason=(
    "measured: the judge at the demo's settings (two threads) agrees on the shape of 106-108 of the 126 fixture images "
    "(84-86%, under 95%; 106 in run 38; 115 trained on one thread, 112-115 with ensembles of 3-5 judges, 118 with an "
    "ensemble of three at the demo's settings in run 43, which lost shapes on tests/fixtures/judge-samples): it "
    "names a shape for near-misses that every labeller calls none (blobs as diamonds, squares, crosses and circles); and two "
    "labellers agree with each other on the shape of only 108-118 of 126 (tests/fixtures/judge/README.md, "
    "docs/demo.md). Strict: remove this mark once the judge passes."))
def test_judge_at_the_demo_settings_agrees_with_shapes_assigned_by_eye(demo_judge_on_fixture):
    counts, wrong = demo_judge_on_fixture
    assert counts["shape"]["right"] >= 0.95 * counts["shape"]["num"], (counts, wrong)


def test_the_sample_fixture_holds_four_blind_label_sets_and_where_each_image_comes_from():
    """tests/fixtures/judge-samples/: images of demo models of the shipped recipe and of the wide
    U-Net, drawn at random from their evaluation grids, each labelled by four labellers blind to the
    prompt, to each other and to every verdict (README.md there): every image once, in order, in
    the provenance and in every label set, four different labellers per image, each label a class of
    the dataset, "none" or null."""
    files = sorted(p.name for p in SAMPLES.glob("*.png"))
    prov, label_sets = read_labelled_samples(SAMPLES)
    assert len(files) >= 192 and [r["file"] for r in prov] == files and len(label_sets) == 4
    assert all([r["file"] for r in rows] == files for rows in label_sets)
    assert all(len({rows[i]["labeller"] for rows in label_sets}) == 4 for i in range(len(files)))
    allowed = {"color": {*COLORS, NONE}, "shape": {*SHAPES, NONE}, "size": set(SIZES), "position": set(POSITIONS)}
    assert all(r[a] is None or r[a] in allowed[a] for rows in label_sets for r in rows for a in allowed)
    assert {r["split"] for r in prov} == {"heldout", "seen"} and {r["wording"] for r in prov} >= {"caption", "plain"}
    for r in prov:
        assert asked_pair(r["prompt"]) is not None, r["prompt"]
        assert Image.open(SAMPLES / r["file"]).size == (32, 32)


def test_each_labeller_of_the_sample_fixture_agrees_with_the_others_on_95_percent_of_shapes():
    """The bar the judge is held to is one a person meets: over the fixture, each labeller names the
    shape that all three others gave alike on at least 95% of those images (measured: 765 of 773-784,
    README.md there). Fails if a label file is out of order or a labeller reads the rule another way."""
    prov, label_sets = read_labelled_samples(SAMPLES)
    found = {a: [None] * len(prov) for a in ATTRIBUTES}  # no judge here: only the labellers' figures are read
    figures = labelled_figures(found, prov, label_sets)
    for k in range(len(label_sets)):
        right = sum(f["labeller_vs_rest"][k]["shape"]["right"] for f in figures.values())
        num = sum(f["labeller_vs_rest"][k]["shape"]["num"] for f in figures.values())
        assert num >= 200 and right >= 0.95 * num, (k + 1, right, num)


def test_labelled_figures_count_agreement_and_both_right_per_set_by_hand(tmp_path):
    """Three images of two sets, two labellers: the agreement counts only labels both gave alike, and
    both-right compares the prompt's colour and shape with the judge's and with each labeller's."""
    prov = [{"file": "a.png", "set": "s", "split": "heldout", "wording": "caption", "prompt": "a small red star on the left"},
            {"file": "b.png", "set": "s", "split": "seen", "wording": "plain", "prompt": "blue circle"},
            {"file": "c.png", "set": "t", "split": "heldout", "wording": "draw", "prompt": "draw a green cross at the top"}]
    lab = lambda f, c, s: {"file": f, "color": c, "shape": s, "size": None, "position": "left"}
    first = [lab("a.png", "red", "star"), lab("b.png", "blue", "none"), lab("c.png", "green", "cross")]
    second = [lab("a.png", "red", "star"), lab("b.png", "blue", "circle"), lab("c.png", "green", "none")]
    found = {"color": ["red", "blue", "green"], "shape": ["star", "circle", "cross"], "size": ["small"] * 3,
             "position": ["left", "left", "top"]}
    f = labelled_figures(found, prov, [first, second])
    assert list(f) == ["s", "t"] and f["s"]["num"] == 2 and f["t"]["num"] == 1
    assert f["s"]["agreement"]["shape"] == {"right": 1, "num": 1}  # b.png: the labellers differ, not counted
    assert [c["shape"] for c in f["s"]["agreement_each"]] == [{"right": 1, "num": 2}, {"right": 2, "num": 2}]
    # each labeller against the other: b.png's shapes differ, so each agrees on 1 of 2; a null counts as a disagreement
    assert [c["shape"] for c in f["s"]["labeller_vs_rest"]] == [{"right": 1, "num": 2}] * 2
    assert [c["size"] for c in f["s"]["labeller_vs_rest"]] == [{"right": 0, "num": 0}] * 2
    assert labelled_figures(found, prov, [first])["s"]["labeller_vs_rest"] == []
    assert asked_pair("top right: cyan diamond, small") == ("cyan", "diamond") and asked_pair("a red thing") is None
    assert asked_pair("a red or blue star") is None
    assert f["s"]["agreement"]["size"] == {"right": 0, "num": 0} and f["t"]["agreement"]["position"] == {"right": 0, "num": 1}
    assert f["s"]["both_right"]["all"] == {"num": 2, "judge": 2, "labellers": [1, 2], "all_labellers": 1}
    assert f["s"]["both_right"]["seen, new wordings"] == {"num": 1, "judge": 1, "labellers": [0, 1], "all_labellers": 0}
    assert f["t"]["both_right"]["heldout, new wordings"] == {"num": 1, "judge": 1, "labellers": [1, 0], "all_labellers": 0}
    # the folder form: provenance.jsonl and labels-N.jsonl in the same order, else one line that says so
    (tmp_path / "provenance.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prov))
    (tmp_path / "labels-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first))
    (tmp_path / "labels-2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in second[::-1]))
    with pytest.raises(UserError, match="the label files must list the images of provenance.jsonl in the same order"):
        read_labelled_samples(tmp_path)
    (tmp_path / "labels-2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in second))
    assert read_labelled_samples(tmp_path) == (prov, [first, second])
    with pytest.raises(UserError, match="no labelled images here"):
        read_labelled_samples(tmp_path / "nothing")
    (tmp_path / "provenance.jsonl").write_text("".join(json.dumps(dict(r, prompt="a red thing")) + "\n" for r in prov))
    with pytest.raises(UserError, match="line 1: the prompt 'a red thing' must name one colour and one shape"):
        read_labelled_samples(tmp_path)
    (tmp_path / "labels-1.jsonl").write_text(json.dumps({"file": "a.png", "color": "red"}) + "\n")
    with pytest.raises(UserError, match="labels-1.jsonl: line 1 has no shape, size, position"):
        read_labelled_samples(tmp_path)


def test_the_demo_says_when_its_labelled_images_are_not_there(tmp_path):
    """demo.labelled is a path from the working directory: run from elsewhere, the report says the judge
    was not checked against the labelled images instead of failing; empty: nothing is said."""
    from latentforge.demo import _labelled
    from latentforge.evaluate.report import _labelled as report_lines
    from latentforge.recipe import load_recipe

    recipe = load_recipe("tiny-cpu", [f"demo.labelled={tmp_path / 'elsewhere'}"])
    lab = _labelled(recipe, judge=None)
    assert lab == {"folder": str(tmp_path / "elsewhere"), "missing": True}
    assert "not found from the working directory" in "\n".join(report_lines(lab))
    assert _labelled(load_recipe("tiny-cpu", ["demo.labelled="]), judge=None) is None and report_lines(None) == []


_TINY_JUDGE = ["synth.num=48", "synth.num_heldout=12", "synth.image_size=32", "ingest.image.resolution=32",
               "demo.judge.epochs=1", "demo.judge.num_nonshapes=16", "demo.judge.batch_size=32"]


def test_a_pinned_judge_is_used_only_where_the_run_would_train_the_same_judge(tmp_path, capsys, monkeypatch, one_thread):
    """``latentforge demo --pin-judge DIR`` trains the judge a run of the recipe would train; the run scores with
    it (no training) when its training settings and the SHA-256 of its training inputs are the run's (other scoring
    settings: the same weights, scored at the run's), trains its own and says why when either differs, and stops
    with one line when the pinned directory holds no judge; a rescore at other scoring settings keeps the run's
    weights."""
    from latentforge.cli import main
    from latentforge.demo import _judge, _pinned_judge
    from latentforge.recipe import load_recipe

    pinned = tmp_path / "pinned"
    assert main(["demo", "--pin-judge", str(pinned), "--quiet", *_TINY_JUDGE]) == 0
    recipe = load_recipe("tiny-cpu", [*_TINY_JUDGE, f"demo.pinned_judge={pinned}"])
    out = tmp_path / "run"
    generate(out / "synth", recipe.synth, progress=False)
    judge, report = _pinned_judge(recipe, out)
    assert report["pinned"] == str(pinned)
    trained, _ = build_judge([out / "synth"], 32, recipe.demo.judge)
    x = torch.rand(4, 3, 32, 32) * 2 - 1
    assert all(torch.equal(a, b) for a, b in zip(judge(x).values(), trained.eval()(x).values()))

    # other scoring settings (the floor, the outline checks): the same weights, scored at the run's settings
    scored = load_recipe("tiny-cpu", [*_TINY_JUDGE, f"demo.pinned_judge={pinned}", "demo.judge.floor=0.7",
                                      "demo.judge.star_check=false", "demo.judge.circle_check=true"])
    rescored, rescored_report = _pinned_judge(scored, out)
    assert all(torch.equal(a, b) for a, b in zip(rescored(x).values(), judge(x).values()))
    assert (rescored.star_check, rescored_report["star_check"], rescored_report["floor"]) == (None, None, 0.7)
    assert rescored.circle_check == rescored_report["circle_check"] and rescored.circle_check["min_ratio"] == 0.8
    assert judge.star_check is not None  # the recipe's own: on
    # other training settings: the run trains its own
    assert _pinned_judge(load_recipe("tiny-cpu", [*_TINY_JUDGE, f"demo.pinned_judge={pinned}", "demo.judge.lr=0.001"]),
                         out) is None
    assert "other demo.judge or synth settings" in capsys.readouterr().err
    # the same settings, other renders (this run's synth drawn by another seed): its inputs' hash differs
    other = tmp_path / "other"
    generate(other / "synth", replace(recipe.synth, seed=recipe.synth.seed + 1), progress=False)
    assert _pinned_judge(recipe, other) is None
    assert "learned from other inputs" in capsys.readouterr().err
    # the same settings and renders, other training code (here: no augmentation): the probe's weights differ
    import latentforge.evaluate.judge as judge_module
    from latentforge.evaluate.judge import training_fingerprint

    fingerprint = training_fingerprint([out / "synth"], 32, recipe.demo.judge)
    assert fingerprint == report["training_sha256"]
    with monkeypatch.context() as m:
        m.setattr(judge_module, "_augment", lambda x, cfg, g: (x, torch.zeros(len(x), dtype=torch.bool)))
        assert training_fingerprint([out / "synth"], 32, recipe.demo.judge) != fingerprint
        assert _pinned_judge(recipe, out) is None
    assert "learned from other inputs" in capsys.readouterr().err
    # none there: one line
    with pytest.raises(UserError, match="no judge in"):
        _pinned_judge(load_recipe("tiny-cpu", [*_TINY_JUDGE, f"demo.pinned_judge={tmp_path / 'none'}"]), out)
    assert _pinned_judge(load_recipe("tiny-cpu", [*_TINY_JUDGE, "demo.pinned_judge="]), out) is None
    # a damaged record: one line that says how to mend a pinned judge (pin it again), or a run's own (delete it)
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(pinned, damaged)
    (damaged / "judge.json").write_text('{"config": {}}')
    with pytest.raises(UserError, match=r"judge.json: not a judge record \(no classes, members, width, report\); "
                                        r"write it again with `latentforge demo --pin-judge .*damaged`"):
        _pinned_judge(load_recipe("tiny-cpu", [*_TINY_JUDGE, f"demo.pinned_judge={damaged}"]), out)
    (damaged / "judge.json").write_text("{")
    with pytest.raises(UserError, match=r"judge.json: not valid JSON .*; delete .*damaged to train the judge again"):
        load_judge(damaged)
    record = json.loads((pinned / "judge.json").read_text())  # a record of another width beside the weights
    (damaged / "judge.json").write_text(json.dumps({**record, "width": 2 * int(record["width"])}))
    with pytest.raises(UserError, match=r"judge.safetensors: its weights do not fit the judge of .*damaged/judge.json "
                                        r"\(size mismatch for [^\n]*\); delete .*damaged to train the judge again$"):
        load_judge(damaged)
    assert main(["demo", "--pin-judge", str(pinned), "--rescore", "2"]) == 2
    assert "give one" in capsys.readouterr().err

    # the demo's judge stage: the pinned judge validated on the run's fresh renders and its VAE, saved with the run
    from latentforge.evaluate.report import _judge_validation
    from tiny_models import make_tiny_vae

    generate(out / "synth-check", replace(recipe.synth, seed=recipe.synth.seed + 1000, num=24, num_heldout=12),
             progress=False)
    staged, staged_report = _judge(recipe, out, make_tiny_vae(tmp_path / "vae"))
    assert staged_report["pinned"] == str(pinned) and staged_report["validation"]["real"]["vae"]["num"] == 36
    assert all(torch.equal(a, b) for a, b in zip(staged(x).values(), trained(x).values()))
    assert load_judge(out / "judge") is not None
    assert "--pin-judge" in "\n".join(_judge_validation(staged_report))

    # a rescore at other scoring settings (the floor, the checks) keeps the run's weights, validated at its settings
    monkeypatch.setattr("latentforge.evaluate.judge.build_judge", lambda *a, **k: pytest.fail("trained a judge"))
    rescoring = load_recipe("tiny-cpu", [*_TINY_JUDGE, "demo.pinned_judge=", "demo.judge.floor=0.7",
                                         "demo.judge.star_check=false"])
    again, again_report = _judge(rescoring, out, tmp_path / "vae", tmp_path / "rescore-judge")
    assert all(torch.equal(a, b) for a, b in zip(again(x).values(), staged(x).values()))
    assert (again.star_check, again_report["floor"], again_report["validation"]["floor"]) == (None, 0.7, 0.7)
    assert load_judge(tmp_path / "rescore-judge", rescoring.demo.judge) is not None
    assert load_judge(out / "judge", recipe.demo.judge)[0].star_check is not None  # the run's own, untouched


@pytest.fixture(scope="module")
def demo_judge_on_samples(demo_judge):
    """The demo's judge against the labels all four labellers gave on tests/fixtures/judge-samples/."""
    judge, recipe = demo_judge
    prov, label_sets = read_labelled_samples(SAMPLES)
    found = verdicts(judge, [Image.open(SAMPLES / r["file"]) for r in prov], recipe.ingest.image.resolution,
                     recipe.demo.judge.floor)
    return agreement(found, agreed_labels(*label_sets))


@pytest.mark.parametrize("attribute", ["color", "size", "position"])
def test_judge_agrees_with_all_labellers_on_the_demo_models_images(demo_judge_on_samples, attribute):
    counts = demo_judge_on_samples
    assert counts[attribute]["right"] >= 0.95 * counts[attribute]["num"], (attribute, counts)


@pytest.mark.xfail(strict=True, reason=(
    "measured (tests/fixtures/judge-samples/README.md): the judge agrees on the shape with the labels all four "
    "labellers gave on 722 of 765 images (94.4%, with its circle check since run 39 and its star check since run 41; "
    "715 without the star check; each labeller with the other three's on 765 of 773-784, 97.6-99%): 148 of 164 of run "
    "31's recipe's three demo models, 173 of 183 of the recipe's since run 37 on the fixture's first cells, 246 of 260 on "
    "other cells of its seed-0 model, 67 of 67 of star and cross prompts of its three models, 88 of 91 of the wide U-Net's. "
    "It mostly names a diamond or a cross for lumpy and teardrop shapes and four-pointed concave stars that the labellers "
    "call none (a cross's arms cannot be read as a star's points are: a clean small cross reads as low as a stubby one), "
    "and calls none discs whose outlines have more corner than its circle check allows (0.13-0.22 px; 5 of the 8 on "
    "the first 613 images mid-sized and slightly square, their corner at 4 cycles a turn, where irregular blob renders "
    "start at 0.16). Strict: remove this mark once the judge passes."))
def test_judge_agrees_with_all_labellers_on_the_shapes_of_the_demo_models_images(demo_judge_on_samples):
    counts = demo_judge_on_samples
    assert counts["shape"]["right"] >= 0.95 * counts["shape"]["num"], counts


def test_the_judge_does_not_depend_on_the_callers_thread_count(tmp_path):
    """Its weights depend on the thread count it trains with (another reduction order: here one and
    two threads differ by 1e-7 after these two epochs, and by 7 fixture shapes at the demo's
    settings), so it trains on ``threads`` whatever the caller set, and the caller's comes back."""
    generate(tmp_path / "train", SynthConfig(num=64, num_heldout=8, seed=3, image_size=32), progress=False)
    cfg = JudgeConfig(epochs=2, batch_size=32, num_nonshapes=16, threads=2)
    before = torch.get_num_threads()
    weights = []
    try:
        for caller in (1, 2):
            torch.set_num_threads(caller)
            judge, _ = build_judge([tmp_path / "train"], 32, cfg)
            assert torch.get_num_threads() == caller
            weights.append(judge.state_dict())
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(weights[0][k], v) for k, v in weights[1].items())
    with pytest.raises(ConfigError, match="threads: must be >= 1"):
        JudgeConfig(threads=0).validate()
