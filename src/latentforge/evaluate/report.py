"""The demo's report: a markdown page with the loss curve, grids, scores and timings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence


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


def _ci(r: dict[str, float]) -> str:
    """"54% [44-64] (52/96)": the rate, its 95% interval and the counts; "(27/36, 6 prompts)" when
    the images come from fewer distinct prompts (the interval is then the clustered one)."""
    if not r["num"]:
        return "-"
    k = r.get("prompts", r["num"])
    prompts = f", {k} prompts" if k < r["num"] else ""
    return f"{100 * r['rate']:.0f}% [{100 * r['lo']:.0f}-{100 * r['hi']:.0f}] ({r['right']}/{r['num']}{prompts})"


def _score_row(label: str, sc: dict[str, Any]) -> str:
    return (f"| {label} | {_ci(sc['color'])} | {_ci(sc['shape'])} | **{_ci(sc['both'])}** | {_ci(sc['size'])} | "
            f"{_ci(sc['position'])} |")


_HEAD = ["| prompts | colour | shape | both | size words followed | position words followed |",
         "|---|---|---|---|---|---|"]


def _alignment(ev: dict[str, Any]) -> list[str]:
    ch = ev["chance"]
    lines = ["| split | wording | colour | shape | both | size words followed | position words followed |",
             "|---|---|---|---|---|---|---|"]
    for split, per in ev["splits"].items():
        for wording, sc in per["wordings"].items():
            lines.append(_score_row(f"{split} | {wording}", sc))
        if "new_wordings" in per:
            lines.append(_score_row(f"{split} | **all new wordings**", per["new_wordings"]))
    lines.append(f"| chance | | {_pct(ch['color'])} | {_pct(ch['shape'])} | {_pct(ch['both'])} | {_pct(ch['size'])} | "
                 f"{_pct(ch['position'])} |")
    layout = [f"{split} {wording} {sc['same_layout']['same']}/{sc['same_layout']['prompts']}"
              for split, per in ev["splits"].items() for wording, sc in per["wordings"].items()
              if sc.get("same_layout", {}).get("prompts")]
    if layout:
        lines += ["", "Prompts that leave size or position open, drawn at one size and place in all their images "
                  "(the words chose the layout, not the noise): " + ", ".join(layout) + "."]
    return lines


def _per_combo(ev: dict[str, Any]) -> list[str]:
    lines = []
    for split, per in ev["splits"].items():
        lines += ["", f"**{split}** (all wordings pooled; size and position over the prompts that name them):", "",
                  *_HEAD]
        lines += [_score_row(combo, sc) for combo, sc in per["per_combo"].items()]
    return lines


def _judge_validation(j: dict[str, Any], heldout_combos: Sequence[str] = ()) -> list[str]:
    v = j["validation"]
    members = j.get("members", 1)
    ensemble = f", {members} judges of consecutive seeds whose probabilities are averaged" if members > 1 else ""
    resized = f" + {j['train_resized']} renders of the shapes at other widths" if j.get("train_resized") else ""
    rule = j.get("circle_check")
    checks = (f"; where it says none, a region that meets the labelling rule's circle is a circle: one filled "
              f"region, no corners (its radial profile's amplitude at 4-8 cycles <= {rule['max_corners']} px), "
              f"min/max radius >= {rule['min_ratio']}, edge <= {rule['max_edge']} px" if rule else "")
    star = j.get("star_check")
    if star:
        checks += (f"; where it says star, a sharp region (edge <= {star['max_edge']} px) whose outline lacks the rule's "
                   f"five points (amplitude at 5 cycles a turn < {star['min_points']} of its mean radius) is none")
    trained = (f"trained once in {j['train_seconds']} s by `latentforge demo --pin-judge` on this run's training inputs "
               f"(their SHA-256 the same, {str(j.get('training_sha256'))[:12]}) and pinned (`demo.pinned_judge: {j['pinned']}`), "
               f"validated here in {j.get('validate_seconds', '-')} s" if j.get("pinned") else f"trained in {j['train_seconds']} s")
    lines = [f"The judge: {j['train_images']} real renders + {j['train_nonshapes']} non-shape renders{resized}{ensemble}, "
             f"{trained}; confidence floor {v['floor']}{checks}. The same settings score the samples. "
             "Accuracy per attribute on fresh renders (another seed, both splits; a 'none' verdict counts as wrong):",
             "", "| renders | images | colour | shape | size | position |", "|---|---|---|---|---|---|"]
    names = {"clean": "clean", "blur": "blurred (sigma 1 px)", "down_up": "down-sampled 2x and up-sampled",
             "vae": "through the demo's VAE (the ceiling of any denoiser)"}
    for k, r in v["real"].items():
        lines.append(f"| {names.get(k, k)} | {r['num']} | {_pct(r['color'])} | {_pct(r['shape'])} | {_pct(r['size'])} | "
                     f"{_pct(r['position'])} |")
    off = [(name, v[key]) for name, key in (("between the two sizes", "between_sizes"), ("below the small size", "below_sizes"))
           if key in v]  # fresh shapes at widths no training render of the dataset has
    if off:
        lines += ["", "Fresh shapes of no dataset size (their shape and colour are the answers): "
                  + "; ".join(f"{name} (widths {r['widths'][0]}-{r['widths'][1]} of the side), shape {_pct(r['shape'])}, "
                              f"colour {_pct(r['color'])} of {r['num']}" for name, r in off) + "."]
    ns = v["nonshapes"]
    kinds = ", ".join(f"{k} {_pct(x)}" for k, x in ns["by_kind"].items())
    if ns.get("extra_by_kind"):
        kinds += "; extra kinds: " + ", ".join(f"{k} {_pct(x)}" for k, x in ns["extra_by_kind"].items())
    lines += ["", f"Fresh non-shapes rejected (shape verdict 'none'): {_pct(ns['shape_rejected'])} of {ns['num']} "
              f"({kinds}); two-colour shapes whose colour verdict is 'none': "
              f"{_pct(ns['two_colour_color_rejected']) if ns['two_colour_color_rejected'] is not None else '-'}."]
    if ns.get("color_rejected_by_kind"):
        lines[-1] += (" Colour verdict 'none' on renders with no colour of the six: "
                      + ", ".join(f"{k} {_pct(x)}" for k, x in ns["color_rejected_by_kind"].items()) + ".")
    return lines + _vae_ceiling(v.get("vae_by_shape_size"), heldout_combos)


def _labelled(lab: dict[str, Any] | None) -> list[str]:
    """The judge against images of demo models labelled by eye (``demo.labelled``), per set."""
    if not lab:
        return []
    if lab.get("missing"):
        return ["", f"Labelled images (`demo.labelled`): `{lab['folder']}` not found from the working directory, "
                    "so the judge was not checked against them (run the demo from the repository's root)."]
    lines = ["", f"Against generated images of demo models labelled by eye (`{lab['folder']}`, {lab['labellers']} "
                 "labellers, blind to the prompt, to each other and to every verdict; its README says how they were "
                 "drawn): the judge's verdicts against the labels all labellers gave alike; each labeller's shapes "
                 "against the shapes all the others gave alike (what a person reaches: the bar for the judge's shape "
                 "column); and the images with both the colour and the shape of their prompt right by the judge and "
                 "by the labellers (by all of them in the last column). Where the judge calls more images right than "
                 "the labellers, its figures above read high by about that much on such images.",
             "", "| set | images | colour | shape | size | position | each labeller vs the others: shape | "
                 "both right: judge | each labeller | all labellers |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, f in lab["sets"].items():
        agree = " | ".join(f"{c['right']}/{c['num']}" for c in (f["agreement"][a] for a in ("color", "shape", "size", "position")))
        people = ", ".join(f"{c['shape']['right']}/{c['shape']['num']}" for c in f.get("labeller_vs_rest", [])) or "-"
        for key, g in sorted(f["both_right"].items(), key=lambda kv: (kv[0] != "all", kv[0])):
            label = f"{name}" if key == "all" else f"{name}: {key}"
            cells = f"{agree} | {people}" if key == "all" else " | ".join(["-"] * 5)
            lines.append(f"| {label} | {g['num']} | {cells} | {g['judge']} | {' / '.join(map(str, g['labellers']))} | "
                         f"{g['all_labellers']} |")
    return lines


def _vae_ceiling(by: dict[str, Any] | None, heldout_combos: Sequence[str]) -> list[str]:
    """The shapes the judge names in the VAE's reconstructions, per shape and size, and what that
    bounds on the held-out combinations (what the VAE cannot reconstruct, no denoiser on it draws)."""
    from latentforge.data.synth import SHAPES, SIZES, parse_combo
    from latentforge.evaluate.judge import shape_ceiling

    if not by:
        return []
    cells = ", ".join(f"{shape} {size} {_pct(c['right'] / c['num'])} ({c['right']}/{c['num']})"
                      for shape in SHAPES if shape in by for size in SIZES
                      if (c := by[shape].get(size)) and c["num"])
    lines = ["", f"Shapes the judge names in the VAE's reconstructions, per shape and size: {cells}."]
    bound = shape_ceiling(by, [parse_combo(combo)[1] for combo in heldout_combos])
    if bound is not None:
        lines[-1] += (f" On the held-out combinations, with every size asked equally often, that bounds the shape "
                      f"(and so both-right) figure of any denoiser on this VAE at about **{_pct(bound)}**.")
    return lines


def _curve(curve: dict[str, Any] | None) -> list[str]:
    """The evaluations during training: held-out alignment and judge-space FD against training."""
    if not curve:
        return []
    lines = ["### Quality during training", "",
             "Each evaluation step's checkpoint (EMA weights) draws the same held-out prompts with the same noise "
             "(caption wording); the judge scores them, and the Fréchet distance to real held-out renders is taken in "
             "its feature space. Plots against images, CPU-hours and cost: "
             f"[`run/report/quality.md`](run/report/quality.md).", "",
             "| step | images seen | training s | eval s | images | held-out both right | colour | shape | position "
             "| judge FD | thumbnail FD | texture FD |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in curve["points"]:
        lines.append(f"| {p['step']} | {p['samples_seen']:,} | {p['train_seconds']:.0f} | {p['eval_seconds']:.1f} | "
                     f"{p['num_images']} | {_pct(p['heldout_both'])} | {_pct(p['heldout_color'])} | "
                     f"{_pct(p['heldout_shape'])} | {_pct(p['heldout_position'])} | {p['judge_fd']:.2f} | "
                     f"{p['thumbnail_fd']:.2f} | {p['texture_fd']:.4f} |")
    if Path(curve["report"]).with_name("judge_fd.png").exists():
        lines += ["", "![judge FD during training](run/report/judge_fd.png)"]
    return lines + [""]


def _val(points: list[dict[str, Any]] | None, plot: Path | None = None) -> list[str]:
    """The validation losses during training (``train.val``): per step, and the text gap per fixed time."""
    if not points:
        return []
    first = points[0]
    times = [f"{t:g}" for t in first["times"]]
    gap = "loss_uncond_by_t" in first
    lines = ["### Validation loss during training", "",
             f"The {'EMA ' if first['ema'] else ''}weights denoise the first {first['num_samples']} held-out renders "
             f"(latents of combinations no training caption names) at {len(times)} fixed times ({', '.join(times)}) "
             "with fixed noise; the plain MSE of the training target, the mean over the times"
             + ("; the same with the empty caption, and the text gap (empty caption minus caption: how much the "
                "words help the denoiser) per time." if gap else "."), ""]
    head = ["step", "images seen", "training s", "loss"] + (["empty caption", "text gap"] + [f"gap at {t}" for t in times]
                                                             if gap else [])
    lines += ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for p in points:
        cells = [str(p["step"]), f"{p['samples_seen']:,}", f"{p['train_seconds']:.0f}", f"{p['loss']:.4f}"]
        if gap:
            cells += [f"{p['loss_uncond']:.4f}", f"{p['text_gap']:.4f}"] + [f"{g:.4f}" for g in p["text_gap_by_t"]]
        lines.append("| " + " | ".join(cells) + " |")
    if plot is not None and plot.exists():
        lines += ["", "![validation loss during training](run/report/val_loss.png)"]
    return lines + [""]


def _backbone(options: dict[str, Any]) -> str:
    return "diffusion transformer" if "dit" in options else "U-Net"


def write_report(r: dict[str, Any], out: Path) -> Path:
    ev, vae, tr = r["evaluation"], r["vae"], r["train"]
    has_plot = plot_loss(out / "run", out / "loss.png")
    fd = ev.get("frechet")
    lines = [
        "# latentforge demo report",
        "",
        "The built-in shapes dataset, end to end on this machine: generate -> ingest -> train a VAE from scratch "
        "-> encode -> train the denoiser -> export -> judge -> sample the exported pipeline -> score.",
        "",
        "## Prompt alignment",
        "",
        f"Images from the exported pipeline, loaded with `diffusers.DiffusionPipeline.from_pretrained` (offline), "
        f"{ev['sampler']} {ev['num_steps']} steps, guidance {ev['guidance_scale']}. A judge with a rejection class "
        "names the colour, shape, size and position of every image ('none' when it sees no shape of the set, or is "
        "not confident). Held-out combinations were never seen in training (each colour and each shape was, with "
        "other partners). Wordings: `caption` uses the training caption templates; the others no training caption "
        "uses (see docs/demo.md). Every figure: rate [95% interval] (right/num). The interval is by prompt: the "
        "images of one prompt text count as one cluster (they can be near-copies), Wilson's interval at the "
        "effective number of images (docs/demo.md); where the images come from fewer prompts the count says so.",
        "",
        *_alignment(ev),
        "",
        f"Fréchet distance in the judge's feature space, held-out samples (caption wording) against real held-out "
        f"renders: **{fd['generated_vs_real']:.2f}**; real against real (two disjoint sets of {fd['num']}): "
        f"{fd['real_vs_real']:.2f}. In training-free features: 8x8 thumbnails (colour, size, place) "
        f"{fd['thumbnail_generated_vs_real']:.2f}, real against real {fd['thumbnail_real_vs_real']:.2f}; 4x4 maps "
        f"of fine detail (edges, texture) {fd['texture_generated_vs_real']:.4f}, real against real "
        f"{fd['texture_real_vs_real']:.4f}."
        if fd else "(no Fréchet distance: too few real held-out renders)",
        "",
        "Held-out prompts, caption wording (one row per combination):",
        "",
        "![held-out](samples/heldout.png)",
        "",
        "Seen prompts, caption wording:",
        "",
        "![seen](samples/seen.png)",
        "",
        "The other wordings' grids are `samples/SPLIT-WORDING.png`, each beside the judge's verdicts on every image "
        "(`samples/SPLIT-WORDING.txt`, one line per image in grid order: colour, shape, size, position).",
        "",
        "### Per combination",
        *_per_combo(ev),
        "",
        "### The judge's validation",
        "",
        *_judge_validation(ev["judge"], ev["splits"]["heldout"]["combos"]),
        *_labelled(ev.get("judge_labelled")),
        "",
        "## Training",
        "",
        f"- denoiser ({_backbone(r['options'])}): {tr['steps']} steps, {tr['samples_seen']} samples, median {tr['median_img_per_s']:.0f} img/s"
        f"{_mfu(tr.get('median_mfu'))}, "
        f"final loss {tr['final_loss']:.4f}",
        f"- VAE: {vae['steps']} steps in {vae['train_seconds']} s, held-out PSNR {vae['heldout_psnr']:.2f} dB, "
        f"scaling factor {vae['scaling_factor']:.4f} ({vae.get('latent_scale', 1.0):g} / latent std, stored in the VAE config)",
        f"- ingest: {r['ingest']['written']} of {r['ingest']['seen']} images kept, {r['ingest']['img_per_s']} img/s",
        f"- export: diffusers {r['export'].get('pipeline', 'pipeline')} in `{Path(r['export']['dir']).name}/`; its "
        f"images differ from `latentforge sample` by at most {r['export']['max_abs_pixel_diff'] * 255:.1f}/255 per pixel",
        "",
        "![loss](loss.png)" if has_plot else "(matplotlib not installed: no loss plot)",
        "",
        *_curve(r.get("curve")),
        *_val(r.get("val"), out / "run" / "report" / "val_loss.png"),
        "## Options used",
        "",
        *[f"- {k}: {v}" for k, v in r["options"].items()],
        "",
        "## Time",
        "",
        "Every stage is budgeted in steps or samples; these are the wall times they took here.",
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
