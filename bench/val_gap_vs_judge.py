"""How well the validation loss predicts the judge: one point per finished demo run.

    python bench/val_gap_vs_judge.py RUN_DIR [RUN_DIR ...] [--png OUT.png]

For each run (a demo output directory with ``results.json``): the last validation point's loss
and text gap at the noisiest fixed time (``train.val``: the loss with the empty caption minus the
loss with the caption, at t = 937 of 1,000), and the final evaluation's held-out figures in the
caption wording (position words followed, colour and shape both right). Prints a table sorted by
the gap and the Pearson correlations of the gap with position words and of the loss with held-out
both-right; ``--png`` draws both as scatter plots. Runs without a validation loss are listed as
skipped (and unfinished runs, which have no ``results.json``). The validation loss is computed at every ``train.val.every_steps`` in 1-2 s; the judge's
evaluation needs the exported pipeline and 400 sampled images.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def read_point(run: Path) -> dict | None:
    """The run's last validation point and final held-out figures (caption wording), None if it has none."""
    if not (run / "results.json").is_file():
        return None
    results = json.loads((run / "results.json").read_text())
    val = [p for p in results.get("val") or [] if "text_gap_by_t" in p]
    if not val:
        return None
    caption = results["evaluation"]["splits"]["heldout"]["wordings"]["caption"]
    return {"run": run.name, "step": val[-1]["step"], "loss": val[-1]["loss"], "gap": val[-1]["text_gap_by_t"][-1],
            "position": caption["position"]["rate"], "both": caption["both"]["rate"]}


def pearson(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="demo output directories")
    ap.add_argument("--png", help="write the two scatter plots here")
    args = ap.parse_args()
    points = []
    for run in map(Path, args.runs):
        point = read_point(run)
        if point is None:
            print(f"{run}: skipped (no results.json, or no validation loss in it)")
            continue
        points.append(point)
    if len(points) < 3:
        raise SystemExit("val_gap_vs_judge: need at least 3 runs with a validation loss")
    points.sort(key=lambda p: p["gap"])
    print(f"{'run':14s} {'step':>5s} {'gap t=937':>9s} {'position':>8s} {'val loss':>8s} {'held-out':>8s}")
    for p in points:
        print(f"{p['run']:14s} {p['step']:5d} {p['gap']:9.3f} {p['position']:8.0%} {p['loss']:8.4f} {p['both']:8.0%}")
    r_pos = pearson([p["gap"] for p in points], [p["position"] for p in points])
    r_both = pearson([p["loss"] for p in points], [p["both"] for p in points])
    print(f"{len(points)} runs: Pearson r(text gap at t=937, position words) = {r_pos:.2f}; "
          f"r(validation loss, held-out both right) = {r_both:.2f}")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axs = plt.subplots(1, 2, figsize=(10, 4))
        for ax, x, y, xl, yl, r in ((axs[0], "gap", "position", "text gap at t = 937 (last validation)",
                                     "position words followed (%)", r_pos),
                                    (axs[1], "loss", "both", "validation loss (last validation)",
                                     "held-out both right, caption wording (%)", r_both)):
            ax.scatter([p[x] for p in points], [100 * p[y] for p in points], s=18)
            for p in points:
                ax.annotate(p["run"], (p[x], 100 * p[y]), fontsize=6, xytext=(3, 2), textcoords="offset points")
            ax.set_xlabel(xl)
            ax.set_ylabel(yl)
            ax.set_ylim(0, 100)
            ax.set_title(f"{len(points)} demo runs, Pearson r = {r:.2f}", fontsize=10)
            ax.grid(alpha=0.3)
        axs[0].axhline(100 / 9, color="gray", ls=":", lw=1)
        fig.tight_layout()
        fig.savefig(args.png, dpi=100)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
