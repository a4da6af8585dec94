"""The demo's report: a markdown page with the loss curve, grids, scores and timings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def plot_loss(run: Path, out_png: Path) -> bool:
    """Loss (and img/s) against step from ``metrics.jsonl``; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=110)
    ax.plot(steps, [h["loss"] for h in history], lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return True


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def write_report(r: dict[str, Any], out: Path) -> Path:
    ev, vae, tr = r["evaluation"], r["vae"], r["train"]
    has_plot = plot_loss(out / "run", out / "loss.png")
    ch = ev["chance"]
    rows = [f"| {name} | {', '.join(ev[name]['combos'])} | {ev[name]['num']} | {_pct(ev[name]['color'])} | "
            f"{_pct(ev[name]['shape'])} | **{_pct(ev[name]['both'])}** |" for name in ("heldout", "seen")]
    judge = ev["judge"]["real_accuracy"]
    lines = [
        "# latentforge demo report",
        "",
        "The built-in shapes dataset, end to end on this machine: generate -> ingest -> train a VAE from scratch "
        "-> encode -> train the U-Net -> sample -> judge -> export.",
        "",
        "## Prompt alignment",
        "",
        "A judge classifier (trained on real renders of the dataset) names the colour and the shape of every "
        "generated image; an image is aligned when they match its prompt. Held-out combinations were never "
        "seen in training (each colour and each shape was, with other partners).",
        "",
        "| prompts | combinations | images | colour | shape | both |",
        "|---|---|---|---|---|---|",
        *rows,
        f"| chance | | | {_pct(ch['color'])} | {_pct(ch['shape'])} | {_pct(ch['both'])} |",
        f"| judge on fresh real renders | | {judge['num']} | {_pct(judge['color'])} | {_pct(judge['shape'])} | "
        f"{_pct(judge['both'])} |",
        "",
        "Held-out prompts (one row per combination):",
        "",
        "![held-out](samples/heldout.png)",
        "",
        "Seen prompts:",
        "",
        "![seen](samples/seen.png)",
        "",
        "## Training",
        "",
        f"- U-Net: {tr['steps']} steps, {tr['samples_seen']} samples, median {tr['median_img_per_s']:.0f} img/s"
        f"{_mfu(tr.get('median_mfu'))}, "
        f"final loss {tr['final_loss']:.4f}",
        f"- VAE: {vae['steps']} steps in {vae['train_seconds']} s, held-out PSNR {vae['heldout_psnr']:.2f} dB, "
        f"scaling factor {vae['scaling_factor']:.4f} (1 / latent std, stored in the VAE config)",
        f"- ingest: {r['ingest']['written']} of {r['ingest']['seen']} images kept, {r['ingest']['img_per_s']} img/s",
        f"- export: diffusers StableDiffusionPipeline in `{Path(r['export']['dir']).name}/`; its images differ "
        f"from `latentforge sample` by at most {r['export']['max_abs_pixel_diff'] * 255:.1f}/255 per pixel",
        "",
        "![loss](loss.png)" if has_plot else "(matplotlib not installed: no loss plot)",
        "",
        "## Options used",
        "",
        *[f"- {k}: {v}" for k, v in r["options"].items()],
        "",
        "## Time",
        "",
        "| stage | seconds |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in r["timings_s"].items()],
        f"| **total** | **{r['total_s']}** |",
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def _mfu(mfu: float | None) -> str:
    return "" if mfu is None else f" (MFU {100 * mfu:.1f}% of the device peak)"
