"""``latentforge report RUN_DIR``: quality against training images, GPU-hours and dollars.

Every evaluation that ran during training (``train.eval.every_steps``) left one line in
``RUN/eval.jsonl``: the step, the samples seen, the GPU-hours of training so far (measured wall
time of the training loop x ranks), their price, what the evaluations cost, and the metrics of
each guidance scale. This module draws each metric against those three axes and marks where the
run's own budget ends: its phases' total samples, and the GPU-hours and dollars that the measured
rate gives for them. With a ``plan`` section (a target GPU with a throughput), it adds what the
full recipe would cost on that cluster, as ``latentforge plan`` computes it. The validation loss
(``train.val``, ``RUN/val.jsonl``) gets its own table and plot: the loss and the text gap (empty
caption minus caption) against training images.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from latentforge.errors import UserError
from latentforge.train.validation import VAL_LOG

EVAL_LOG = "eval.jsonl"
REPORT_DIR = "report"
_NOT_METRICS = ("guidance_scale", "num_images", "kid_std")


def run_total_samples(run: Path) -> int:
    """Training images over all phases of the run in ``run`` (its saved config; the world size of
    its newest evaluation, for a global batch given as micro batch x ranks)."""
    from latentforge.train.run_files import load_run_files
    from latentforge.train.trainer import phase_batches, phase_num_steps

    cfg, _ = load_run_files(run)
    world_size = _world_size(run)
    batches = phase_batches(cfg.train, world_size)
    return sum(steps * b[2] for steps, b in zip(phase_num_steps(cfg.train, batches), batches))


def _world_size(run: Path) -> int:
    """The ranks of the run's newest evaluation, else of its newest checkpoint, else 1."""
    if (run / EVAL_LOG).is_file():
        return int(read_evaluations(run)[-1].get("world_size", 1))
    from latentforge.checkpoint import find_latest

    latest = find_latest(run)
    if latest is not None and (latest / "meta.json").is_file():
        return int(json.loads((latest / "meta.json").read_text()).get("world_size", 1))
    return 1


def _read_log(path: Path) -> list[dict[str, Any]]:
    records = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{path}: line {i} is not JSON") from None
        if not (isinstance(record, dict) and all(isinstance(record.get(k), int) for k in ("step", "samples_seen"))):
            raise UserError(f"{path}: line {i} is not a record of the trainer (no integer step and samples_seen)")
        records.append(record)
    return sorted(records, key=lambda r: r["step"])


def read_evaluations(run: Path) -> list[dict[str, Any]]:
    """The records of ``RUN/eval.jsonl`` in step order (one per evaluated step)."""
    path = run / EVAL_LOG
    if not path.is_file():
        raise UserError(f"{run}: no {EVAL_LOG}; evaluations are written during training when train.eval.every_steps "
                        "is set (and the recipe's eval section names the metric models)")
    records = _read_log(path)
    if not records:
        raise UserError(f"{path}: empty; no evaluation has finished yet")
    return records


def read_validations(run: Path) -> list[dict[str, Any]]:
    """The records of ``RUN/val.jsonl`` in step order (one per validation loss); none without it."""
    path = run / VAL_LOG
    return _read_log(path) if path.is_file() else []


def metric_names(records: Sequence[dict[str, Any]]) -> list[str]:
    names: list[str] = []
    for r in records:
        for row in r["rows"]:
            names += [k for k in row if k not in _NOT_METRICS and k not in names]
    return names


def budget_end(records: Sequence[dict[str, Any]], total_samples: int) -> dict[str, float]:
    """Where the run's phases end on each axis: its total samples, and the GPU-hours and dollars at
    the rate measured so far (GPU-hours per sample of the newest evaluation)."""
    last = records[-1]
    end = {"samples_seen": float(total_samples)}
    if last["samples_seen"] > 0:
        per_sample = last["gpu_hours"] / last["samples_seen"]
        end["gpu_hours"] = per_sample * total_samples
        if last.get("dollars") is not None:
            end["dollars"] = end["gpu_hours"] * last["price_per_gpu_hour"]
    return end


_AXES = (("samples_seen", "training images seen"), ("gpu_hours", "GPU-hours of training"),
         ("dollars", "cost of training ($)"))


def plot_metric(records: Sequence[dict[str, Any]], metric: str, end: dict[str, float], path: Path) -> Path:
    """One PNG: ``metric`` against the three axes, one line per guidance scale, the budget's end dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes = [(k, label) for k, label in _AXES if all(r.get(k) is not None for r in records)]
    fig, axs = plt.subplots(1, len(axes), figsize=(4.2 * len(axes), 3.4), squeeze=False)
    scales = sorted({row["guidance_scale"] for r in records for row in r["rows"]})
    for ax, (key, label) in zip(axs[0], axes):
        for g in scales:
            pts = [(r[key], row[metric]) for r in records for row in r["rows"]
                   if row["guidance_scale"] == g and row.get(metric) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, label=f"cfg {g:g}")
        if key in end:
            ax.axvline(end[key], color="gray", ls="--", lw=1)
            ax.annotate("end of budget", (end[key], 1), xycoords=("data", "axes fraction"), rotation=90,
                        va="top", ha="right", fontsize=7, color="gray")
        ax.set_xlabel(label)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    axs[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def quality_table(records: Sequence[dict[str, Any]], metrics: Sequence[str]) -> str:
    head = ["step", "images seen", "GPU-hours", "$", "eval GPU-hours (share)", "cfg"] + list(metrics)
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in records:
        total = r["gpu_hours"] + r["eval_gpu_hours"]
        share = r["eval_gpu_hours"] / total if total > 0 else 0.0
        for row in r["rows"]:
            cells = [str(r["step"]), f"{r['samples_seen']:,}", f"{r['gpu_hours']:.4g}", _fmt(r.get("dollars")),
                     f"{r['eval_gpu_hours']:.3g} ({share:.0%})", f"{row['guidance_scale']:g}"]
            lines.append("| " + " | ".join(cells + [_fmt(row.get(m)) for m in metrics]) + " |")
    return "\n".join(lines) + "\n"


def write_quality_report(run: str | Path, total_samples: int, plan: dict[str, Any] | None = None,
                         out: str | Path | None = None) -> Path:
    """``RUN/report/quality.md`` and one PNG per metric (and the validation loss's, with
    ``RUN/val.jsonl``; a run with only that gets a report of it alone); returns the markdown path."""
    run = Path(run)
    out = Path(out) if out else run / REPORT_DIR
    validations = read_validations(run)
    if validations and not (run / EVAL_LOG).is_file():  # a run with the validation loss only
        out.mkdir(parents=True, exist_ok=True)
        return _write_report(out, [f"# Validation loss: {run.name}", ""] + _plan_lines(plan)
                             + _validation_section(validations, out))
    records = read_evaluations(run)
    metrics = metric_names(records)
    end = budget_end(records, total_samples)
    last = records[-1]
    lines = [f"# Quality against cost: {run.name}", "",
             f"{len(records)} evaluations, the newest at step {last['step']} "
             f"({last['samples_seen']:,} training images, {last['gpu_hours']:.4g} GPU-hours of training"
             + (f", ${last['dollars']:.4g} at ${last['price_per_gpu_hour']:g}/GPU-hour" if last.get("dollars") is not None
                else "") + ").", "",
             f"The run's phases end at {total_samples:,} training images"
             + (f", {end['gpu_hours']:.4g} GPU-hours at the measured rate" if "gpu_hours" in end else "")
             + (f", ${end['dollars']:.4g}" if "dollars" in end else "") + " (dashed lines).", ""]
    lines += _plan_lines(plan) + [quality_table(records, metrics)]
    out.mkdir(parents=True, exist_ok=True)
    for m in metrics:
        png = plot_metric(records, m, end, out / f"{m}.png")
        lines += [f"## {m}", "", f"![{m}]({png.name})", ""]
    if validations:
        lines += _validation_section(validations, out)
    return _write_report(out, lines)


def _plan_lines(plan: dict[str, Any] | None) -> list[str]:
    """What the full recipe costs on the plan's cluster (``latentforge plan``), when there is a plan."""
    if plan is None:
        return []
    t = plan["train"]
    return [f"The full recipe planned on {plan['gpus']} x {plan['gpu']} (`latentforge plan`): "
            f"{t['gpu_hours']:,.0f} GPU-hours, {t['days']:.2f} days, ${t['cost']:,.0f} of training.", ""]


def _write_report(out: Path, lines: list[str]) -> Path:
    path = out / "quality.md"
    path.write_text("\n".join(lines))
    return path


def validation_table(records: Sequence[dict[str, Any]]) -> str:
    """One row per validation: the mean loss over the fixed times and, with ``train.val.unconditional``,
    the same with the empty caption, their difference (the text gap) and the gap at the noisiest time."""
    gap = "text_gap_by_t" in records[-1]
    head = ["step", "images seen", "samples", "loss"]
    if gap:
        head += ["loss, empty caption", "text gap", f"text gap at t = {records[-1]['times'][-1]}"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in records:
        cells = [str(r["step"]), f"{r['samples_seen']:,}", str(r["num_samples"]), f"{r['loss']:.4f}"]
        if gap:
            cells += [f"{r['loss_uncond']:.4f}", f"{r['text_gap']:.4f}", f"{r['text_gap_by_t'][-1]:.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_validation(records: Sequence[dict[str, Any]], path: Path) -> Path:
    """One PNG: the validation loss (with and without the caption) and the text gap at the noisiest
    time, against training images (the loss alone without ``train.val.unconditional``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["samples_seen"] for r in records]
    gap = "text_gap_by_t" in records[-1]
    fig, axs = plt.subplots(1, 2 if gap else 1, figsize=(8.4 if gap else 4.2, 3.4), squeeze=False)
    a = axs[0][0]
    a.plot(x, [r["loss"] for r in records], "o-", ms=3, label="caption")
    a.set_ylabel("validation loss (mean over fixed t)")
    if gap:
        a.plot(x, [r["loss_uncond"] for r in records], "o--", ms=3, label="empty caption")
        a.legend(fontsize=7)
        axs[0][1].plot(x, [r["text_gap_by_t"][-1] for r in records], "o-", ms=3)
        axs[0][1].set_ylabel(f"text gap at t = {records[-1]['times'][-1]}")
    for ax in axs[0]:
        ax.set_xlabel("training images seen")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _validation_section(records: Sequence[dict[str, Any]], out: Path) -> list[str]:
    png = plot_validation(records, out / "val_loss.png")
    last = records[-1]
    return ["## Validation loss", "",
            f"`train.val`: {last['num_samples']} held-out samples denoised at {len(last['times'])} fixed times "
            f"({', '.join(str(t) for t in last['times'])}) with fixed noise, "
            + ("the EMA weights" if last.get("ema") else "the trained weights")
            + ("; the text gap is the loss with the empty caption minus the loss with the caption."
               if "text_gap_by_t" in last else "."), "",
            validation_table(records), f"![validation loss]({png.name})", ""]
