"""Effects of a designed study, fitted with the run as the unit so that training noise sits in the residual.

Each finished run is one observation: its final-validation metric y_i with its within-run standard error s_i
(clustered by document). The model is the design's (main effects, the two-factor interactions it resolves,
or one-at-a-time moves), plus an arm indicator when reference runs (e.g. DFlash across seeds) join the fit.

Runs differ in measurement noise, so the fit weights them as a random-effects meta-regression does:
tau^2, the variance between runs beyond measurement (training noise, unmodelled interactions), is estimated
by moments from an unweighted fit (residual mean square minus the mean s_i^2, at least 0); the weighted fit
uses w_i = 1 / (tau^2 + s_i^2) and re-estimates its scale from the residuals, with t intervals on the
residual degrees of freedom (the Knapp-Hartung adjustment). With equal s_i this is ordinary least squares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import statsmodels.api as sm
from scipy import stats

from harness.design import Design, FactorialDesign, Term
from harness.uncertainty import CONFIDENCE, Estimate

RESOLVED, BOUNDED, NOT_DISTINGUISHABLE = "resolved", "bounded", "not distinguishable"
ARM = "arm"
POWER = 0.8  # the power at which the report states the smallest effect a design would resolve


@dataclass(frozen=True)
class Unit:
    """One finished run: its design point (None for a reference run), metric and within-run standard error."""

    point: dict[str, Any] | None
    value: float
    se: float
    name: str = ""


@dataclass(frozen=True)
class Effect:
    """One fitted term: high − low (a factorial), level − centre (one at a time), or arm − reference."""

    term: str
    estimate: Estimate
    label: str
    bound: float  # the largest |effect| the interval allows
    detectable: float  # the smallest |effect| this fit resolves with POWER

    def text(self) -> str:
        if self.label == BOUNDED:
            return f"{self.estimate.text(signed=True)}: bounded, |effect| < {self.bound:.3f} at 95%"
        return f"{self.estimate.text(signed=True)}: {self.label}"


@dataclass(frozen=True)
class Fit:
    effects: list[Effect]
    residual_dof: int
    tau2: float  # between-run variance beyond measurement noise
    runs: int
    note: str = ""


def label(estimate: Estimate, margin: float) -> tuple[str, float]:
    """resolved when the interval excludes 0; bounded when it lies inside ±margin; else not distinguishable."""
    if math.isnan(estimate.low):
        return NOT_DISTINGUISHABLE, float("nan")
    bound = max(abs(estimate.low), abs(estimate.high))
    if estimate.excludes_zero:
        return RESOLVED, bound
    return (BOUNDED if bound < margin else NOT_DISTINGUISHABLE), bound


def design_matrix(design: Design, units: list[Unit], terms: list[Term]) -> tuple[np.ndarray, list[str]]:
    """Intercept, an arm column when reference units take part, then one column per term (0 for reference)."""
    has_reference = any(u.point is None for u in units)
    columns, names = [np.ones(len(units))], ["intercept"]
    if has_reference:
        columns.append(np.array([0.0 if u.point is None else 1.0 for u in units]))
        names.append(ARM)
    for term in terms:
        columns.append(np.array([0.0 if u.point is None else design.code(u.point, term) for u in units]))
        names.append(term.name)
    return np.column_stack(columns), names


def fit_design(
    design: Design, units: list[Unit], margin: float, interactions: bool, confidence: float = CONFIDENCE
) -> Fit:
    """The design's effects on these runs; terms with no residual degrees of freedom get no interval."""
    terms = design.terms(interactions)
    x, names = design_matrix(design, units, terms)
    y = np.array([u.value for u in units])
    s2 = np.array([u.se**2 if math.isfinite(u.se) else 0.0 for u in units])
    rank = int(np.linalg.matrix_rank(x))
    if rank < x.shape[1]:  # a point or the reference arm has no run yet: some effects are not estimable
        return Fit([], len(units) - rank, float("nan"), len(units), "not every design point has a finished run")
    dof = len(units) - rank
    if dof < 1:
        return Fit([], int(dof), float("nan"), len(units), "no residual degrees of freedom: add seeds or runs")
    unweighted = sm.OLS(y, x).fit()
    tau2 = max(0.0, float(unweighted.scale) - float(s2.mean()))
    weights = 1.0 / np.maximum(tau2 + s2, 1e-12)
    weighted = sm.WLS(y, x, weights=weights).fit() if s2.any() else unweighted
    low_high = weighted.conf_int(alpha=1 - confidence)
    t_crit = float(stats.t.ppf(0.5 + confidence / 2, dof))
    t_power = float(stats.t.ppf(POWER, dof))
    # A factorial's coefficient on -1/+1 coding is half the high − low difference.
    scale = 2.0 if isinstance(design, FactorialDesign) else 1.0
    effects = []
    for index, name in enumerate(names):
        if name == "intercept":
            continue
        factor = 1.0 if name == ARM else scale
        value, se = factor * float(weighted.params[index]), factor * float(weighted.bse[index])
        estimate = Estimate(value, se, factor * float(low_high[index][0]), factor * float(low_high[index][1]), int(dof))
        kind, bound = label(estimate, margin)
        effects.append(Effect(name, estimate, kind, bound, (t_crit + t_power) * se))
    return Fit(effects, int(dof), tau2, len(units))
