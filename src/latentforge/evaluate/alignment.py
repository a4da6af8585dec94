"""Evaluation prompts with their attributes, and prompt-alignment scores with 95% intervals.

Prompts come in *wordings*: ``caption`` draws a training caption template (:data:`TEMPLATES` of
the built-in dataset, random size, position and background), the others are phrasings that no
training caption uses (:data:`NEW_WORDINGS`; :func:`check_new_wordings` proves it against every
caption the templates can make). Each prompt keeps the attributes it names, so that an image is
scored only on what its prompt asked for: colour and shape always, size and position where named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from latentforge.data.synth import (
    BACKGROUNDS, COLORS, EXTRA_TEMPLATES, PARTIAL_TEMPLATES, POSITIONS, SHAPES, SIZES, TEMPLATES, caption_for,
)
from latentforge.errors import ConfigError
from latentforge.evaluate.judge import ATTRIBUTES
from latentforge.evaluate.stats import clustered_interval

__all__ = ["NEW_WORDINGS", "WORDINGS", "SCORING", "Prompt", "make_prompts", "check_new_wordings", "score", "rate"]

# The version of what :func:`score` reports; a saved evaluation of another version is scored again
# (2: intervals by prompt, and ``same_layout``).
SCORING = 2

# Wordings no training caption uses: {color} {shape} always; {size} and {where} where named.
NEW_WORDINGS: dict[str, str] = {
    "plain": "{color} {shape}",
    "image-of": "an image of a {color} {shape}",
    "draw": "draw a {size} {color} {shape} {where}",
}
WORDINGS = ("caption", *NEW_WORDINGS)


def where_phrase(position: str) -> str:
    """"top left" -> "in the top left", "top" -> "at the top", "left" -> "on the left"."""
    if position in ("top", "bottom"):
        return f"at the {position}"
    if position in ("left", "right"):
        return f"on the {position}"
    return f"in the {position}"


@dataclass(frozen=True)
class Prompt:
    text: str
    wording: str
    color: str
    shape: str
    size: str | None  # None: the prompt does not name a size
    position: str | None  # None: the prompt does not name a position


def make_prompts(combos: Sequence[tuple[str, str]], wording: str, num_per_combo: int, seed: int) -> list[Prompt]:
    """``num_per_combo`` prompts per (colour, shape) combo in combo order; sizes and positions
    cycle through every value (then random), so that each is asked about equally often."""
    if wording not in WORDINGS:
        raise ConfigError(f"demo.wordings: unknown wording {wording!r} (known: {', '.join(WORDINGS)})")
    rng = np.random.default_rng([seed, WORDINGS.index(wording)])
    sizes, positions = list(SIZES), list(POSITIONS)
    out = []
    for color, shape in combos:
        size_order = rng.permutation(np.resize(np.arange(len(sizes)), num_per_combo))
        pos_order = rng.permutation(np.resize(np.arange(len(positions)), num_per_combo))
        for k in range(num_per_combo):
            size, position = sizes[size_order[k]], positions[pos_order[k]]
            if wording == "caption":
                bg = str(rng.choice(list(BACKGROUNDS)))
                text = caption_for(shape, color, size, position, bg, int(rng.integers(len(TEMPLATES))))
                out.append(Prompt(text, wording, color, shape, size, position))
                continue
            template = NEW_WORDINGS[wording]
            text = template.format(color=color, shape=shape, size=size, where=where_phrase(position))
            out.append(Prompt(text, wording, color, shape, size if "{size}" in template else None,
                              position if "{where}" in template else None))
    return out


def check_new_wordings() -> None:
    """Raise if any prompt of a new wording equals a caption the training templates can make."""
    captions = {caption_for(s, c, z, p, b, t) for s in SHAPES for c in COLORS for z in SIZES for p in POSITIONS
                for b in BACKGROUNDS
                for t in range(len(TEMPLATES) + len(PARTIAL_TEMPLATES) + len(EXTRA_TEMPLATES))}
    for name, template in NEW_WORDINGS.items():
        for s in SHAPES:
            for c in COLORS:
                for z in SIZES:
                    for p in POSITIONS:
                        text = template.format(color=c, shape=s, size=z, where=where_phrase(p))
                        if text in captions:
                            raise ConfigError(f"wording {name!r}: {text!r} is a training caption")


def rate(clusters: Sequence[tuple[int, int]]) -> dict[str, float]:
    """A rate with its 95% interval by prompt: ``clusters`` holds (right, num) of the images of each
    distinct prompt, counted as one cluster (:func:`~latentforge.evaluate.stats.clustered_interval`;
    one image a prompt gives Wilson's interval). ``prompts``: the prompts with at least one image;
    ``n_eff``: the effective number of independent images."""
    right, num = sum(c[0] for c in clusters), sum(c[1] for c in clusters)
    lo, hi, n_eff = clustered_interval([c[0] for c in clusters], [c[1] for c in clusters])
    return {"right": right, "num": num, "rate": right / num if num else float("nan"), "lo": lo, "hi": hi,
            "prompts": sum(1 for c in clusters if c[1]), "n_eff": n_eff}


def score(prompts: Sequence[Prompt], found: dict[str, list[str]]) -> dict[str, dict[str, float]]:
    """Rates of colour, shape, both, and size / position over the prompts naming them, each with its
    95% interval by prompt: the images of one prompt text are one cluster (with a fixed prompt the
    noise can move little, and the images are then near-copies, not independent trials).
    ``same_layout``: of the prompts with several images that leave size or position open, how many
    had all their images drawn at one size and place (by the judge), i.e. chosen by the words."""
    ok = {a: [getattr(p, a) is not None and found[a][i] == getattr(p, a) for i, p in enumerate(prompts)]
          for a in ATTRIBUTES}
    ok["both"] = [c and s for c, s in zip(ok["color"], ok["shape"])]
    named = {a: [getattr(p, a) is not None for p in prompts] for a in ATTRIBUTES}
    named["both"] = [True] * len(prompts)
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(p.text, []).append(i)
    out: dict[str, dict[str, float]] = {}
    for a in (*ATTRIBUTES, "both"):
        clusters = [(sum(ok[a][i] for i in idx), sum(named[a][i] for i in idx)) for idx in groups.values()]
        out[a] = rate(clusters)
    open_ = [idx for idx in groups.values()
             if len(idx) > 1 and (prompts[idx[0]].size is None or prompts[idx[0]].position is None)]
    out["same_layout"] = {"prompts": len(open_), "same": sum(
        len({(found["size"][i], found["position"][i]) for i in idx}) == 1 for idx in open_)}
    return out
