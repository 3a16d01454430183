"""Summary statistics over seeds: mean, sample standard deviation and Student-t 95% confidence intervals.

With n runs of a mechanism, the interval for its mean is ``mean ± t_{0.975, n-1} · s / sqrt(n)`` (s: the
sample standard deviation). Few seeds give wide intervals (t = 12.71 for n = 2, 4.30 for n = 3): that is
the honest width, and why ``zoo compare`` marks mechanisms whose interval overlaps the best one as tied
rather than ranking them below it. The t quantile is computed here (no SciPy): the t distribution's CDF
is the regularized incomplete beta function, evaluated with Lentz's continued fraction (Numerical
Recipes, 3rd ed., Sec. 6.4), and inverted by bisection.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Interval:
    """``n`` values summarised: ``mean``, sample ``std`` (0 for one value) and the 95% interval."""

    n: int
    mean: float
    std: float
    low: float
    high: float

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def overlaps(self, other: Interval) -> bool:
        return self.low <= other.high and other.low <= self.high


def summarize(values: Sequence[float], confidence: float = 0.95) -> Interval | None:
    """The interval of the finite ``values`` (None when there is none). One value gives a zero-width
    interval: a single seed says nothing about the spread, which the summary reports as n = 1."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    n = len(finite)
    if n == 0:
        return None
    mean = sum(finite) / n
    if n == 1:
        return Interval(1, mean, 0.0, mean, mean)
    std = math.sqrt(sum((v - mean) ** 2 for v in finite) / (n - 1))
    half = t_quantile(0.5 + confidence / 2, n - 1) * std / math.sqrt(n)
    return Interval(n, mean, std, mean - half, mean + half)


def t_quantile(p: float, dof: int) -> float:
    """The p-quantile of Student's t distribution with ``dof`` degrees of freedom (0.5 < p < 1)."""
    if not 0.5 < p < 1 or dof < 1:
        raise ValueError(f"need 0.5 < p < 1 and dof >= 1, got p={p}, dof={dof}")
    low, high = 0.0, 1.0
    while t_cdf(high, dof) < p:
        high *= 2
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if t_cdf(middle, dof) < p else (low, middle)
    return (low + high) / 2


def t_cdf(t: float, dof: int) -> float:
    """P(T <= t) for Student's t: 1 - I_x(dof/2, 1/2) / 2 with x = dof / (dof + t^2), for t >= 0."""
    tail = regularized_beta(dof / (dof + t * t), dof / 2, 0.5) / 2
    return 1 - tail if t >= 0 else tail


def regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), the regularized incomplete beta function."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _beta_fraction(x, a, b) / a
    return 1 - math.exp(log_front) * _beta_fraction(1 - x, b, a) / b


def _beta_fraction(x: float, a: float, b: float) -> float:
    """The continued fraction of I_x(a, b), by the modified Lentz method."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 300):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):  # fmt: skip
            d = 1 + numerator * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1) < eps:
            break
    return result
