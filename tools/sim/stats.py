"""Means and 95 % confidence intervals over seeds, and paired ratios against Libra."""

from __future__ import annotations

import math
from collections.abc import Sequence

_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
        2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086)  # fmt: skip
"""Two-sided 95 % quantiles of Student's t for 1..20 degrees of freedom."""


def t95(df: int) -> float:
    if df < 1:
        raise ValueError("a confidence interval needs at least two samples")
    return _T95[df - 1] if df <= len(_T95) else 1.96 + 2.4 / df


def mean_ci(xs: Sequence[float]) -> tuple[float, tuple[float, float]]:
    """Sample mean and its 95 % t-interval; a single sample gives a zero-width interval."""
    if not xs:
        raise ValueError("no samples")
    n = len(xs)
    m = sum(xs) / n
    if n == 1:
        return m, (m, m)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    h = t95(n - 1) * sd / math.sqrt(n)
    return m, (m - h, m + h)


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> tuple[float, tuple[float, float]]:
    """Mean of per-seed ratios num[i] / den[i] (same seed, same trajectories) with its 95 % CI."""
    if len(num) != len(den):
        raise ValueError("paired samples must have the same length")
    return mean_ci([a / b if b else math.inf for a, b in zip(num, den, strict=True)])
