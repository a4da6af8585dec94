"""Prompt alignment on the built-in dataset: a small judge of colour, shape, size and position
that can say "none".

The judge is a small CNN with four heads: colour (the six colours), shape (the six shapes plus
an explicit rejection class ``"none"``), size (small/large) and position (the nine grid cells).
It trains on the real renders of the built-in dataset (both splits: it is an instrument, not part
of the generative model, and seeing every combination keeps it unbiased on the held-out ones) and
on renders of what is *not* a shape of the set (:mod:`latentforge.evaluate.nonshapes`: ellipses,
pentagons, hexagons, blobs, lobed shapes, rings, merged and broken shapes, the near-misses of a
denoiser -- keyholes, squeezed, warped and halfway shapes, shields, arrowheads, two shapes apart --
shapes and blobs in two colours or in gray, empty backgrounds), so that a blob is rejected instead
of counted as the nearest shape. Training images are degraded as decoded samples are (blur,
down-sampling then up-sampling, a halo at the edges, noise, a small colour shift), and a few are
blurred past recognition with the shape answer "none". A verdict whose softmax confidence is
under ``floor`` is ``"none"`` as well. With ``circle_check``, a shape verdict "none" whose image
meets the labelling rule's circle in numbers (:mod:`latentforge.evaluate.outline`) is "circle"; with
``star_check``, a verdict "star" whose sharp region lacks the rule's five points in numbers is "none".

:func:`validate_judge` measures it on fresh renders (another seed), clean and degraded (blurred,
down/up-sampled, passed through an autoencoder), and on fresh non-shapes; the evaluation must use
the judge at the settings that were validated (one :class:`JudgeConfig`).
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from tqdm import tqdm

from latentforge.checkpoint import load_weights
from latentforge.config import with_defaults
from latentforge.data.synth import COLORS, POSITIONS, SHAPES, SIZES
from latentforge.errors import Problems, UserError

NONE = "none"  # the verdict of a rejected or unsure attribute
ATTRIBUTES = ("color", "shape", "size", "position")
_IGNORE = -100  # no label: the loss skips it
_UNIFORM = -1  # no right answer (two colours, an empty image): the target is the uniform distribution
POOLS = ("max", "max+mean")  # how the trunk's last feature map is pooled for the heads


@dataclass
class JudgeConfig:
    """How the judge is trained and when it answers "none". Validation and evaluation share it."""

    epochs: int = field(default=6, metadata={"help": "passes over the training renders"})
    batch_size: int = field(default=64, metadata={"help": "images per step"})
    lr: float = field(default=3e-3, metadata={"help": "AdamW learning rate (cosine to 5%)"})
    width: int = field(default=16, metadata={"help": "channels of the first conv (x2, x4 deeper)"})
    levels: int = field(default=2, metadata={
        "help": "strided levels of the trunk: 2 = 32 -> 16 -> 8 px (a last feature sees 21 px), 3 = down to 4 px "
                "(its field is 45 px, more than the image: each sees 23-32 px of a side, clipped at the border)"})
    pool: str = field(default="max", metadata={
        "help": "how the last feature map is pooled: max (whether a pattern is anywhere) or max+mean (and how much)"})
    num_nonshapes: int = field(default=1500, metadata={
        "help": "renders of non-shapes (rejection class) added to the real renders"})
    extra_nonshapes: list[str] = field(default_factory=list, metadata={
        "help": "non-shape kinds drawn besides the default ones, at their shares (latentforge.evaluate.nonshapes."
                "EXTRA_NONSHAPE_KINDS: sparkle, egg)"})
    num_resized: int = field(default=0, metadata={
        "help": "renders of the six shapes at any width in resized_widths (their shape is the answer, their size "
                "none), added to the real renders: a denoiser draws shapes between and beyond the dataset's two sizes"})
    resized_widths: list[float] = field(default_factory=lambda: [0.32, 0.41], metadata={
        "help": "[low, high] width of the resized renders, a fraction of the side (the dataset's small shapes span "
                "0.28-0.32, its large ones 0.40-0.48)"})
    resized_sizes: bool = field(default=False, metadata={
        "help": "give the resized renders the size a person reads from their width (small or large by the border "
                "halfway between the dataset's two sizes, none within 1 px of it) instead of no size answer"})
    kind_shares: dict[str, float] = field(default_factory=dict, metadata={
        "help": "share of a non-shape kind in place of its default (latentforge.evaluate.nonshapes.NONSHAPE_KINDS, "
                "or an extra kind); 0 = never drawn. Empty: the default shares"})
    circle_check: bool = field(default=False, metadata={
        "help": "where the CNN says none, name the shape a circle when its region meets the labelling rule's "
                "circle in numbers (latentforge.evaluate.outline: one filled region, no corners, roughly as wide as "
                "tall, a sharp edge; the thresholds below)"})
    circle_max_corners: float = field(default=0.115, metadata={
        "help": "largest amplitude (px) of the region's radial profile at 4-8 cycles a turn (a pentagon or a "
                "hexagon has its corners there)"})
    circle_min_ratio: float = field(default=0.8, metadata={"help": "smallest over largest radius of the region"})
    circle_max_edge: float = field(default=1.11, metadata={
        "help": "median width (px) of the region's edge, coverage 0.75 to 0.25 (a shape blurred past recognition "
                "has a wide one)"})
    star_check: bool = field(default=False, metadata={
        "help": "where the CNN names a star, the verdict is none when its region is sharp and lacks the labelling "
                "rule's points in numbers (latentforge.evaluate.outline.has_star_points: the radial profile's "
                "amplitude at 5 cycles a turn over its mean radius under star_min_points; a pentagon with bumps)"})
    star_min_points: float = field(default=0.098, metadata={
        "help": "a star's smallest amplitude at 5 cycles a turn over its mean radius"})
    star_max_edge: float = field(default=1.11, metadata={
        "help": "the star check reads only sharp regions: one whose median edge width (px, coverage 0.75 to 0.25) "
                "is wider keeps the CNN's verdict (a blurred star's points fade at the outline)"})
    floor: float = field(default=0.6, metadata={
        "help": "confidence floor: a verdict whose softmax probability is lower is 'none'"})
    blur_prob: float = field(default=0.4, metadata={"help": "share of training images blurred (sigma 0.5-1.2 px)"})
    resample_prob: float = field(default=0.3, metadata={
        "help": "share of training images down-sampled 2x and up-sampled again"})
    smear_prob: float = field(default=0.0, metadata={
        "help": "share of training images blurred past recognition (sigma 1.8-2.6 px): their shape answer is "
                "'none', their colour, size and position stay (a blurred blob still has them)"})
    halo_prob: float = field(default=0.3, metadata={
        "help": "share of training images given a halo (an overshoot at the edges, as decoded samples have)"})
    noise_std: float = field(default=0.06, metadata={"help": "largest std of added noise, in [-1, 1] units"})
    seed: int = field(default=0, metadata={"help": "initialisation, augmentation and non-shape seed"})
    ensemble: int = field(default=1, metadata={
        "help": "judges trained with seeds seed, seed+1, ... (each its own initialisation, augmentation and "
                "non-shapes) whose softmax probabilities are averaged before the floor; 1 = one judge. "
                "Training time grows in proportion"})
    threads: int = field(default=1, metadata={
        "help": "intra-op threads the judge trains with, whatever the machine has: its weights depend on the "
                "thread count (another reduction order), so a fixed count gives every machine of the same "
                "kind the same judge"})

    def validate(self) -> None:
        problems = Problems()
        if not 0.0 <= self.floor < 1.0:
            problems.add(f"floor: must be in [0, 1), got {self.floor}")
        for name in ("blur_prob", "resample_prob", "halo_prob", "smear_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                problems.add(f"{name}: must be in [0, 1], got {getattr(self, name)}")
        for name in ("epochs", "batch_size", "width", "threads", "levels"):
            if getattr(self, name) < 1:
                problems.add(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.pool not in POOLS:
            problems.add(f"pool: must be one of {', '.join(POOLS)}, got {self.pool!r}")
        if self.ensemble < 1:
            problems.add(f"ensemble: must be >= 1, got {self.ensemble}; 1 = one judge")
        from latentforge.evaluate.nonshapes import EXTRA_NONSHAPE_KINDS, NONSHAPE_KINDS

        for k in self.extra_nonshapes:
            if k not in EXTRA_NONSHAPE_KINDS:
                problems.add(f"extra_nonshapes: unknown kind {k!r} (known: {', '.join(EXTRA_NONSHAPE_KINDS)})")
        if self.num_resized < 0:
            problems.add(f"num_resized: must be >= 0, got {self.num_resized}; 0 = none")
        if len(self.resized_widths) != 2 or not 0.05 <= self.resized_widths[0] <= self.resized_widths[1] <= 0.9:
            problems.add(f"resized_widths: must be [low, high] with 0.05 <= low <= high <= 0.9, got {self.resized_widths}")
        for k, v in self.kind_shares.items():
            if k not in NONSHAPE_KINDS and k not in self.extra_nonshapes:
                problems.add(f"kind_shares: {k!r} is not a non-shape kind drawn (known: {', '.join(NONSHAPE_KINDS)}, "
                             f"and the extra_nonshapes)")
            elif not isinstance(v, (int, float)) or v < 0:
                problems.add(f"kind_shares: the share of {k!r} must be a number >= 0, got {v!r}")
        for name in ("circle_max_corners", "circle_max_edge", "star_max_edge"):
            if not getattr(self, name) > 0:
                problems.add(f"{name}: must be > 0 (px), got {getattr(self, name)}")
        if not 0.0 < self.circle_min_ratio <= 1.0:
            problems.add(f"circle_min_ratio: must be in (0, 1], got {self.circle_min_ratio}")
        if not 0.0 < self.star_min_points < 1.0:
            problems.add(f"star_min_points: must be in (0, 1) (an amplitude over the mean radius), got {self.star_min_points}")
        if self.num_nonshapes < 0:
            problems.add(f"num_nonshapes: must be >= 0, got {self.num_nonshapes}; 0 = no non-shape images")
        if not self.lr > 0:
            problems.add(f"lr: must be > 0, got {self.lr}")
        if not self.noise_std >= 0:
            problems.add(f"noise_std: must be >= 0 (0 = no added noise), got {self.noise_std}")
        if self.seed < 0:
            problems.add(f"seed: must be >= 0, got {self.seed}")
        problems.raise_if_any()


class Judge(nn.Module):
    """Four heads on a conv trunk: a conv at full resolution, then a strided conv and a conv for each
    of ``levels`` levels (2, the default: 32 -> 16 -> 8 px, five convs, about 70k parameters at width
    16, and a last feature sees 21 px; 3: down to 4 px, where a last feature's field, 45 px, is more than
    the image and each sees 23-32 px of a side, clipped at the border). Two coordinate
    channels beside RGB let the globally pooled features carry where the shape is; ``pool`` "max" asks
    whether a pattern is anywhere, "max+mean" also how much of it there is."""

    def __init__(self, colors: Sequence[str], shapes: Sequence[str], sizes: Sequence[str],
                 positions: Sequence[str], width: int = 16, levels: int = 2, pool: str = "max"):
        super().__init__()
        if levels < 1 or pool not in POOLS:
            raise ValueError(f"levels must be >= 1 and pool one of {POOLS}, got {levels}, {pool!r}")
        self.classes = {"color": list(colors), "shape": [*shapes, NONE], "size": list(sizes),
                        "position": list(positions)}
        self.circle_check: dict[str, float] | None = None  # see circle_rule; set from the judge's config
        self.star_check: dict[str, float] | None = None  # see star_rule; set from the judge's config
        self.levels, self.pool = levels, pool
        c = width

        def block(cin: int, cout: int, stride: int = 1) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

        # 32 px: full resolution, then a strided conv and a conv per level; batch norm for fast training
        layers, cin = block(5, c), c
        for level in range(1, levels + 1):
            cout = c * min(2 ** level, 4)
            layers += [*block(cin, cout, 2), *block(cout, cout)]
            cin = cout
        self.trunk = nn.Sequential(*layers)
        dim = cin * (2 if pool == "max+mean" else 1)
        self.heads = nn.ModuleDict({a: nn.Linear(dim, len(v)) for a, v in self.classes.items()})

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(N, dim) pooled trunk features of images in [-1, 1] (the space of the judge's Fréchet distance)."""
        n, _, h, w = x.shape
        ys = torch.linspace(-1, 1, h).view(1, 1, h, 1).expand(n, 1, h, w)
        xs = torch.linspace(-1, 1, w).view(1, 1, 1, w).expand(n, 1, h, w)
        f = self.trunk(torch.cat([x, xs, ys], 1))
        pooled = f.amax((2, 3))
        return torch.cat([pooled, f.mean((2, 3))], 1) if self.pool == "max+mean" else pooled

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.features(x)
        return {a: head(h) for a, head in self.heads.items()}


class JudgeEnsemble(nn.Module):
    """Judges of the same classes trained with different seeds, used as one: the verdict is taken on
    their averaged softmax probabilities, and the features (the space of the Fréchet distance) are
    those of the first member, so that they do not depend on the ensemble's size."""

    def __init__(self, members: Sequence[Judge]):
        super().__init__()
        if not members:
            raise ValueError("an ensemble needs at least one judge")
        if any(m.classes != members[0].classes for m in members):
            raise ValueError("the judges of an ensemble must have the same classes")
        self.members = nn.ModuleList(members)
        self.classes = members[0].classes
        self.circle_check: dict[str, float] | None = None
        self.star_check: dict[str, float] | None = None

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The first member's trunk features."""
        return self.members[0].features(x)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per attribute the log of the members' mean softmax probabilities: logits whose softmax is
        that mean (so every caller that takes a softmax of the logits gets the averaged probabilities)."""
        outs = [m(x) for m in self.members]
        log_k = float(np.log(len(outs)))
        return {a: torch.logsumexp(torch.stack([F.log_softmax(o[a], 1) for o in outs]), 0) - log_k
                for a in outs[0]}


def to_tensor(images: Sequence[Image.Image], size: int) -> torch.Tensor:
    """Images -> (N, 3, size, size) in [-1, 1] (Lanczos resize where needed)."""
    arr = np.stack([np.asarray(im.convert("RGB").resize((size, size), Image.Resampling.LANCZOS))
                    if im.size != (size, size) else np.asarray(im.convert("RGB")) for im in images])
    return torch.from_numpy(arr).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def _index(values: Sequence[str | None], classes: list[str]) -> torch.Tensor:
    return torch.tensor([_UNIFORM if v is None else classes.index(v) for v in values])


def load_labelled(synth_dir: Path, size: int) -> tuple[torch.Tensor, dict[str, list[str]], dict]:
    """Real images of a ``data synth`` output (both splits), their labels and the dataset's summary."""
    labels_file = synth_dir / "labels.jsonl"
    if not labels_file.exists() or not (synth_dir / "synth.json").exists():
        raise UserError(f"{synth_dir}: no labels.jsonl / synth.json (not a complete `latentforge data synth` output)")
    rows = [json.loads(line) for line in labels_file.read_text().splitlines() if line]
    info = json.loads((synth_dir / "synth.json").read_text())
    x = to_tensor([Image.open(synth_dir / r["file"]) for r in rows], size)
    return x, {a: [r[a] for r in rows] for a in ATTRIBUTES}, info


def _gaussian_blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    r = max(1, int(np.ceil(2.5 * sigma)))
    t = torch.arange(-r, r + 1, dtype=torch.float32)
    k = torch.exp(-0.5 * (t / sigma) ** 2)
    k = k / k.sum()
    c = x.shape[1]
    x = F.conv2d(F.pad(x, (r, r, 0, 0), mode="replicate"), k.view(1, 1, 1, -1).expand(c, 1, 1, -1), groups=c)
    return F.conv2d(F.pad(x, (0, 0, r, r), mode="replicate"), k.view(1, 1, -1, 1).expand(c, 1, -1, 1), groups=c)


def blur(x: torch.Tensor, sigma: float = 1.0) -> torch.Tensor:
    """Gaussian blur of (N, C, H, W) images (separable, replicate padding)."""
    return _gaussian_blur(x, sigma)


def down_up(x: torch.Tensor, factor: int = 2) -> torch.Tensor:
    """Area down-sampling by ``factor``, then bilinear up-sampling to the original size."""
    small = F.avg_pool2d(x, factor)
    return F.interpolate(small, size=x.shape[-2:], mode="bilinear", align_corners=False)


def _augment(x: torch.Tensor, cfg: JudgeConfig, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """What decoded samples look like: softer (blur, down/up-sampling), haloed edges, noisier,
    colours a little off; and a few smeared past recognition. Returns the images and which were
    smeared (their shape answer is "none")."""
    x = x.clone()
    n = len(x)
    u = torch.rand(n, 4, generator=g)
    smear = u[:, 3] < cfg.smear_prob
    if smear.any():
        x[smear] = _gaussian_blur(x[smear], float(1.8 + 0.8 * torch.rand(1, generator=g)))
    resample = u[:, 0] < cfg.resample_prob
    if resample.any():
        x[resample] = down_up(x[resample])
    blur_mask = u[:, 1] < cfg.blur_prob
    if blur_mask.any():
        sigma = float(0.5 + 0.7 * torch.rand(1, generator=g))  # one sigma per batch: one conv
        x[blur_mask] = _gaussian_blur(x[blur_mask], sigma)
    halo = u[:, 2] < cfg.halo_prob
    if halo.any():  # unsharp masking: a dark/bright ring around each edge, as a VAE decoder's ringing
        sigma = float(1.0 + torch.rand(1, generator=g))
        k = 0.3 + 0.7 * torch.rand(int(halo.sum()), 1, 1, 1, generator=g)
        x[halo] = x[halo] + k * (x[halo] - _gaussian_blur(x[halo], sigma))
    gain = 1 + 0.08 * (2 * torch.rand(n, 3, 1, 1, generator=g) - 1)
    shift = 0.05 * (2 * torch.rand(n, 3, 1, 1, generator=g) - 1)
    x = x * gain + shift
    x = x + cfg.noise_std * torch.rand(n, 1, 1, 1, generator=g) * torch.randn(x.shape, generator=g)
    return x.clamp(-1.2, 1.2), smear


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy; ``_UNIFORM`` rows against the uniform distribution, ``_IGNORE`` rows skipped."""
    logp = F.log_softmax(logits, 1)
    hard = target >= 0
    uniform = target == _UNIFORM
    total = -logp[hard].gather(1, target[hard, None]).sum() - logp[uniform].mean(1).sum()
    return total / max(1, int((hard | uniform).sum()))


def train_judge(x: torch.Tensor, labels: dict[str, torch.Tensor], model: Judge, cfg: JudgeConfig,
                progress: bool = False) -> Judge:
    """Train ``model`` on images ``x`` with per-attribute targets (class index, -1 uniform, -100 none)."""
    g = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-4)
    n = len(x)
    steps_per_epoch = (n + cfg.batch_size - 1) // cfg.batch_size
    total = cfg.epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.05 + 0.95 * 0.5 * (1 + np.cos(np.pi * s / total)))
    none_index = torch.tensor(model.classes["shape"].index(NONE))
    model.train()
    with tqdm(total=total, desc="judge", unit="step", disable=not progress) as bar:
        for _ in range(cfg.epochs):
            perm = torch.randperm(n, generator=g)
            for i in range(0, n, cfg.batch_size):
                idx = perm[i:i + cfg.batch_size]
                xb, smeared = _augment(x[idx], cfg, g)
                out = model(xb)
                target = {a: labels[a][idx] for a in ATTRIBUTES}
                target["shape"] = torch.where(smeared, none_index, target["shape"])
                loss = sum(_loss(out[a], target[a]) for a in ATTRIBUTES)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                bar.update(1)
    return model.eval()


def build_judge(train_dirs: Sequence[Path], size: int, cfg: JudgeConfig,
                progress: bool = False) -> tuple[Judge | JudgeEnsemble, dict]:
    """Train the judge on the real renders of the ``data synth`` outputs ``train_dirs`` and on
    ``cfg.num_nonshapes`` non-shape renders; deterministic given the data and ``cfg``. With
    ``cfg.ensemble`` K > 1, K judges with seeds ``cfg.seed`` ... ``cfg.seed + K - 1`` as one
    :class:`JudgeEnsemble` (its first member is the judge that K = 1 gives). Trained on
    ``cfg.threads`` threads whatever the caller set (restored afterwards). The report's
    ``training_sha256`` is :func:`training_fingerprint` of what it learned from and how."""
    cfg.validate()
    t0 = time.perf_counter()
    parts = [load_labelled(Path(d), size) for d in train_dirs]
    sets = _member_sets(parts, size, cfg)
    with _threads(cfg.threads):
        fingerprint = _fingerprint(sets, cfg)  # before training: the probe starts from the untrained models
        members = [train_judge(x, labels, model, replace(cfg, seed=cfg.seed + i), progress=progress)
                   for i, (x, labels, model) in enumerate(sets)]
    model = members[0] if len(members) == 1 else JudgeEnsemble(members)
    model.circle_check, model.star_check = circle_rule(cfg), star_rule(cfg)
    report = {"train_images": sum(len(p[0]) for p in parts), "train_nonshapes": cfg.num_nonshapes,
              "train_resized": cfg.num_resized, "circle_check": model.circle_check, "star_check": model.star_check,
              "members": len(members), "seconds": round(time.perf_counter() - t0, 1), "floor": cfg.floor,
              "classes": model.classes, "training_sha256": fingerprint}
    return model, report


def training_fingerprint(train_dirs: Sequence[Path], size: int, cfg: JudgeConfig) -> str:
    """SHA-256 of what :func:`build_judge` learns from at ``cfg`` and how: each member's images before
    augmentation (the real renders of ``train_dirs``, the non-shapes, the resized shapes) and targets,
    in order, and the weights after a probe of :data:`PROBE_STEPS` training steps from each member's
    untrained model on its first images (the model, its initialisation, the augmentation, the loss and
    the optimizer, on ``cfg.threads`` threads). Equal fingerprints and configs mean the same inputs and
    the same training arithmetic, so a judge trained elsewhere on them (a pinned judge) is the judge of
    these renders, as far as those steps show. A few seconds, no full training."""
    cfg.validate()
    sets = _member_sets([load_labelled(Path(d), size) for d in train_dirs], size, cfg)
    with _threads(cfg.threads):
        return _fingerprint(sets, cfg)


@contextmanager
def _threads(n: int) -> Iterator[None]:
    """torch on ``n`` threads inside the block, the caller's count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


PROBE_STEPS = 8  # the fingerprint's training probe: 2 epochs of 4 batches


def _fingerprint(sets: Sequence[tuple[torch.Tensor, dict[str, torch.Tensor], Judge]], cfg: JudgeConfig) -> str:
    """:func:`training_fingerprint` of loaded member sets; the caller sets the thread count (``cfg.threads``)."""
    import copy
    import hashlib

    h = hashlib.sha256()
    n = PROBE_STEPS // 2 * cfg.batch_size
    for i, (x, labels, model) in enumerate(sets):
        h.update(x.contiguous().numpy().tobytes())
        for a in ATTRIBUTES:
            h.update(labels[a].numpy().astype("<i8").tobytes())
        probe = train_judge(x[:n], {a: labels[a][:n] for a in ATTRIBUTES}, copy.deepcopy(model),
                            replace(cfg, seed=cfg.seed + i, epochs=2))
        for k, v in probe.state_dict().items():
            h.update(k.encode())
            h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _member_sets(parts: Sequence[tuple[torch.Tensor, dict[str, list[str]], dict]], size: int,
                 cfg: JudgeConfig) -> list[tuple[torch.Tensor, dict[str, torch.Tensor], Judge]]:
    """The training images, targets and untrained model of each of the ``cfg.ensemble`` members."""
    return [_member_set(parts, size, replace(cfg, seed=cfg.seed + i)) for i in range(cfg.ensemble)]


def _member_set(parts: Sequence[tuple[torch.Tensor, dict[str, list[str]], dict]], size: int,
                cfg: JudgeConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor], Judge]:
    """One judge's training set: the loaded real renders ``parts``, ``cfg.num_nonshapes`` non-shapes
    and ``cfg.num_resized`` shapes at other widths (no size answer), all of ``cfg.seed``; its targets;
    and the model it trains, initialised from ``cfg.seed``."""
    from latentforge.evaluate.nonshapes import nonshape_set, resized_set

    torch.manual_seed(cfg.seed)
    info = parts[0][2]
    classes = {"color": list(info["colors"]), "shape": list(info["shapes"]), "size": list(info["sizes"]),
               "position": list(info["positions"])}
    model = Judge(classes["color"], classes["shape"], classes["size"], classes["position"], width=cfg.width,
                  levels=cfg.levels, pool=cfg.pool)
    xs = [p[0] for p in parts]
    values = {a: [v for p in parts for v in p[1][a]] for a in ATTRIBUTES}
    image_size = int(info["config"]["image_size"])
    non = (nonshape_set(cfg.num_nonshapes, cfg.seed, image_size, cfg.extra_nonshapes, cfg.kind_shares)
           + resized_set(cfg.num_resized, cfg.seed, image_size, (cfg.resized_widths[0], cfg.resized_widths[1]),
                         cfg.resized_sizes))
    if non:
        xs.append(to_tensor([n.image for n in non], size))
        for a in ATTRIBUTES:
            values[a] += [getattr(n, a) for n in non]
    labels = {}
    for a in ATTRIBUTES:
        classes_a = model.classes[a]
        # a class the dataset does not use (e.g. a colour left out of synth.colors) is never a target
        labels[a] = torch.tensor([_IGNORE if v is not None and v not in classes_a else
                                  (_UNIFORM if v is None else classes_a.index(v)) for v in values[a]])
    # a non-shape without a size or a position (two shapes, merged or apart) is not a lesson in either;
    # only an empty image has "no right answer" there (uniform target)
    num_real = sum(len(p[0]) for p in parts)
    for a in ("size", "position"):
        unset = torch.tensor([False] * num_real + [getattr(n, a) is None and n.kind != "empty" for n in non])
        labels[a][unset] = _IGNORE
    return torch.cat(xs), labels, model


def _getter(cfg: JudgeConfig | dict) -> Callable[[str], Any]:
    """A setting of a config or of its saved dict (a field the dict lacks: the config's default)."""
    return (lambda k: cfg.get(k, getattr(JudgeConfig, k))) if isinstance(cfg, dict) else (lambda k: getattr(cfg, k))


def circle_rule(cfg: JudgeConfig | dict) -> dict[str, float] | None:
    """The thresholds of :func:`latentforge.evaluate.outline.is_circle` that ``cfg`` (a config or its
    saved dict) asks for; None when its circle check is off."""
    get = _getter(cfg)
    if not get("circle_check"):
        return None
    return {"max_corners": float(get("circle_max_corners")), "min_ratio": float(get("circle_min_ratio")),
            "max_edge": float(get("circle_max_edge"))}


def star_rule(cfg: JudgeConfig | dict) -> dict[str, float] | None:
    """The thresholds of :func:`latentforge.evaluate.outline.has_star_points` that ``cfg`` (a config or its
    saved dict) asks for; None when its star check is off."""
    get = _getter(cfg)
    if not get("star_check"):
        return None
    return {"min_points": float(get("star_min_points")), "max_edge": float(get("star_max_edge"))}


@torch.no_grad()
def verdicts_of_tensor(model: Judge | JudgeEnsemble, x: torch.Tensor, floor: float,
                       batch: int = 256) -> dict[str, list[str]]:
    """Per image and attribute the judge's verdict: a class name, or "none" (the rejection class
    or a confidence under ``floor``). With the model's circle check on, a shape verdict "none" whose
    image meets the rule's circle (:func:`latentforge.evaluate.outline.is_circle`, measured at the
    resolution of ``x``) is "circle"; with its star check on, a verdict "star" whose sharp region lacks
    the points (:func:`latentforge.evaluate.outline.has_star_points`) is "none"."""
    model.eval()
    out: dict[str, list[str]] = {a: [] for a in ATTRIBUTES}
    for i in range(0, len(x), batch):
        logits = model(x[i:i + batch])
        for a in ATTRIBUTES:
            p, k = F.softmax(logits[a], 1).max(1)
            names = model.classes[a]
            out[a] += [names[j] if q >= floor else NONE for q, j in zip(p.tolist(), k.tolist())]
    circle, star = getattr(model, "circle_check", None), getattr(model, "star_check", None)
    if not circle and not star:
        return out
    from latentforge.evaluate.outline import has_star_points, is_circle, measure

    def outline(i: int):  # the outline of image i, measured at the resolution of x
        return measure(x[i].permute(1, 2, 0).double().cpu().numpy())

    circle = circle if "circle" in model.classes["shape"] else None
    for i, v in enumerate(out["shape"]):
        if circle and v == NONE and is_circle(outline(i), **circle):
            out["shape"][i] = "circle"
        elif star and v == "star" and not has_star_points(outline(i), **star):
            out["shape"][i] = NONE
    return out


def verdicts(model: Judge | JudgeEnsemble, images: Sequence[Image.Image], size: int,
             floor: float) -> dict[str, list[str]]:
    return verdicts_of_tensor(model, to_tensor(images, size), floor)


@torch.no_grad()
def features(model: Judge | JudgeEnsemble, images: Sequence[Image.Image] | torch.Tensor, size: int,
             batch: int = 256) -> torch.Tensor:
    """The judge's trunk features of images (for the Fréchet distance in its space)."""
    x = images if isinstance(images, torch.Tensor) else to_tensor(images, size)
    model.eval()
    return torch.cat([model.features(x[i:i + batch]) for i in range(0, len(x), batch)])


def thumbnails(images: Sequence[Image.Image] | torch.Tensor, size: int, side: int = 8) -> torch.Tensor:
    """Images as ``side`` x ``side`` RGB thumbnails (area average), flattened: training-free
    features of colour, size and place."""
    x = images if isinstance(images, torch.Tensor) else to_tensor(images, size)
    return F.adaptive_avg_pool2d(x.float(), side).flatten(1)


def textures(images: Sequence[Image.Image] | torch.Tensor, size: int, side: int = 4) -> torch.Tensor:
    """Where the fine detail is: the absolute difference between an image and its 2x2 block
    average, area-averaged to ``side`` x ``side`` per channel, flattened. Training-free features
    of edges and texture: flat shapes on flat backgrounds have little, noise has much."""
    x = images if isinstance(images, torch.Tensor) else to_tensor(images, size)
    x = x.float()
    detail = (x - F.interpolate(F.avg_pool2d(x, 2), scale_factor=2, mode="nearest")).abs()
    return F.adaptive_avg_pool2d(detail, side).flatten(1)


def agreement(found: dict[str, list[str]], wanted: dict[str, Sequence[str | None]]) -> dict[str, dict[str, int]]:
    """Per attribute: how many verdicts equal the wanted label (labels that are None are skipped)."""
    result = {}
    for a in ATTRIBUTES:
        pairs = [(f, w) for f, w in zip(found[a], wanted[a]) if w is not None]
        result[a] = {"right": sum(f == w for f, w in pairs), "num": len(pairs)}
    return result


def agreed_labels(*label_sets: Sequence[dict]) -> dict[str, list[str | None]]:
    """Per attribute the label of each image where every labeller gave the same one (rows of the
    same images in the same order, each ``{"file", attribute: label or None}``), else None (not
    counted)."""
    files = [[r["file"] for r in rows] for rows in label_sets]
    if any(f != files[0] for f in files):
        raise ValueError("the label sets must list the same images in the same order")
    return {a: [image[0][a] if image[0][a] is not None and all(r[a] == image[0][a] for r in image) else None
                for image in zip(*label_sets)] for a in ATTRIBUTES}


def asked_pair(prompt: str) -> tuple[str, str] | None:
    """The colour and the shape a prompt names, each exactly once; None otherwise."""
    words = prompt.lower().replace(",", " ").replace(":", " ").split()
    colors, shapes = [c for c in COLORS if c in words], [s for s in SHAPES if s in words]
    return (colors[0], shapes[0]) if len(colors) == 1 and len(shapes) == 1 else None


def read_labelled_samples(folder: str | Path) -> tuple[list[dict], list[list[dict]]]:
    """A folder of generated images labelled by eye (as ``tests/fixtures/judge-samples/``):
    ``provenance.jsonl`` (``{"file", "set", "split", "wording", "prompt", ...}``, one line per image) and
    ``labels-1.jsonl``, ``labels-2.jsonl``, ... (one labeller a file, the same images in the same order)."""
    d = Path(folder)
    read = lambda f: [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    files = sorted(d.glob("labels-*.jsonl"))
    if not (d / "provenance.jsonl").is_file() or not files:
        raise UserError(f"{d}: no labelled images here (provenance.jsonl and labels-1.jsonl, ... expected)")
    provenance, label_sets = read(d / "provenance.jsonl"), [read(f) for f in files]
    for where, rows, keys in [("provenance.jsonl", provenance, ("file", "split", "wording", "prompt"))] + [
            (f.name, rows, ("file", *ATTRIBUTES)) for f, rows in zip(files, label_sets)]:
        for n, r in enumerate(rows, 1):
            if missing := [k for k in keys if k not in r]:
                raise UserError(f"{d / where}: line {n} has no {', '.join(missing)}")
    for n, r in enumerate(provenance, 1):
        if asked_pair(r["prompt"]) is None:
            raise UserError(f"{d / 'provenance.jsonl'}: line {n}: the prompt {r['prompt']!r} must name one colour and "
                            "one shape of the dataset")
    if any([r["file"] for r in rows] != [r["file"] for r in provenance] for rows in label_sets):
        raise UserError(f"{d}: the label files must list the images of provenance.jsonl in the same order")
    return provenance, label_sets


def labelled_figures(found: dict[str, list[str]], provenance: Sequence[dict],
                     label_sets: Sequence[Sequence[dict]]) -> dict[str, dict[str, Any]]:
    """Per set of ``provenance`` (its ``set`` field): the judge's verdicts ``found`` against the labels
    every labeller gave alike (per attribute, ``agreement``) and against each labeller's
    (``agreement_each``); each labeller against the labels all the others gave alike
    (``labeller_vs_rest``, with two labellers or more; a null counts as a disagreement): what a person
    reaches, the bar for the judge's ``agreement``; and how many images have both the colour
    and the shape that their prompt names right by the judge, by each labeller and by all of them
    (the demo's both-right), also per split and wording (the caption wording or the new ones)."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r.get("set", "all") for r in provenance):
        idx = [i for i, r in enumerate(provenance) if r.get("set", "all") == name]
        sets = [[rows[i] for i in idx] for rows in label_sets]
        mine = {a: [found[a][i] for i in idx] for a in ATTRIBUTES}
        groups: dict[str, dict[str, Any]] = {}
        for j, i in enumerate(idx):
            want = asked_pair(provenance[i]["prompt"])
            right = [(found["color"][i], found["shape"][i]) == want] + [(rows[j]["color"], rows[j]["shape"]) == want
                                                                        for rows in sets]
            kind = "caption wording" if provenance[i]["wording"] == "caption" else "new wordings"
            for key in ("all", f"{provenance[i]['split']}, {kind}"):
                g = groups.setdefault(key, {"num": 0, "judge": 0, "labellers": [0] * len(sets), "all_labellers": 0})
                g["num"] += 1
                g["judge"] += int(right[0])
                g["labellers"] = [k + int(r) for k, r in zip(g["labellers"], right[1:])]
                g["all_labellers"] += int(all(right[1:]))
        as_found = [{a: [r[a] for r in rows] for a in ATTRIBUTES} for rows in sets]
        rest = [agreement(as_found[k], agreed_labels(*(s for j, s in enumerate(sets) if j != k)))
                for k in range(len(sets))] if len(sets) > 1 else []
        out[name] = {"num": len(idx), "agreement": agreement(mine, agreed_labels(*sets)),
                     "agreement_each": [agreement(mine, labels) for labels in as_found],
                     "labeller_vs_rest": rest, "both_right": groups}
    return out


def shape_by_size(found: Sequence[str], labels: dict[str, Sequence[str | None]]) -> dict[str, dict[str, dict[str, int]]]:
    """Per labelled shape and size: how many of the shape verdicts ``found`` name the shape
    (``{"right", "num"}``), in the order the shapes and sizes first appear."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for got, shape, size in zip(found, labels["shape"], labels["size"]):
        if shape is None or size is None:
            continue
        c = out.setdefault(shape, {}).setdefault(size, {"right": 0, "num": 0})
        c["num"] += 1
        c["right"] += int(got == shape)
    return out


def shape_ceiling(by_shape_size: dict[str, dict[str, dict[str, int]]], shapes: Sequence[str]) -> float | None:
    """The share of ``shapes`` (one entry per prompt combination) that the shape verdicts name right
    when every size is asked equally often: the mean over the shapes of the mean over their sizes.
    None when a shape has no render."""
    rates = []
    for shape in shapes:
        sizes = [c for c in by_shape_size.get(shape, {}).values() if c["num"]]
        if not sizes:
            return None
        rates.append(sum(c["right"] / c["num"] for c in sizes) / len(sizes))
    return sum(rates) / len(rates) if rates else None


def _rates(counts: dict[str, dict[str, int]]) -> dict[str, float]:
    out: dict[str, float] = {a: c["right"] / c["num"] for a, c in counts.items() if c["num"]}
    out["num"] = max(c["num"] for c in counts.values())
    return out


def validate_judge(model: Judge | JudgeEnsemble, check_dir: Path, size: int, cfg: JudgeConfig,
                   autoencode: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict:
    """Per-attribute accuracy of the judge at ``cfg.floor`` on fresh real renders of ``check_dir``
    (both splits), clean and degraded (blur sigma 1 px, 2x down/up-sampling, and ``autoencode``:
    e.g. the demo's own VAE, images in [-1, 1] in and out); its shape and colour accuracy on fresh
    shapes of no dataset size (widths between the two sizes, and below the small one); and how often
    it rejects fresh non-shapes (another seed than training; the default kinds, the extra ones apart)."""
    from latentforge.evaluate.nonshapes import nonshape_set, resized_set

    x, labels, info = load_labelled(Path(check_dir), size)
    conditions = {"clean": x, "blur": blur(x, 1.0), "down_up": down_up(x, 2)}
    if autoencode is not None:
        with torch.no_grad():
            conditions["vae"] = torch.cat([autoencode(x[i:i + 64]) for i in range(0, len(x), 64)]).clamp(-1, 1)
    result: dict = {"floor": cfg.floor, "real": {}}
    for name, xc in conditions.items():
        found = verdicts_of_tensor(model, xc, cfg.floor)
        result["real"][name] = _rates(agreement(found, labels))
        if name == "vae":  # what the autoencoder lets through, per shape and size: the ceiling of any denoiser on it
            result["vae_by_shape_size"] = shape_by_size(found["shape"], labels)
    image_size = int(info["config"]["image_size"])
    for name, widths in (("between", (0.32, 0.40)), ("below", (0.22, 0.28))):  # fresh renders of no dataset size
        off = resized_set(120, cfg.seed + 7919, image_size, widths)
        v = verdicts(model, [n.image for n in off], size, cfg.floor)
        result[f"{name}_sizes"] = {"num": len(off), "widths": list(widths),
                                   "shape": float(np.mean([s == n.shape for s, n in zip(v["shape"], off)])),
                                   "color": float(np.mean([c == n.color for c, n in zip(v["color"], off)]))}
    # the default kinds only (the same renders whatever the extra kinds: figures comparable across judges);
    # the extra kinds are reported apart
    non = nonshape_set(max(60, cfg.num_nonshapes // 5), cfg.seed + 7919, image_size)
    v = verdicts(model, [n.image for n in non], size, cfg.floor)
    rejected = [s == NONE for s, n in zip(v["shape"], non) if n.shape == NONE]
    by_kind: dict[str, list[int]] = {}
    for s, n in zip(v["shape"], non):
        if n.shape == NONE:
            by_kind.setdefault(n.kind, []).append(int(s == NONE))
    two = [c == NONE for c, n in zip(v["color"], non) if n.kind == "two-colour"]
    no_colour: dict[str, list[int]] = {}  # renders with no colour of the six: how often the colour verdict is "none"
    for c, n in zip(v["color"], non):
        if n.color is None and n.kind != "empty":
            no_colour.setdefault(n.kind, []).append(int(c == NONE))
    result["nonshapes"] = {"num": len(rejected), "shape_rejected": float(np.mean(rejected)) if rejected else None,
                           "by_kind": {k: float(np.mean(r)) for k, r in sorted(by_kind.items())},
                           "two_colour_color_rejected": float(np.mean(two)) if two else None,
                           "color_rejected_by_kind": {k: float(np.mean(r)) for k, r in sorted(no_colour.items())}}
    if cfg.extra_nonshapes:
        extra = [n for n in nonshape_set(max(60, cfg.num_nonshapes // 5), cfg.seed + 7920, image_size,
                                         cfg.extra_nonshapes) if n.kind in cfg.extra_nonshapes]
        v = verdicts(model, [n.image for n in extra], size, cfg.floor)
        result["nonshapes"]["extra_by_kind"] = {k: float(np.mean([s == NONE for s, n in zip(v["shape"], extra) if n.kind == k]))
                                                for k in cfg.extra_nonshapes if any(n.kind == k for n in extra)}
    return result


JUDGE_WEIGHTS, JUDGE_META = "judge.safetensors", "judge.json"
# The settings that act after the weights only (the confidence floor on their softmax; the outline checks on
# their verdict and the image): a judge trained at other values of these has the same weights.
SCORING_SETTINGS = ("floor", "circle_check", "circle_max_corners", "circle_min_ratio", "circle_max_edge",
                    "star_check", "star_min_points", "star_max_edge")


def save_judge(model: Judge | JudgeEnsemble, cfg: JudgeConfig, report: dict, out_dir: str | Path,
               trained_on: dict | None = None) -> Path:
    """Write the judge to ``out_dir`` (weights in safetensors, classes, its config and report in
    JSON), atomically: a directory that exists holds a complete judge. ``trained_on`` records what
    it was trained on, for :func:`load_judge` to compare."""
    import os
    import shutil

    import safetensors.torch

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    members = list(model.members) if isinstance(model, JudgeEnsemble) else [model]
    tensors = {f"{i}.{k}": v.detach().contiguous() for i, m in enumerate(members) for k, v in m.state_dict().items()}
    safetensors.torch.save_file(tensors, str(tmp / JUDGE_WEIGHTS), metadata={"format": "pt"})
    meta = {"members": len(members), "width": members[0].trunk[0].out_channels, "levels": members[0].levels,
            "pool": members[0].pool, "classes": members[0].classes,
            "config": asdict(cfg), "trained_on": trained_on or {}, "report": report}
    (tmp / JUDGE_META).write_text(json.dumps(meta, indent=1, default=str))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def _as_json(x: Any) -> Any:
    """``x`` as it reads back from the JSON that :func:`save_judge` writes."""
    return json.loads(json.dumps(x, default=str))


def load_judge(out_dir: str | Path, cfg: JudgeConfig | None = None, trained_on: dict | None = None,
               defaults: dict | None = None, weights_only: bool = False,
               remedy: str = "") -> tuple[Judge | JudgeEnsemble, dict] | None:
    """The judge that :func:`save_judge` wrote and its report; ``None`` when ``out_dir`` holds none,
    or one of another config than ``cfg`` or trained on other data than ``trained_on`` (the caller
    trains a new one). A setting that the saved record lacks (a field added to a config since)
    counts as its value in ``defaults`` (``trained_on`` of default configs) or :class:`JudgeConfig`'s
    default, so a new field at its default keeps a saved judge. With ``weights_only`` the
    :data:`SCORING_SETTINGS` of ``cfg`` may differ from the saved ones: the loaded judge gets ``cfg``'s
    outline checks (the floor is the caller's), and its saved report's figures are then not ``cfg``'s.
    A record that cannot be read stops with one line ending in ``remedy`` (default: delete the
    directory to train the judge again). Reads safetensors and JSON only."""
    from latentforge.checkpoint import load_safetensors

    d = Path(out_dir)
    remedy = remedy or f"delete {d} to train the judge again"
    if not (d / JUDGE_META).is_file() or not (d / JUDGE_WEIGHTS).is_file():
        return None
    try:
        meta = json.loads((d / JUDGE_META).read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{d / JUDGE_META}: not valid JSON ({e.msg}); {remedy}") from None
    missing = [k for k in ("classes", "members", "width", "report") if k not in meta] if isinstance(meta, dict) else []
    if not isinstance(meta, dict) or missing:
        raise UserError(f"{d / JUDGE_META}: not a judge record (no {', '.join(missing) or 'fields'}); {remedy}")
    if cfg is not None:
        ignored = SCORING_SETTINGS if weights_only else ()
        saved_cfg = with_defaults(meta.get("config"), _as_json(asdict(JudgeConfig())))
        if ({k: v for k, v in saved_cfg.items() if k not in ignored}
                != {k: v for k, v in _as_json(asdict(cfg)).items() if k not in ignored}):
            return None
    if trained_on is not None and (with_defaults(meta.get("trained_on"), _as_json(defaults or {}))
                                   != _as_json(trained_on)):
        return None
    tensors = load_safetensors(d / JUDGE_WEIGHTS)
    c = meta["classes"]
    members = []
    for i in range(int(meta["members"])):
        m = Judge(c["color"], [s for s in c["shape"] if s != NONE], c["size"], c["position"], width=int(meta["width"]),
                  levels=int(meta.get("levels", 2)), pool=str(meta.get("pool", "max")))
        prefix = f"{i}."
        load_weights(m, {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)},
                     str(d / JUDGE_WEIGHTS), f"the judge of {d / JUDGE_META}", remedy)
        members.append(m.eval())
    model = members[0] if len(members) == 1 else JudgeEnsemble(members).eval()
    rules = cfg if (weights_only and cfg is not None) else (meta.get("config") or {})
    model.circle_check, model.star_check = circle_rule(rules), star_rule(rules)
    return model, meta["report"]


def chance(classes: dict[str, list[str]]) -> dict[str, float]:
    """Chance level of each verdict for a uniformly guessing judge (the shape's "none" excluded)."""
    n = {a: len([c for c in v if c != NONE]) for a, v in classes.items()}
    return {"color": 1 / n["color"], "shape": 1 / n["shape"], "both": 1 / (n["color"] * n["shape"]),
            "size": 1 / n["size"], "position": 1 / n["position"]}


__all__ = ["ATTRIBUTES", "COLORS", "NONE", "POSITIONS", "SHAPES", "SIZES", "Judge", "JudgeConfig", "JudgeEnsemble",
           "agreement", "blur", "build_judge", "chance", "circle_rule", "down_up", "features", "load_judge", "save_judge", "shape_by_size",
           "shape_ceiling", "star_rule", "to_tensor", "validate_judge", "verdicts", "verdicts_of_tensor"]
