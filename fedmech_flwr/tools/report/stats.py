"""Intervals over seeds: the mean of a few runs and its Student-t confidence interval, and
the difference of two groups' means (Welch)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
from scipy.stats import t as student_t


def mean_ci(values: Iterable[float], confidence: float = 0.95) -> tuple[float, float | None, int]:
    """``(mean, half_width, n)``: the interval is mean ± half_width, with half_width =
    t_{(1+confidence)/2, n-1} * s / sqrt(n) (s the sample standard deviation); None for a
    single value, which has no interval."""
    x = np.asarray(list(values), dtype=float)
    if x.size == 0:
        raise ValueError("mean_ci needs at least one value")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    mean = float(x.mean())
    if x.size == 1:
        return mean, None, 1
    sem = float(x.std(ddof=1)) / math.sqrt(x.size)
    return mean, float(student_t.ppf((1 + confidence) / 2, x.size - 1)) * sem, int(x.size)


def difference_ci(a: Iterable[float], b: Iterable[float], confidence: float = 0.95) -> tuple[float, float | None]:
    """``(mean(a) - mean(b), half_width)`` of two independent samples (Welch: t with the
    Welch-Satterthwaite degrees of freedom); None when either has a single value."""
    x, y = np.asarray(list(a), dtype=float), np.asarray(list(b), dtype=float)
    if x.size == 0 or y.size == 0:
        raise ValueError("difference_ci needs at least one value on each side")
    diff = float(x.mean() - y.mean())
    if x.size < 2 or y.size < 2:
        return diff, None
    vx, vy = x.var(ddof=1) / x.size, y.var(ddof=1) / y.size
    se = math.sqrt(vx + vy)
    if se == 0:
        return diff, 0.0
    df = (vx + vy) ** 2 / (vx**2 / (x.size - 1) + vy**2 / (y.size - 1))
    return diff, float(student_t.ppf((1 + confidence) / 2, df)) * se
