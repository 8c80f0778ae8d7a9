"""Standard errors and 95% intervals for pooled metrics, clustered by validation document.

Every validation metric is a ratio of sums, R = sum_i y_i / sum_i x_i, over documents i (y: the metric's
sum over the document's anchors or slots, x: its total). Anchors of one document share a context and are
correlated, so the variance is linearised over documents (the delta method on the (sum, total) pairs), never
over anchors as if they were independent:

    se(R)^2 = n / (n - 1) * sum_i (y_i - R x_i)^2 / (sum_i x_i)^2

with a t interval on n - 1 degrees of freedom. A paired difference of two ratios measured on the same
documents linearises both and differences the per-document terms, which cancels what the two share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its standard error and interval over `n` independent units."""

    value: float
    se: float
    low: float
    high: float
    n: int

    @property
    def identical(self) -> bool:
        """A paired difference of exactly zero with a zero-width interval: both sides gave the same numbers,
        which is not noise."""
        return self.value == 0 and self.low == 0 and self.high == 0

    @property
    def excludes_zero(self) -> bool:
        return not math.isnan(self.low) and (self.low > 0 or self.high < 0)

    def digits(self) -> int:
        """Decimals the uncertainty supports: two significant digits of the standard error (at most 4)."""
        if not math.isfinite(self.se) or self.se <= 0:
            return 3
        return int(min(4, max(0, 1 - math.floor(math.log10(self.se)))))

    def text(self, signed: bool = False) -> str:
        """`1.42 [1.36, 1.48]`, rounded to what the interval supports."""
        if math.isnan(self.value):
            return "–"
        digits, sign = self.digits(), "+" if signed else ""
        if math.isnan(self.low):
            return f"{self.value:{sign}.{digits}f}"
        return f"{self.value:{sign}.{digits}f} [{self.low:{sign}.{digits}f}, {self.high:{sign}.{digits}f}]"


NO_ESTIMATE = Estimate(float("nan"), float("nan"), float("nan"), float("nan"), 0)


def t_interval(value: float, se: float, n: int, confidence: float = CONFIDENCE) -> Estimate:
    """value ± t(n-1) * se; no interval with fewer than two units."""
    if n < 2 or not math.isfinite(se):
        return Estimate(value, float("nan"), float("nan"), float("nan"), n)
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * se
    return Estimate(value, se, value - half, value + half, n)


def _linearised(sums: np.ndarray, totals: np.ndarray) -> tuple[float, np.ndarray]:
    """The pooled ratio and each document's influence on it, (y_i - R x_i) / sum x."""
    total = float(totals.sum())
    ratio = float(sums.sum()) / total
    return ratio, (sums - ratio * totals) / total


def _clustered_se(influence: np.ndarray) -> float:
    n = len(influence)
    return math.sqrt(n / (n - 1) * float((influence**2).sum())) if n > 1 else float("nan")


def ratio_estimate(sums, totals, confidence: float = CONFIDENCE) -> Estimate:
    """Sum over sum across documents, with its clustered standard error; documents with no total drop out."""
    sums, totals = np.asarray(sums, dtype=float), np.asarray(totals, dtype=float)
    keep = totals > 0
    sums, totals = sums[keep], totals[keep]
    if not keep.any():
        return NO_ESTIMATE
    ratio, influence = _linearised(sums, totals)
    return t_interval(ratio, _clustered_se(influence), len(sums), confidence)


def mean_estimate(values, confidence: float = CONFIDENCE) -> Estimate:
    """The mean of independent units (requests, seeds) with its t interval."""
    values = np.asarray(values, dtype=float)
    values = values[~np.isnan(values)]
    if values.size == 0:
        return NO_ESTIMATE
    return ratio_estimate(values, np.ones_like(values), confidence)


def paired_difference(a_sums, a_totals, b_sums, b_totals, confidence: float = CONFIDENCE) -> Estimate:
    """R_a - R_b where both were measured on the same documents (arrays aligned by document)."""
    a_sums, a_totals = np.asarray(a_sums, dtype=float), np.asarray(a_totals, dtype=float)
    b_sums, b_totals = np.asarray(b_sums, dtype=float), np.asarray(b_totals, dtype=float)
    keep = (a_totals > 0) | (b_totals > 0)
    if a_totals[keep].sum() <= 0 or b_totals[keep].sum() <= 0:
        return NO_ESTIMATE
    ratio_a, influence_a = _linearised(a_sums[keep], a_totals[keep])
    ratio_b, influence_b = _linearised(b_sums[keep], b_totals[keep])
    return t_interval(ratio_a - ratio_b, _clustered_se(influence_a - influence_b), int(keep.sum()), confidence)


def welch_dof(a: Estimate, b: Estimate) -> float:
    """The Welch-Satterthwaite degrees of freedom of a - b, each estimate on its own n - 1."""
    return (a.se**2 + b.se**2) ** 2 / (a.se**4 / max(a.n - 1, 1) + b.se**4 / max(b.n - 1, 1))


def unpaired_difference(a: Estimate, b: Estimate, confidence: float = CONFIDENCE) -> Estimate:
    """a - b for independent estimates (Welch-Satterthwaite degrees of freedom)."""
    se = math.sqrt(a.se**2 + b.se**2)
    if not math.isfinite(se) or se == 0:
        return Estimate(a.value - b.value, float("nan"), float("nan"), float("nan"), min(a.n, b.n))
    dof = welch_dof(a, b)
    half = float(stats.t.ppf(0.5 + confidence / 2, dof)) * se
    value = a.value - b.value
    return Estimate(value, se, value - half, value + half, min(a.n, b.n))


def wilson(successes: float, total: float, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (nan without trials)."""
    if total <= 0:
        return float("nan"), float("nan")
    z = float(stats.norm.ppf(0.5 + confidence / 2))
    p = successes / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    # Rounding may leave a bound a hair on the wrong side of p at p = 0 or 1.
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))
