"""Effects of a designed study, fitted with the run as the unit so that training noise sits in the residual.

Each finished run is one observation: its final-validation metric y_i with its within-run standard error s_i
(clustered by document). The model is the design's (main effects, the two-factor interactions it resolves,
or one-at-a-time moves), fitted on the design's runs.

Runs differ in measurement noise, so the fit weights them as a random-effects meta-regression does:
tau^2, the variance between runs beyond measurement (training noise, unmodelled interactions), is estimated
by moments from an unweighted fit (residual mean square minus the mean s_i^2, at least 0); the weighted fit
uses w_i = 1 / (tau^2 + s_i^2) and re-estimates its scale from the residuals, with t intervals on the
residual degrees of freedom (the Knapp-Hartung adjustment). With equal s_i this is ordinary least squares.

A reference arm (e.g. DFlash across seeds) is its own population: another algorithm trains with another
seed-to-seed spread (DFlash's was 3x DFlash2's at 200 steps), so it does not borrow the design's residual. Its
runs give their own mean and variance, max(sample variance, mean s_i^2) (the spread between seeds, never
below what measurement alone explains), and the design runs (mean over its points) − reference is a Welch
difference of the two arms' means, its degrees of freedom by Welch-Satterthwaite. A reference arm of one run
has no variance of its own, and that difference gets no interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import statsmodels.api as sm
from scipy import stats

from harness.design import APPEARED, GREW, HELD, INCONCLUSIVE, REVERSED, SHRANK, Design, FactorialDesign, Term
from harness.uncertainty import CONFIDENCE, Estimate, t_interval, unpaired_difference, welch_dof

RESOLVED, BOUNDED, NOT_DISTINGUISHABLE = "resolved", "bounded", "not distinguishable"
ARM = "arm"
POWER = 0.8  # the power at which the report states the smallest effect a design would resolve
EXACT = 1e-9  # below this, a fitted effect and its standard error are floating-point rounding of zero


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
        if self.label == BOUNDED and self.bound == 0:
            return f"{self.estimate.text(signed=True)}: bounded (identical runs)"
        if self.label == BOUNDED:
            return f"{self.estimate.text(signed=True)}: bounded, |effect| < {self.bound:.3f} at 95%"
        return f"{self.estimate.text(signed=True)}: {self.label}"


@dataclass(frozen=True)
class ArmNoise:
    """One arm's noise as its runs show it: how far apart its runs lie, and what measurement alone explains."""

    runs: int
    spread: float  # the runs' standard deviation (design runs: the residual's, around the fitted model)
    within_se: float  # root mean square of the runs' within-run standard errors
    between: float  # the spread beyond measurement, sqrt(max(0, spread^2 - within_se^2)): training noise

    @classmethod
    def of(cls, spread: float, ses: list[float], runs: int) -> ArmNoise:
        within = math.sqrt(float(np.mean(np.square(ses)))) if ses else float("nan")
        return cls(runs, spread, within, math.sqrt(max(0.0, spread**2 - within**2)) if runs > 1 else float("nan"))


@dataclass(frozen=True)
class Fit:
    effects: list[Effect]
    residual_dof: int
    tau2: float  # between-run variance beyond measurement noise, among the design's runs
    runs: int
    note: str = ""
    design_noise: ArmNoise | None = None
    reference_noise: ArmNoise | None = None  # None without reference runs
    design_mean: Estimate | None = None  # the design runs' mean over its points (one at a time: the centre)
    reference_mean: Estimate | None = None


def label(estimate: Estimate, margin: float) -> tuple[str, float]:
    """resolved when the interval excludes 0; bounded when it lies inside ±margin; else not distinguishable."""
    if math.isnan(estimate.low):
        return NOT_DISTINGUISHABLE, float("nan")
    if estimate.se < EXACT and abs(estimate.value) < EXACT:  # identical runs: rounding, not an effect
        return BOUNDED, 0.0
    bound = max(abs(estimate.low), abs(estimate.high))
    if estimate.excludes_zero:
        return RESOLVED, bound
    return (BOUNDED if bound < margin else NOT_DISTINGUISHABLE), bound


def design_matrix(design: Design, units: list[Unit], terms: list[Term]) -> tuple[np.ndarray, list[str]]:
    """Intercept, then one column per term, for design runs."""
    columns = [np.ones(len(units))] + [np.array([design.code(u.point, term) for u in units]) for term in terms]
    return np.column_stack(columns), ["intercept", *(term.name for term in terms)]


def reference_mean(units: list[Unit]) -> tuple[Estimate, ArmNoise]:
    """The reference arm's mean over its runs, with the variance its own runs show (see the module doc)."""
    values = np.array([u.value for u in units])
    ses = [u.se if math.isfinite(u.se) else 0.0 for u in units]
    spread = float(values.std(ddof=1)) if len(units) > 1 else float("nan")
    noise = ArmNoise.of(spread, ses, len(units))
    if len(units) < 2:
        return Estimate(float(values.mean()), float("nan"), float("nan"), float("nan"), len(units)), noise
    variance = max(spread**2, noise.within_se**2)
    return t_interval(float(values.mean()), math.sqrt(variance / len(units)), len(units)), noise


def fit_design(
    design: Design, units: list[Unit], margin: float, interactions: bool, confidence: float = CONFIDENCE
) -> Fit:
    """The design's effects on its runs, and design − reference when reference runs (point None) take part;
    terms with no residual degrees of freedom get no interval."""
    points = [u for u in units if u.point is not None]
    reference = [u for u in units if u.point is None]
    terms = design.terms(interactions)
    x, names = design_matrix(design, points, terms)
    y = np.array([u.value for u in points])
    s2 = np.array([u.se**2 if math.isfinite(u.se) else 0.0 for u in points])
    rank = int(np.linalg.matrix_rank(x)) if points else 0
    if rank < x.shape[1]:  # a point has no run yet: some effects are not estimable
        return Fit([], len(points) - rank, float("nan"), len(units), "not every design point has a finished run")
    dof = len(points) - rank
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
    for index, name in enumerate(names[1:], 1):
        value, se = scale * float(weighted.params[index]), scale * float(weighted.bse[index])
        low, high = scale * float(low_high[index][0]), scale * float(low_high[index][1])
        estimate = Estimate(value, se, low, high, int(dof) + 1)  # n: as many units as leave `dof` (n − 1)
        kind, bound = label(estimate, margin)
        effects.append(Effect(name, estimate, kind, bound, (t_crit + t_power) * se))
    design_noise = ArmNoise.of(math.sqrt(float(unweighted.scale)), list(np.sqrt(s2)), len(points))
    # The intercept is the design runs' mean over its points (a one-at-a-time design's: its centre).
    mean = Estimate(
        float(weighted.params[0]), float(weighted.bse[0]), float(low_high[0][0]), float(low_high[0][1]), dof + 1
    )
    reference_estimate = reference_noise = None
    if reference:
        reference_estimate, reference_noise = reference_mean(reference)
        difference = unpaired_difference(mean, reference_estimate, confidence)
        effects.insert(0, arm_effect(difference, welch_dof(mean, reference_estimate), margin, confidence))
    return Fit(effects, int(dof), tau2, len(units), "", design_noise, reference_noise, mean, reference_estimate)


def arm_effect(difference: Estimate, dof: float, margin: float, confidence: float = CONFIDENCE) -> Effect:
    """Design − reference as an effect: its label, bound and detectable size on its Welch degrees of freedom."""
    kind, bound = label(difference, margin)
    if math.isnan(difference.low):
        return Effect(ARM, difference, kind, bound, float("nan"))
    t_sum = float(stats.t.ppf(0.5 + confidence / 2, dof)) + float(stats.t.ppf(POWER, dof))
    return Effect(ARM, difference, kind, bound, t_sum * difference.se)


def transfer_label(short: Effect, long: Effect) -> tuple[str, Estimate]:
    """How an effect carried from a short budget to a longer one, and the change (long − short, the two fits'
    runs independent)."""
    change = unpaired_difference(long.estimate, short.estimate)
    if long.label == RESOLVED and short.label == RESOLVED:
        if (long.estimate.value > 0) != (short.estimate.value > 0):
            return REVERSED, change
        sign = 1.0 if short.estimate.value > 0 else -1.0
        if change.excludes_zero:
            return (GREW if sign * change.value > 0 else SHRANK), change
        return HELD, change
    if long.label == RESOLVED:
        return APPEARED, change
    if short.label == RESOLVED:
        toward_zero = change.excludes_zero and (change.value > 0) != (short.estimate.value > 0)
        return (SHRANK if long.label == BOUNDED or toward_zero else INCONCLUSIVE), change
    if short.label == BOUNDED and long.label == BOUNDED:
        return HELD, change
    return INCONCLUSIVE, change
