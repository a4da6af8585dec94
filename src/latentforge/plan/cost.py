"""Time and cost of a training run on a GPU cluster, from measured or published throughputs.

The formula, per phase p of a recipe and a cluster of ``n`` GPUs::

    cluster img/s_p = per-GPU img/s_p x n x scaling_efficiency(n)
    GPU-hours       = sum_p samples_p / (3600 x per-GPU img/s_p x scaling_efficiency(n) x goodput)
    wall days       = GPU-hours / n / 24
    cost            = GPU-hours x price per GPU-hour

``per-GPU img/s_p`` is looked up by the phase's image resolution (from ``latentforge bench`` on
the target GPU, or a published figure divided by its GPU count). ``scaling_efficiency(n)`` is
one number, or a few (GPU count, efficiency) points interpolated linearly in log2(GPU count) and
held constant outside them. ``goodput`` is the fraction of paid time that trains (restarts,
checkpoint writes, evaluation and stragglers take the rest); 1.0 by default, so that published
figures, which count training time only, are reproduced as they are.

The precompute (VAE + text encoding, done once per distinct image) costs
``num_images / (3600 x encode img/s per GPU)`` GPU-hours; it scales perfectly with GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from latentforge.errors import Problems, UserError
from latentforge.plan.flops import GPU_PEAK_FLOPS

# Device memory in GB (1e9 bytes) as sold, for the memory planner's "does it fit".
GPU_MEMORY_GB: dict[str, float] = {
    "a100-40g": 40, "a100-80g": 80, "h100-sxm": 80, "h100-pcie": 80, "l40s": 48, "a10g": 24,
    "rtx-4090": 24, "rtx-3090": 24, "v100": 16, "t4": 16,
}

# MosaicML encoded 790M LAION images (their 256 px phase's dataset; the 512 px subset is part of
# it) in 3,784 A100-hours: 790e6 / (3784 x 3600) = 58.0 images per second per A100.
MOSAIC_ENCODE_IMG_PER_S = 790e6 / (3784 * 3600)


def check_gpu(name: str) -> str:
    if name not in GPU_PEAK_FLOPS:
        raise UserError(f"unknown GPU {name!r}: choose one of {', '.join(GPU_PEAK_FLOPS)}")
    return name


@dataclass
class PlanConfig:
    """``latentforge plan``: the cluster, its prices and throughputs (flags override these)."""

    gpu: str = field(default="a100-80g", metadata={"help": f"GPU type, one of {', '.join(GPU_PEAK_FLOPS)}"})
    gpus: list[int] = field(default_factory=lambda: [8], metadata={"help": "GPU counts to plan for"})
    price_per_gpu_hour: float = field(default=2.0, metadata={"help": "price of one GPU-hour in dollars"})
    img_per_s_per_gpu: dict[str, float] = field(default_factory=dict, metadata={
        "help": "training throughput per GPU by image resolution in px (from latentforge bench)"})
    scaling_efficiency: dict[str, float] = field(default_factory=dict, metadata={
        "help": "efficiency in (0, 1] by GPU count, interpolated in log2(GPUs); empty = 1.0"})
    goodput: float = field(default=1.0, metadata={"help": "fraction of paid time spent training, in (0, 1]"})
    num_images: int = field(default=0, metadata={"help": "distinct images to encode once (the precompute); 0 = none"})
    encode_img_per_s_per_gpu: float = field(default=MOSAIC_ENCODE_IMG_PER_S, metadata={
        "help": "encoding throughput per GPU; default 58.0 = MosaicML's 790M images in 3,784 A100-hours"})
    precision: str = field(default="bf16", metadata={"help": "precision of the MFU's peak: bf16, fp16, tf32 or fp32"})
    mfu: float = field(default=0.0, metadata={
        "help": "an assumed model FLOPs utilisation in (0, 1]: each phase's img/s per GPU is then mfu x the GPU's "
                "peak / that phase's FLOPs per image (a patch-masked phase's counted masked), instead of "
                "img_per_s_per_gpu; 0 = use the measured or published throughputs"})

    def validate(self) -> None:
        problems = Problems()
        if self.gpu not in GPU_PEAK_FLOPS:
            problems.add(f"gpu: unknown {self.gpu!r}; choose one of {', '.join(GPU_PEAK_FLOPS)}")
        if not self.gpus or any(n < 1 for n in self.gpus):
            problems.add(f"gpus: every GPU count must be >= 1, got {self.gpus}")
        if not self.price_per_gpu_hour >= 0:
            problems.add(f"price_per_gpu_hour: must be >= 0, got {self.price_per_gpu_hour}")
        for res, v in self.img_per_s_per_gpu.items():
            if not str(res).isdigit() or int(res) < 1 or not v > 0:
                problems.add(f"img_per_s_per_gpu: throughputs must be > 0 at a resolution >= 1, got {res}: {v}")
        for n, e in self.scaling_efficiency.items():
            if not str(n).isdigit() or int(n) < 1 or not 0 < e <= 1:
                problems.add(f"scaling_efficiency: efficiencies must be in (0, 1] at GPU counts >= 1, got {n}: {e}")
        if not 0 < self.goodput <= 1:
            problems.add(f"goodput: must be in (0, 1], got {self.goodput}")
        if self.num_images < 0:
            problems.add(f"num_images: must be >= 0, got {self.num_images}")
        if not self.encode_img_per_s_per_gpu > 0:
            problems.add(f"encode_img_per_s_per_gpu: must be > 0, got {self.encode_img_per_s_per_gpu}")
        if not 0 <= self.mfu <= 1:
            problems.add(f"mfu: must be in (0, 1] (or 0 = use img_per_s_per_gpu), got {self.mfu}")
        if self.precision not in ("bf16", "fp16", "tf32", "fp32"):
            problems.add(f"precision: one of bf16, fp16, tf32, fp32, got {self.precision!r}")
        problems.raise_if_any()


@dataclass
class Phase:
    """One training phase as the planner sees it."""

    name: str
    resolution: int  # image side, px
    samples: int  # training samples (images seen), repeats included
    flops_per_image: float = 0.0  # model FLOPs per training image (0 = unknown: no MFU)


def parse_pairs(text: str, what: str) -> dict[str, float]:
    """``"256:137.5,512:36.3"`` -> ``{"256": 137.5, "512": 36.3}``; a bare number -> ``{"1": number}``
    (keys stay strings, as in a YAML recipe after overrides)."""
    out: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition(":")
        try:
            if not sep:
                out["1"] = float(key)
            else:
                out[str(int(key))] = float(value)
        except ValueError:
            raise UserError(f"{what}: cannot read {item!r}; expected KEY:VALUE pairs like 256:137.5") from None
    if not out:
        raise UserError(f"{what}: empty")
    return out


def scaling_efficiency(points: dict[int, float], num_gpus: int) -> float:
    """Efficiency at ``num_gpus``: linear in log2(GPU count) between the given points, constant
    beyond them; 1.0 without points."""
    if not points:
        return 1.0
    xs = sorted(points)
    if num_gpus <= xs[0]:
        return points[xs[0]]
    if num_gpus >= xs[-1]:
        return points[xs[-1]]
    for lo, hi in zip(xs, xs[1:]):
        if lo <= num_gpus <= hi:
            w = (math.log2(num_gpus) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
            return points[lo] + w * (points[hi] - points[lo])
    raise AssertionError("unreachable")


def throughput_at(table: dict[int, float], resolution: int, phase: str) -> float:
    if resolution not in table:
        have = ", ".join(str(r) for r in sorted(table)) or "none"
        raise UserError(f"phase {phase!r} trains at {resolution} px but no throughput is given for it (have: {have}); "
                        f"give --img-per-sec-per-gpu {resolution}:IMG_PER_S or a bench JSON measured at {resolution} px")
    return table[resolution]


def phase_throughput(p: Phase, cfg: PlanConfig, table: dict[int, float], peak: float) -> float:
    """img/s per GPU of phase ``p``: from ``cfg.mfu`` and its FLOPs per image when an MFU is assumed
    (MFU = img/s x FLOPs per image / peak, solved for img/s), else from the table by resolution."""
    if not cfg.mfu:
        return throughput_at(table, p.resolution, p.name)
    if not p.flops_per_image:
        raise UserError(f"phase {p.name!r}: an assumed MFU needs its FLOPs per image, which were not counted")
    return cfg.mfu * peak / p.flops_per_image


def plan_run(phases: list[Phase], cfg: PlanConfig, num_gpus: int) -> dict[str, Any]:
    """The cost of ``phases`` (+ the precompute) on ``num_gpus`` GPUs: per-phase rows and totals."""
    cfg.validate()
    eff = scaling_efficiency({int(k): v for k, v in cfg.scaling_efficiency.items()}, num_gpus)
    throughputs = {int(k): v for k, v in cfg.img_per_s_per_gpu.items()}
    peak = GPU_PEAK_FLOPS[cfg.gpu].get(cfg.precision) or GPU_PEAK_FLOPS[cfg.gpu]["fp32"]
    rows = []
    for p in phases:
        per_gpu = phase_throughput(p, cfg, throughputs, peak)
        gpu_hours = p.samples / (3600 * per_gpu * eff * cfg.goodput)
        rows.append({
            "phase": p.name, "resolution": p.resolution, "images": p.samples, "img_per_s_per_gpu": per_gpu,
            "mfu": per_gpu * p.flops_per_image / peak if p.flops_per_image else None,
            "cluster_img_per_s": per_gpu * num_gpus * eff, "gpu_hours": gpu_hours,
            "days": gpu_hours / num_gpus / 24, "cost": gpu_hours * cfg.price_per_gpu_hour,
        })
    train_hours = sum(r["gpu_hours"] for r in rows)
    enc_hours = cfg.num_images / (3600 * cfg.encode_img_per_s_per_gpu)
    total = train_hours + enc_hours
    return {
        "gpus": num_gpus, "gpu": cfg.gpu, "scaling_efficiency": eff, "goodput": cfg.goodput, "phases": rows,
        "train": {"images": sum(p.samples for p in phases), "gpu_hours": train_hours,
                  "days": train_hours / num_gpus / 24, "cost": train_hours * cfg.price_per_gpu_hour},
        "precompute": {"images": cfg.num_images, "img_per_s_per_gpu": cfg.encode_img_per_s_per_gpu,
                       "gpu_hours": enc_hours, "days": enc_hours / num_gpus / 24,
                       "cost": enc_hours * cfg.price_per_gpu_hour},
        "total": {"gpu_hours": total, "days": total / num_gpus / 24, "cost": total * cfg.price_per_gpu_hour},
    }


def format_plan(plans: list[dict[str, Any]], cfg: PlanConfig, title: str) -> str:
    """The plans as a text table: one block per GPU count, then a summary line per count."""
    lines = [f"plan: {title}; {cfg.gpu} at ${cfg.price_per_gpu_hour:.2f}/GPU-hour, goodput {cfg.goodput:g}, "
             f"MFU against {cfg.gpu} {cfg.precision} peak"]
    head = (f"{'':>5s} {'phase':14s} {'res':>5s} {'images':>15s} {'img/s/GPU':>10s} {'MFU':>6s} {'eff':>5s} "
            f"{'cluster img/s':>14s} {'GPU-hours':>11s} {'days':>7s} {'cost $':>12s}")
    lines.append(head)
    for plan in plans:
        n = plan["gpus"]
        for r in plan["phases"]:
            mfu = f"{100 * r['mfu']:5.1f}%" if r["mfu"] is not None else f"{'-':>6s}"
            lines.append(f"{n:>5d} {r['phase'][:14]:14s} {r['resolution']:>5d} {r['images']:>15,d} "
                         f"{r['img_per_s_per_gpu']:>10.2f} {mfu} {plan['scaling_efficiency']:>5.3f} "
                         f"{r['cluster_img_per_s']:>14,.0f} {r['gpu_hours']:>11,.0f} {r['days']:>7.2f} "
                         f"{r['cost']:>12,.0f}")
        t, e, tot = plan["train"], plan["precompute"], plan["total"]
        lines.append(f"{n:>5d} {'training':14s} {'':>5s} {t['images']:>15,d} {'':>10s} {'':>6s} {'':>5s} {'':>14s} "
                     f"{t['gpu_hours']:>11,.0f} {t['days']:>7.2f} {t['cost']:>12,.0f}")
        if e["images"]:
            lines.append(f"{n:>5d} {'precompute':14s} {'':>5s} {e['images']:>15,d} {e['img_per_s_per_gpu']:>10.2f} "
                         f"{'':>6s} {'':>5s} {e['img_per_s_per_gpu'] * n:>14,.0f} {e['gpu_hours']:>11,.0f} "
                         f"{e['days']:>7.2f} {e['cost']:>12,.0f}")
        lines.append(f"{n:>5d} {'total':14s} {'':>5s} {'':>15s} {'':>10s} {'':>6s} {'':>5s} {'':>14s} "
                     f"{tot['gpu_hours']:>11,.0f} {tot['days']:>7.2f} {tot['cost']:>12,.0f}")
    return "\n".join(lines)


def plot_plans(plans: list[dict[str, Any]], path: str, title: str) -> None:
    """A PNG of wall days and cost (training + precompute) against the GPU count."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    gpus = [p["gpus"] for p in plans]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((ax1, "days", "wall-clock days"), (ax2, "cost", "cost ($)")):
        ax.plot(gpus, [p["total"][key] for p in plans], "o-", label="total")
        ax.plot(gpus, [p["train"][key] for p in plans], "s--", label="training")
        ax.set_xscale("log", base=2)
        ax.set_xticks(gpus, [str(g) for g in gpus])
        ax.set_xlabel("GPUs")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax1.set_yscale("log")
    ax2.set_ylim(bottom=0)  # cost differences read true to scale
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
