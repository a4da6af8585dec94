"""Distribution metrics on image features: the Fréchet distance and its inputs.

The distance itself is torchmetrics' (the same function behind its FID); this module only
turns feature matrices into the Gaussian statistics it takes, in float64, so that every caller
(``latentforge eval``, the demo's judge-space FD, evaluation during training) shares one path.
"""

from __future__ import annotations

import torch
from torchmetrics.image.fid import _compute_fid

__all__ = ["gaussian_stats", "frechet_distance", "frechet_distance_from_stats"]


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
    return float(_compute_fid(mu1.to(torch.float64), sigma1.to(torch.float64), mu2.to(torch.float64),
                              sigma2.to(torch.float64)))


def frechet_distance(features_a: torch.Tensor, features_b: torch.Tensor) -> float:
    """Fréchet distance between the Gaussians fitted to two (N, D) feature matrices."""
    return frechet_distance_from_stats(*gaussian_stats(features_a), *gaussian_stats(features_b))
