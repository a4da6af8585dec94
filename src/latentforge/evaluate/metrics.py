"""Metrics on image features and prompts: Fréchet distance, KID, CLIP score.

The math is torchmetrics': the Fréchet distance is the function behind its FID, KID is its
``KernelInceptionDistance`` and the CLIP score its ``CLIPScore``. This module turns feature
matrices into what they take (Gaussian statistics in float64, feature batches), so that every
caller (``latentforge eval``, the demo's judge-space FD, evaluation during training) shares one
path, and checks that there are enough samples for each metric.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from latentforge.errors import UserError

__all__ = ["gaussian_stats", "frechet_distance", "frechet_distance_from_stats", "fid_sample_warning",
           "kernel_inception_distance", "clip_score"]


def gaussian_stats(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, unbiased covariance) of an (N, D) feature matrix, in float64."""
    if features.ndim != 2 or len(features) < 2:
        raise ValueError(f"gaussian_stats: need an (N >= 2, D) feature matrix, got shape {tuple(features.shape)}")
    f = features.to(torch.float64)
    mu = f.mean(0)
    centred = f - mu
    return mu, centred.T @ centred / (len(f) - 1)


def frechet_distance_from_stats(mu1: torch.Tensor, sigma1: torch.Tensor, mu2: torch.Tensor,
                                sigma2: torch.Tensor) -> float:
    """Fréchet distance between N(mu1, sigma1) and N(mu2, sigma2) (Heusel et al. 2017, eq. 6)."""
    from torchmetrics.image.fid import _compute_fid  # imported on use: ~1 s, and every command loads this module

    return float(_compute_fid(mu1.to(torch.float64), sigma1.to(torch.float64), mu2.to(torch.float64),
                              sigma2.to(torch.float64)))


def frechet_distance(features_a: torch.Tensor, features_b: torch.Tensor) -> float:
    """Fréchet distance between the Gaussians fitted to two (N, D) feature matrices."""
    return frechet_distance_from_stats(*gaussian_stats(features_a), *gaussian_stats(features_b))


def fid_sample_warning(num_a: int, num_b: int, dim: int, what: str = "FID") -> str | None:
    """A warning when a Fréchet distance rests on singular covariances, or None.

    With N samples the covariance of D-dim features has rank at most N - 1, so below D + 1
    samples the distance is still defined but biased and not comparable with published
    figures (those use 10k-50k images: Heusel et al. 2017 recommend at least 10,000).
    """
    if num_a < 2 or num_b < 2:
        raise UserError(f"{what}: needs at least 2 images on each side, got {num_a} reference and {num_b} generated")
    fewest = min(num_a, num_b)
    if fewest <= dim:
        return (f"{what}: {fewest} images for {dim}-dim features: the covariance is singular (rank <= {fewest - 1}); "
                f"use at least {dim + 1} images per side (10,000+ for figures comparable with papers)")
    return None


class _Given(torch.nn.Module):
    """The identity as a torchmetrics feature extractor: the features were extracted (and cached) before."""

    def __init__(self, num_features: int):
        super().__init__()
        self.num_features = num_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def kernel_inception_distance(real: torch.Tensor, fake: torch.Tensor, subset_size: int = 1000,
                              subsets: int = 100, seed: int = 0) -> tuple[float, float]:
    """(mean, std) of KID over random subsets (Bińkowski et al. 2018, "Demystifying MMD GANs", eq. 4:
    unbiased MMD^2 with the cubic polynomial kernel), computed by torchmetrics on given features.
    The subsets are drawn from a generator seeded with ``seed``, so the value is reproducible."""
    import warnings

    from torchmetrics.image.kid import KernelInceptionDistance

    fewest = min(len(real), len(fake))
    if fewest < subset_size:
        raise UserError(f"KID: subset size {subset_size} needs at least {subset_size} images on each side, got "
                        f"{len(real)} reference and {len(fake)} generated (set eval.kid_subset_size <= {fewest} "
                        f"or use more images)")
    # sync_on_compute=False: under torchrun rank 0 measures alone; the other ranks never call compute.
    with warnings.catch_warnings():  # "will save all extracted features": they are in memory already
        warnings.filterwarnings("ignore", message=".*will save all extracted features.*")
        metric = KernelInceptionDistance(feature=_Given(real.shape[1]), subsets=subsets, subset_size=subset_size,
                                         sync_on_compute=False)
    metric.update(real.double(), real=True)
    metric.update(fake.double(), real=False)
    with torch.random.fork_rng(devices=[]):  # torchmetrics draws the subsets from the global generator
        torch.manual_seed(seed)
        mean, std = metric.compute()
    return float(mean), float(std)


def clip_score(images: Sequence[torch.Tensor] | torch.Tensor, prompts: Sequence[str], model: Any, processor: Any,
               batch_size: int = 32) -> float:
    """The CLIP score of images against their prompts: the mean of 100 * cos(image, text), floored at 0
    (Hessel et al. 2021, "CLIPScore", with w = 100 as torchmetrics and most papers use), by
    torchmetrics' ``CLIPScore`` on a local model (``features.load_clip``). Images: uint8 CHW."""
    from torchmetrics.multimodal import CLIPScore

    if len(images) != len(prompts):
        raise ValueError(f"clip_score: {len(images)} images for {len(prompts)} prompts")
    metric = CLIPScore(model_name_or_path=lambda: (model, processor), sync_on_compute=False)  # rank 0 alone
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            metric.update(list(images[i:i + batch_size]), list(prompts[i:i + batch_size]))
    return float(metric.compute())
