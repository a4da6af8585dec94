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
from latentforge.evaluate.stats import wilson_interval

__all__ = ["NEW_WORDINGS", "WORDINGS", "Prompt", "make_prompts", "check_new_wordings", "score", "rate"]

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


def rate(right: int, num: int) -> dict[str, float]:
    """A rate with its 95% Wilson interval."""
    lo, hi = wilson_interval(right, num)
    return {"right": right, "num": num, "rate": right / num if num else float("nan"), "lo": lo, "hi": hi}


def score(prompts: Sequence[Prompt], found: dict[str, list[str]]) -> dict[str, dict[str, float]]:
    """Rates (with intervals) of colour, shape, both, and size / position over the prompts naming them."""
    ok = {a: [getattr(p, a) is not None and found[a][i] == getattr(p, a) for i, p in enumerate(prompts)]
          for a in ATTRIBUTES}
    named = {a: [getattr(p, a) is not None for p in prompts] for a in ATTRIBUTES}
    out = {a: rate(sum(ok[a]), sum(named[a])) for a in ATTRIBUTES}
    out["both"] = rate(sum(c and s for c, s in zip(ok["color"], ok["shape"])), len(prompts))
    return out
