"""The judge's circle check (latentforge.evaluate.outline): the labelling rule's circle -- round, filled,
no corners, no hole, roughly as wide as tall, seen at once -- in numbers, at the recipe's thresholds."""

import numpy as np
import torch

from latentforge.data.synth import BACKGROUNDS, COLORS, POSITIONS, SHAPES, SIZES, render
from latentforge.evaluate.judge import (NONE, Judge, JudgeConfig, blur, circle_rule, load_judge, save_judge, to_tensor,
                                        verdicts_of_tensor)
from latentforge.evaluate.nonshapes import nonshape_set
from latentforge.evaluate.outline import coverage, is_circle, measure
from latentforge.recipe import load_recipe

RULE = circle_rule(load_recipe("tiny-cpu").demo.judge)


def _disc(radius: float, hole: float = 0.0, squash: float = 1.0, side: int = 32) -> np.ndarray:
    """A blue disc (or ring, or ellipse) on a light gray ground, anti-aliased by 8x8 supersampling."""
    s = 8
    yy, xx = (np.mgrid[0:side * s, 0:side * s] + 0.5) / s - side / 2
    r = np.hypot(xx, yy / squash)
    cov = ((r <= radius) & (r >= hole)).reshape(side, s, side, s).mean((1, 3))[..., None]
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
