"""Small statistics for reporting rates: the Wilson score interval, and its form for trials that
come in clusters (several images of one prompt)."""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["wilson_interval", "clustered_interval", "student_t_quantile", "Z_95"]

Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile: a two-sided 95% interval


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (Wilson 1927, JASA 22(158); the form in
    Brown, Cai & DasGupta 2001, eq. 3). (0, 1) when ``n`` is 0."""
    if n < 0 or not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: need 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return 0.0, 1.0
    return _wilson(successes / n, n, z)


def _wilson(p: float, n: float, z: float) -> tuple[float, float]:
    """The Wilson interval of the proportion ``p`` at a (possibly fractional) sample size ``n`` > 0."""
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def clustered_interval(successes: Sequence[int], sizes: Sequence[int], z: float = Z_95) -> tuple[float, float, float]:
    """95% interval of a proportion whose trials come in clusters: ``successes[i]`` of ``sizes[i]``
    trials in cluster ``i`` (the images of one prompt, which can be near-copies of each other).

    The Wilson interval at the effective sample size n / deff (Kish's design effect; the form for
    proportions from clustered samples in Korn & Graubard 1998, Survey Methodology 24(2)), where deff
    is the cluster-robust variance of the ratio estimator, k/(k-1) * sum (y_i - p m_i)^2 / n^2, over
    the binomial p(1-p)/n. The effective size is kept within [k, n]: no fewer trials than clusters
    (k when the clusters are perfect copies: the Wilson interval of k trials), no more than the
    trials. With the variance estimated from k clusters the quantile is Student's t with k - 1
    degrees of freedom instead of the normal one (Korn & Graubard's degrees-of-freedom adjustment;
    with 6 clusters 2.57 instead of 1.96). Clusters of one trial each give exactly
    :func:`wilson_interval`. Where the design effect cannot be estimated (one cluster, or every trial
    agrees: p = 0 or 1) the interval is the k-trial Wilson one, as if each cluster were copies.
    Returns (lo, hi, n_eff); (0, 1, 0) when there are no trials."""
    if len(successes) != len(sizes):
        raise ValueError(f"clustered_interval: {len(successes)} success counts for {len(sizes)} clusters")
    if any(m < 0 or not 0 <= y <= m for y, m in zip(successes, sizes)):
        raise ValueError("clustered_interval: need 0 <= successes <= size in every cluster")
    pairs = [(y, m) for y, m in zip(successes, sizes) if m > 0]
    n, k = sum(m for _, m in pairs), len(pairs)
    if n == 0:
        return 0.0, 1.0, 0.0
    right = sum(y for y, _ in pairs)
    if k == n:
        return (*wilson_interval(right, n, z), float(n))
    p = right / n
    if k == 1 or p in (0.0, 1.0):
        return (*_wilson(p, k, z), float(k))
    var = k / (k - 1) * sum((y - p * m) ** 2 for y, m in pairs) / n ** 2
    n_eff = min(float(n), max(float(k), p * (1 - p) / var)) if var > 0 else float(n)
    return (*_wilson(p, n_eff, student_t_quantile(z, k - 1)), n_eff)


def student_t_quantile(z: float, df: int) -> float:
    """The quantile of Student's t with ``df`` degrees of freedom at the probability where the
    standard normal's quantile is ``z`` (z = 1.96: the two-sided 95% point). Exact for 1 and 2
    degrees of freedom; from 3 on the Cornish-Fisher expansion in 1/df to the fourth order
    (Abramowitz & Stegun 26.7.5; within 0.004 of the exact value at 3, 1e-4 from 6)."""
    if df < 1:
        raise ValueError(f"student_t_quantile: df must be >= 1, got {df}")
    u = 0.5 * (1 + math.erf(z / math.sqrt(2)))
    if df == 1:
        return math.tan(math.pi * (u - 0.5))
    if df == 2:
        return (2 * u - 1) / math.sqrt(2 * u * (1 - u))
    v = float(df)
    return (z + (z ** 3 + z) / (4 * v) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * v ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * v ** 3)
            + (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / (92160 * v ** 4))
