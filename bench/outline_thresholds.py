"""Where the thresholds of the judge's outline checks come from: renders only, never labelled images.

    python bench/outline_thresholds.py --vae runs/demo/vae [--work /tmp/latentforge-outline]

Each threshold of ``demo.judge`` (recipe tiny-cpu) that reads the outline of a region
(:mod:`latentforge.evaluate.outline`) sits halfway between the renders that must pass it and the
nearest renders that must not:

- the circle check: its corners (px) between circles decoded by ``--vae`` (p99) and pentagons and
  hexagons (p1); its radius ratio between decoded circles (p1) and ellipses (p99); its edge width between
  decoded circles (p99) and circles blurred by 1.2 px (p1);
- the star check: a star's amplitude at 5 cycles a turn over its mean radius between pentagons (p99:
  the rule's "pentagon with bumps") and 400 fresh small stars decoded (p1). It reads only sharp regions,
  at the circle check's edge width.

It also prints why there is no such check for crosses: their amplitude at 4 cycles between crosses
morphed halfway into a circle (p99: arms half drawn) and 400 fresh small crosses decoded (p1), and the
least of 400 clean small crosses, which falls under that halfway point.

The circles are the fresh renders the demo validates its judge on (``synth`` at seed + 1000, as
``latentforge demo`` makes ``synth-check``); the small stars and crosses 400 fresh renders each, drawn
as the dataset draws them (``default_rng(11)``) and read at the judge's size; the non-shapes those of
:func:`latentforge.evaluate.nonshapes.nonshape_set` and :func:`~latentforge.evaluate.nonshapes.render_nonshape`.
Prints each derivation and the recipe's value beside it.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from latentforge.data.synth import BACKGROUNDS, COLORS, POSITIONS, generate, render
from latentforge.evaluate.judge import _gaussian_blur, load_labelled, to_tensor
from latentforge.evaluate.nonshapes import nonshape_set, render_nonshape
from latentforge.evaluate.outline import measure
from latentforge.recipe import load_recipe


def _measures(x: torch.Tensor) -> list:
    return [measure(t.permute(1, 2, 0).double().numpy()) for t in x]


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vae", required=True, help="a trained VAE directory (the demo's OUT/vae)")
    ap.add_argument("--work", default="/tmp/latentforge-outline", help="where the fresh renders are written")
    args = ap.parse_args()
    from latentforge.demo import _autoencoder
    from latentforge.models.autoencoder import load_vae

    recipe = load_recipe("tiny-cpu")
    cfg, size = recipe.demo.judge, recipe.ingest.image.resolution
    check = Path(args.work) / "synth-check"
    if not (check / "synth.json").exists():  # as the demo makes it
        generate(check, replace(recipe.synth, seed=recipe.synth.seed + 1000, num=300, num_heldout=60), progress=False)
    x, labels, _ = load_labelled(check, size)
    autoencode = _autoencoder(load_vae(args.vae).eval())

    def row(name: str, passing: float, failing: float, recipe_value: float) -> None:
        print(f"{name:18s} must pass {passing:.3f}  must fail {failing:.3f}  halfway {(passing + failing) / 2:.3f}"
              f"  recipe {recipe_value:.3f}")

    non = nonshape_set(1500, 7919, size)
    polygons = [measure(np.asarray(n.image, np.float64)) for n in non if n.kind in ("pentagon", "hexagon")]
    ellipses = [measure(np.asarray(n.image, np.float64)) for n in non if n.kind == "ellipse"]
    xc = x[[i for i, s in enumerate(labels["shape"]) if s == "circle"]]
    with torch.no_grad():
        circles = _measures(autoencode(xc).clamp(-1, 1))
    blurred = _measures(_gaussian_blur(xc.clone(), 1.2))
    print(f"renders: {len(circles)} decoded circles, {len(polygons)} pentagons and hexagons, {len(ellipses)} "
          f"ellipses, {len(blurred)} blurred circles")
    row("circle corners", _pct([o.corners for o in circles], 99), _pct([o.corners for o in polygons], 1),
        cfg.circle_max_corners)
    row("circle ratio", _pct([o.ratio for o in circles], 1), _pct([o.ratio for o in ellipses], 99),
        cfg.circle_min_ratio)
    row("circle edge", _pct([o.edge for o in circles], 99), _pct([o.edge for o in blurred], 1), cfg.circle_max_edge)

    pentagons = [measure(np.asarray(n.image, np.float64)) for n in non if n.kind == "pentagon"]
    # 400 fresh small stars and crosses each (the validation set holds about 30 of each: too few for a 1st
    # percentile), rendered as the dataset renders them and read at the judge's size
    rng = np.random.default_rng(11)

    def fresh(shape: str) -> tuple[list, list]:
        images = [render(shape, str(rng.choice(list(COLORS))), "small", str(rng.choice(list(POSITIONS))),
                         str(rng.choice(list(BACKGROUNDS))), recipe.synth.image_size, rng) for _ in range(400)]
        xs = to_tensor(images, size)
        with torch.no_grad():
            out = torch.cat([autoencode(xs[i:i + 64]) for i in range(0, len(xs), 64)]).clamp(-1, 1)
        return _measures(xs), _measures(out)

    (_, stars), (clean_crosses, crosses) = fresh("star"), fresh("cross")
    rng = np.random.default_rng(4104)
    morphs = [measure(np.asarray(render_nonshape("morph", "red", ("small", "large")[j % 2], "center",
                                                 list(BACKGROUNDS)[j % len(BACKGROUNDS)], size, rng,
                                                 morph_pair=("circle", "cross")).image, np.float64))
              for j in range(200)]
    print(f"renders: {len(pentagons)} pentagons, {len(stars)} decoded small stars, {len(morphs)} cross-circle "
          f"morphs, {len(crosses)} decoded small crosses")
    row("star points", _pct([o.lobes[5] for o in stars], 1), _pct([o.lobes[5] for o in pentagons], 99),
        cfg.star_min_points)
    print(f"star check edge: the circle check's ({cfg.circle_max_edge:.3f}); recipe {cfg.star_max_edge:.3f}")
    cross_arms = ((_pct([o.lobes[4] for o in crosses], 1) + _pct([o.lobes[4] for o in morphs], 99)) / 2)
    print(f"no cross check: decoded small crosses p1 {_pct([o.lobes[4] for o in crosses], 1):.3f}, half-drawn crosses "
          f"p99 {_pct([o.lobes[4] for o in morphs], 99):.3f}, halfway {cross_arms:.3f}; the least of the clean small "
          f"crosses {min(o.lobes[4] for o in clean_crosses):.3f}")


if __name__ == "__main__":
    main()
