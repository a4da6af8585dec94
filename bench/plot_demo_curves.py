"""Held-out accuracy and position words against U-Net training time, one line per demo run.

    python bench/plot_demo_curves.py OUT.png "LABEL=runs/NAME" ["LABEL=runs/NAME" ...] [--x steps] [--endpoints]

Reads each run's ``results.json`` (its ``curve``: the demo's evaluations during training, 48
held-out images in the caption wording at each point, scored by the judge) and draws held-out
both-right and position words followed against the seconds of U-Net training at each point, with
the final evaluation's figure (96 images, the exported pipeline) as an open marker at the end.
Runs with a validation loss during training (``train.val``, the demo's ``val`` points) get two
more panels: the validation loss and the text gap at the noisiest fixed time, against the same
seconds. ``--x steps`` draws against U-Net steps instead (for levers that leave the step's cost
alone, or runs made on a busy machine, whose seconds measure the load). Prints the points it draws.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_curve(run: Path, x: str = "train_seconds") -> tuple[list[tuple[float, float, float]], dict[str, float]]:
    """((x, held-out both, position) per curve point, the final held-out figures); x is the point's
    ``train_seconds`` or ``step``."""
    results = json.loads((run / "results.json").read_text())
    points = [(p[x], p["heldout_both"], p["heldout_position"]) for p in results["curve"]["points"]]
    caption = results["evaluation"]["splits"]["heldout"]["wordings"]["caption"]
    return points, {"both": caption["both"]["rate"], "position": caption["position"]["rate"]}


ENDPOINTS = (("heldout", "caption"), ("heldout", "new"), ("seen", "caption"), ("seen", "new"))


def read_endpoints(run: Path) -> list[tuple[float, float, float]]:
    """(rate, low, high) of both right per ``ENDPOINTS`` entry: held-out and seen, in the caption
    wording and in the new wordings together, as the run's ``results.json`` gives them."""
    splits = json.loads((run / "results.json").read_text())["evaluation"]["splits"]
    figs = [splits[split]["wordings"]["caption"]["both"] if kind == "caption" else splits[split]["new_wordings"]["both"]
            for split, kind in ENDPOINTS]
    return [(f["rate"], f["lo"], f["hi"]) for f in figs]


def read_val(run: Path, x: str = "train_seconds") -> list[tuple[float, float, float]]:
    """(x, validation loss, text gap at the noisiest fixed time) per validation; [] without."""
    points = json.loads((run / "results.json").read_text()).get("val") or []
    return [(p[x], p["loss"], p["text_gap_by_t"][-1]) for p in points if "text_gap_by_t" in p]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("runs", nargs="+", help="LABEL=RUN_DIR")
    ap.add_argument("--x", choices=("seconds", "steps"), default="seconds", help="the horizontal axis")
    ap.add_argument("--endpoints", action="store_true", help="a panel of the final figures with their intervals")
    args = ap.parse_args()
    xkey, unit, xlabel = (("train_seconds", "s", "U-Net training seconds") if args.x == "seconds"
                         else ("step", "steps", "U-Net steps"))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vals = {spec: read_val(Path(spec.partition("=")[2]), xkey) for spec in args.runs}
    num_panels = 4 if any(vals.values()) else 2
    fig, axs = plt.subplots(1, num_panels + args.endpoints, figsize=(5 * (num_panels + args.endpoints), 3.8))
    for k, spec in enumerate(args.runs):
        label, _, run = spec.partition("=")
        points, final = read_curve(Path(run), xkey)
        print(f"{label}: " + ", ".join(f"{s:.0f} {unit} {b:.0%} (position {p:.0%})" for s, b, p in points)
              + f"; final {final['both']:.0%} (position {final['position']:.0%})")
        for ax, col, key in ((axs[0], 1, "both"), (axs[1], 2, "position")):
            line, = ax.plot([p[0] for p in points], [100 * p[col] for p in points], "o-", ms=4, label=label)
            ax.plot([points[-1][0]], [100 * final[key]], "o", mfc="none", color=line.get_color(), ms=7)
        if args.endpoints:
            ends = read_endpoints(Path(run))
            print(f"{label}: end points " + ", ".join(f"{split} {kind} {r:.1%} [{lo:.0%}-{hi:.0%}]"
                                                      for (split, kind), (r, lo, hi) in zip(ENDPOINTS, ends)))
            off = (k - (len(args.runs) - 1) / 2) * min(0.12, 0.7 / len(args.runs))
            axs[-1].errorbar([j + off for j in range(len(ENDPOINTS))], [100 * r for r, _, _ in ends],
                             yerr=[[100 * max(0.0, r - lo) for r, lo, _ in ends], [100 * max(0.0, hi - r) for r, _, hi in ends]],
                             fmt="o", ms=4, capsize=2, color=line.get_color())
        if vals[spec]:
            print(f"{label}: validation " + ", ".join(f"{s:.0f} {unit} loss {v:.4f} gap {g:.3f}" for s, v, g in vals[spec]))
            for ax, col in ((axs[2], 1), (axs[3], 2)):
                ax.plot([p[0] for p in vals[spec]], [p[col] for p in vals[spec]], ".-", ms=4, color=line.get_color())
    for ax, title in ((axs[0], "held-out combinations, both right (%)"), (axs[1], "position words followed (%)")):
        ax.set_xlabel(xlabel)
        ax.set_title(title, fontsize=10)
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    axs[1].axhline(100 / 9, color="gray", ls=":", lw=1)
    if num_panels == 4:
        for ax, title in ((axs[2], "validation loss (held-out latents, 8 fixed times)"),
                          (axs[3], "text gap at the noisiest time (empty caption - caption)")):
            ax.set_xlabel(xlabel)
            ax.set_title(title, fontsize=10)
            ax.grid(alpha=0.3)
    if args.endpoints:
        ax = axs[-1]
        ax.set_xticks(range(len(ENDPOINTS)))
        ax.set_xticklabels([f"{'held-out' if split == 'heldout' else split}\n{'caption' if kind == 'caption' else 'new wordings'}"
                            for split, kind in ENDPOINTS], fontsize=8)
        ax.axhline(90, color="k", lw=0.8, alpha=0.5)
        ax.axhline(95, color="k", lw=0.8, alpha=0.3, ls="--")
        ax.set_title("final figures, both right (%), 95% intervals", fontsize=10)
        ax.grid(alpha=0.3)
    axs[0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
