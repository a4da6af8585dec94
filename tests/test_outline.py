"""The judge's outline checks (latentforge.evaluate.outline): the labelling rule's circle -- round, filled,
no corners, no hole, roughly as wide as tall, seen at once -- and a star's five clear points, in numbers,
at the recipe's thresholds."""

import numpy as np
import torch

from latentforge.data.synth import BACKGROUNDS, COLORS, POSITIONS, SHAPES, SIZES, render
from latentforge.evaluate.judge import (NONE, Judge, JudgeConfig, blur, circle_rule, load_judge, save_judge, star_rule,
                                        to_tensor, verdicts_of_tensor)
from latentforge.evaluate.nonshapes import nonshape_set
from latentforge.evaluate.outline import coverage, has_star_points, is_circle, measure
from latentforge.recipe import load_recipe

RULE = circle_rule(load_recipe("tiny-cpu").demo.judge)
STAR_RULE = star_rule(load_recipe("tiny-cpu").demo.judge)


def _disc(radius: float, hole: float = 0.0, squash: float = 1.0, side: int = 32, lobes: int = 0,
          depth: float = 0.0) -> np.ndarray:
    """A blue disc (or ring, or ellipse; or a flower whose radius is ``radius`` (1 + ``depth`` cos(``lobes``
    theta))) on a light gray ground, anti-aliased by 8x8 supersampling."""
    s = 8
    yy, xx = (np.mgrid[0:side * s, 0:side * s] + 0.5) / s - side / 2
    r = np.hypot(xx, yy / squash)
    edge = radius * (1 + depth * np.cos(lobes * np.arctan2(yy, xx)))
    cov = ((r <= edge) & (r >= hole)).reshape(side, s, side, s).mean((1, 3))[..., None]
    return 200.0 * (1 - cov) + np.array([30.0, 60.0, 220.0]) * cov


def test_the_recipe_checks_circles_at_the_thresholds_measured_on_renders():
    assert RULE == {"max_corners": 0.115, "min_ratio": 0.8, "max_edge": 1.11}
    assert circle_rule(JudgeConfig()) is None  # off unless asked
    assert circle_rule({"circle_check": True}) == circle_rule(JudgeConfig(circle_check=True))  # a saved config


def test_a_disc_measured_by_hand():
    o = measure(_disc(6.0))
    assert o.ratio > 0.95 and o.corners < 0.05 and 0.5 < o.edge < 1.0 and not o.hole and o.main_share == 1.0
    assert is_circle(o, **RULE)
    ring = measure(_disc(7.0, hole=3.5))
    assert ring.hole and not is_circle(ring, **RULE)
    ellipse = measure(_disc(7.0, squash=0.6))  # 0.6 as tall as wide
    assert 0.5 < ellipse.ratio < 0.7 and not is_circle(ellipse, **RULE)
    assert measure(np.full((32, 32, 3), 128.0)) is None  # nothing stands out
    # the coverage: 1 inside, 0 on the ground, whatever the image's scale
    cov = coverage(_disc(6.0))
    assert cov[16, 16] == 1.0 and cov[2, 2] < 1e-9
    assert np.allclose(coverage(_disc(6.0) / 255.0), cov)


def test_every_clean_render_is_a_circle_exactly_when_it_is_one():
    rng = np.random.default_rng(0)
    for shape in SHAPES:
        for size in SIZES:
            for position in POSITIONS:
                color, background = str(rng.choice(list(COLORS))), str(rng.choice(list(BACKGROUNDS)))
                image = np.asarray(render(shape, color, size, position, background, 32, rng), dtype=float)
                assert is_circle(measure(image), **RULE) == (shape == "circle"), (shape, size, position)


def test_pentagons_hexagons_ellipses_rings_and_blobs_are_not_circles():
    for n in nonshape_set(600, 3, 32):
        if n.kind in ("pentagon", "hexagon", "ellipse", "ring", "blob", "lobed", "stretched", "merged"):
            assert not is_circle(measure(np.asarray(n.image, dtype=float)), **RULE), n.kind


def test_a_blurred_circle_is_no_circle_seen_at_once():
    rng = np.random.default_rng(1)
    x = to_tensor([render("circle", c, s, "center", "dark", 32, rng) for c in COLORS for s in SIZES], 32)
    as_rgb = lambda t: ((t + 1) * 127.5).permute(1, 2, 0).double().numpy()
    assert all(is_circle(measure(as_rgb(t)), **RULE) for t in blur(x, 0.5))
    assert not any(is_circle(measure(as_rgb(t)), **RULE) for t in blur(x, 1.2))  # the judge's strongest blur


def test_the_judge_names_circle_only_where_the_cnn_says_none_and_the_region_is_round(tmp_path):
    torch.manual_seed(0)
    judge = Judge(list(COLORS), list(SHAPES), list(SIZES), list(POSITIONS), width=2).eval()
    rng = np.random.default_rng(2)
    shapes = ["circle", "square", "circle", "star", "diamond", "circle"]
    x = to_tensor([render(s, "red", "large", "center", "light", 32, rng) for s in shapes], 32)
    floor = 0.999999  # an untrained judge is never that sure: every verdict is "none"
    off, named_off = verdicts_of_tensor(judge, x, floor), verdicts_of_tensor(judge, x, 0.0)
    assert off["shape"] == [NONE] * 6 and NONE not in named_off["shape"]
    judge.circle_check = RULE
    on = verdicts_of_tensor(judge, x, floor)
    assert on["shape"] == [s if s == "circle" else NONE for s in shapes]
    assert all(on[a] == off[a] for a in ("color", "size", "position"))  # the other heads untouched
    assert verdicts_of_tensor(judge, x, 0.0) == named_off  # a shape the CNN names stays as it named it
    # saved and loaded: the check comes back from the saved config, and only when it was on
    save_judge(judge, JudgeConfig(width=2, circle_check=True), {}, tmp_path / "on")
    save_judge(judge, JudgeConfig(width=2), {}, tmp_path / "off")
    assert load_judge(tmp_path / "on")[0].circle_check == RULE
    assert load_judge(tmp_path / "off")[0].circle_check is None


def test_the_recipe_checks_stars_at_the_thresholds_measured_on_renders():
    assert STAR_RULE == {"min_points": 0.098, "max_edge": 1.11}
    assert star_rule(JudgeConfig()) is None  # off unless asked
    assert star_rule({"star_check": True}) == star_rule(JudgeConfig(star_check=True))  # a saved config


def test_lobes_measured_by_hand():
    """A flower of radius 8 (1 + d cos(k theta)) has its amplitude at k cycles over its mean radius d."""
    for k, d in ((5, 0.2), (5, 0.08), (4, 0.25), (3, 0.1)):
        o = measure(_disc(8.0, lobes=k, depth=d))
        assert abs(o.lobes[k] - d) < 0.01, (k, d, o.lobes)
        assert max(o.lobes[j] for j in range(1, 9) if j != k) < 0.01  # nothing at the other cycles
        assert abs(o.lobes[0] - 2.0) < 1e-9  # the mean (rfft's zeroth term counted twice)
    star, stub = measure(_disc(8.0, lobes=5, depth=0.2)), measure(_disc(8.0, lobes=5, depth=0.08))
    assert has_star_points(star, **STAR_RULE) and not has_star_points(stub, **STAR_RULE)
    assert not has_star_points(None, **STAR_RULE)


def test_every_clean_star_has_its_points_and_a_pentagon_has_none():
    rng = np.random.default_rng(0)
    for size in SIZES:
        for position in POSITIONS:
            color, background = str(rng.choice(list(COLORS))), str(rng.choice(list(BACKGROUNDS)))
            for image_size in (32, 64):  # as drawn at the judge's size, and as the dataset draws it (64 px, read at 32)
                image = to_tensor([render("star", color, size, position, background, image_size, rng)], 32)[0]
                o = measure(((image + 1) * 127.5).permute(1, 2, 0).double().numpy())
                assert o.lobes[5] >= STAR_RULE["min_points"], (size, position, image_size)  # the points, sharp or not
    for n in nonshape_set(600, 3, 32):
        if n.kind == "pentagon":
            assert not has_star_points(measure(np.asarray(n.image, dtype=float)), **STAR_RULE)


def test_a_blurred_region_keeps_the_cnns_star():
    """Blurred past the rule's sharp edge, a star's outline loses its points whatever it was: not read."""
    rng = np.random.default_rng(1)
    x = to_tensor([render("star", c, "small", "center", "dark", 32, rng) for c in COLORS], 32)
    as_rgb = lambda t: ((t + 1) * 127.5).permute(1, 2, 0).double().numpy()
    blurred = [measure(as_rgb(t)) for t in blur(x, 1.2)]
    assert all(o.lobes[5] < STAR_RULE["min_points"] for o in blurred)  # the points gone at the 0.5 crossing
    assert all(o.edge > STAR_RULE["max_edge"] and has_star_points(o, **STAR_RULE) for o in blurred)


def test_the_judge_names_none_for_a_sharp_star_without_points(tmp_path):
    torch.manual_seed(0)
    judge = Judge(list(COLORS), list(SHAPES), list(SIZES), list(POSITIONS), width=2).eval()
    head = judge.heads["shape"]
    rng = np.random.default_rng(2)
    pentagon = next(n.image for n in nonshape_set(60, 3, 32) if n.kind == "pentagon")
    star = render("star", "red", "small", "center", "light", 32, rng)
    x = to_tensor([star, pentagon, render("cross", "blue", "small", "left", "dark", 32, rng)], 32)
    x = torch.cat([x, blur(x[1:2], 1.2)])  # the pentagon blurred past the sharp edge: not read
    for named, want in (("star", ["star", NONE, NONE, "star"]), ("square", ["square"] * 4)):
        with torch.no_grad():  # a CNN that names one shape for everything
            head.weight.zero_()
            head.bias.zero_()
            head.bias[judge.classes["shape"].index(named)] = 10.0
        judge.star_check = None
        off = verdicts_of_tensor(judge, x, 0.5)
        assert off["shape"] == [named] * 4
        judge.star_check = STAR_RULE
        on = verdicts_of_tensor(judge, x, 0.5)
        assert on["shape"] == want  # the cross has nothing at 5 cycles; only a star verdict is read
        assert all(on[a] == off[a] for a in ("color", "size", "position"))
    # saved and loaded: the check comes back from the saved config, and only when it was on
    save_judge(judge, JudgeConfig(width=2, star_check=True), {}, tmp_path / "on")
    save_judge(judge, JudgeConfig(width=2), {}, tmp_path / "off")
    assert load_judge(tmp_path / "on")[0].star_check == star_rule(JudgeConfig(star_check=True))
    assert load_judge(tmp_path / "off")[0].star_check is None
