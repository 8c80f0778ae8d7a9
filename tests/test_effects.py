"""The designed-study fit: coverage of the true effects on simulated studies, power, labels, hand cases."""

import math

import numpy as np
import pytest
from scipy import stats

from harness.design import FactorialDesign, OneAtATimeDesign
from harness.uncertainty import Estimate, ratio_estimate
from reports.effects import (
    ARM,
    BOUNDED,
    NOT_DISTINGUISHABLE,
    RESOLVED,
    Unit,
    fit_design,
    label,
)

FIVE = FactorialDesign.standard({name: (0, 1) for name in "ABCDE"}, fraction=1)
TRUE_EFFECTS = {"A": 0.30, "B": -0.10, "C": 0.0, "D": 0.05, "E": 0.0}  # high − low, in accepted tokens
ARM_EFFECT = 0.25
DOCUMENTS = 24


def simulate_run(rng, mean, difficulty, sizes, seed_sd, doc_sd):
    """One run's final validation: a training-noise draw, then per-document accepted sums over anchors."""
    trained = mean + rng.normal(0, seed_sd)
    per_anchor = trained + difficulty + rng.normal(0, doc_sd, DOCUMENTS)  # this run's document-level noise
    accepted = rng.normal(per_anchor * sizes, 0.6 * np.sqrt(sizes))  # anchor noise within a document
    estimate = ratio_estimate(accepted, sizes)
    return estimate.value, estimate.se


def simulate_study(rng, seeds=1, references=3, seed_sd=0.06, doc_sd=0.35):
    """The 2^(5-1) design on `seeds` seeds plus `references` reference runs, on shared documents."""
    difficulty = rng.normal(0, 0.3, DOCUMENTS)  # every run meets the same documents
    sizes = rng.integers(4, 30, DOCUMENTS).astype(float)
    units = []
    for point in FIVE.points():
        mean = 1.2 + ARM_EFFECT + sum(TRUE_EFFECTS[f] / 2 * FIVE.coded_level(f, point[f]) for f in TRUE_EFFECTS)
        for _ in range(seeds):
            units.append(Unit(point, *simulate_run(rng, mean, difficulty, sizes, seed_sd, doc_sd)))
    for _ in range(references):
        units.append(Unit(None, *simulate_run(rng, 1.2, difficulty, sizes, seed_sd, doc_sd)))
    return units


def test_intervals_cover_the_true_effects_95_percent_of_the_time():
    rng = np.random.default_rng(7)
    simulations, covered, total = 400, 0, 0
    truth = {**TRUE_EFFECTS, ARM: ARM_EFFECT}
    for _ in range(simulations):
        fit = fit_design(FIVE, simulate_study(rng), margin=0.05, interactions=False)
        assert fit.residual_dof == 19 - 7
        for effect in fit.effects:
            covered += effect.estimate.low <= truth[effect.term] <= effect.estimate.high
            total += 1
    assert total == simulations * 6
    assert 0.92 <= covered / total <= 0.98


def test_heterogeneous_measurement_noise_keeps_coverage():
    """Half the runs measured on far fewer anchors: the weighted fit must still cover."""
    rng = np.random.default_rng(11)
    covered = total = 0
    for _ in range(400):
        units = simulate_study(rng, seeds=2, references=4)
        noisy = [Unit(u.point, u.value + rng.normal(0, 0.15), math.hypot(u.se, 0.15)) for u in units[::2]]
        units = noisy + units[1::2]
        fit = fit_design(FIVE, units, margin=0.05, interactions=False)
        for effect in fit.effects:
            truth = ARM_EFFECT if effect.term == ARM else TRUE_EFFECTS[effect.term]
            covered += effect.estimate.low <= truth <= effect.estimate.high
            total += 1
    assert 0.92 <= covered / total <= 0.98


def test_power_matches_the_noncentral_t_and_the_stated_detectable_effect():
    """The share of simulations resolving A (0.30) matches the power the fit's own detectable size implies."""
    rng = np.random.default_rng(3)
    resolved, detectable = 0, []
    for _ in range(400):
        fit = fit_design(FIVE, simulate_study(rng, seed_sd=0.15), margin=0.05, interactions=False)
        effect = next(e for e in fit.effects if e.term == "A")
        resolved += effect.label == RESOLVED
        detectable.append(effect.detectable)
        se = effect.estimate.se
    dof = fit.residual_dof
    # Analytic power at the mean standard error: P(|T| > t_crit) under a noncentral t.
    t_crit = stats.t.ppf(0.975, dof)
    noncentrality = TRUE_EFFECTS["A"] / se
    power = 1 - stats.nct.cdf(t_crit, dof, noncentrality) + stats.nct.cdf(-t_crit, dof, noncentrality)
    observed = resolved / 400
    assert abs(observed - power) < 0.12
    # 0.30 lies near the median detectable size (80% power), so it resolves in roughly 60-95% of studies.
    assert 0.55 < observed < 0.97
    assert 0.15 < float(np.median(detectable)) < 0.45


def test_a_real_effect_is_resolved_and_null_effects_are_bounded_or_not_distinguishable():
    rng = np.random.default_rng(5)
    counts = {term: {RESOLVED: 0, BOUNDED: 0, NOT_DISTINGUISHABLE: 0} for term in (*TRUE_EFFECTS, ARM)}
    for _ in range(100):
        units = simulate_study(rng, seeds=3, references=6, seed_sd=0.03, doc_sd=0.1)
        for effect in fit_design(FIVE, units, margin=0.05, interactions=False).effects:
            counts[effect.term][effect.label] += 1
    assert counts["A"][RESOLVED] == 100 and counts[ARM][RESOLVED] == 100
    for null in ("C", "E"):  # false resolutions at about the 5% level; most intervals fit inside ±0.05
        assert counts[null][RESOLVED] <= 12
        assert counts[null][BOUNDED] >= 50


def test_hand_computed_two_by_two():
    """2×2 full factorial, two seeds, equal standard errors: effects are differences of means, OLS intervals."""
    design = FactorialDesign({"conv": ("off", "on"), "selector": ("off", "on")})
    values = {
        ("off", "off"): (1.0, 1.2),
        ("on", "off"): (1.4, 1.6),
        ("off", "on"): (1.1, 1.3),
        ("on", "on"): (1.5, 1.9),
    }
    units = [Unit({"conv": c, "selector": s}, value, 0.01) for (c, s), pair in values.items() for value in pair]
    fit = fit_design(design, units, margin=0.05, interactions=True)
    effects = {e.term: e.estimate for e in fit.effects}
    # conv: mean(on) − mean(off) = (1.4+1.6+1.5+1.9)/4 − (1.0+1.2+1.1+1.3)/4 = 0.45
    assert effects["conv"].value == pytest.approx(0.45)
    assert effects["selector"].value == pytest.approx(0.15)
    # interaction: ((1.7 − 1.2) − (1.5 − 1.1)) / 2 = 0.05
    assert effects["conv×selector"].value == pytest.approx(0.05)
    # Residual: each cell's two seeds differ by 0.2 (0.4 in the last): s^2 = (3 * 0.02 + 0.08) / 4 = 0.035
    se = 2 * math.sqrt(0.035 / 8)
    assert fit.residual_dof == 4
    assert effects["conv"].se == pytest.approx(se, rel=1e-6)
    assert effects["conv"].high - effects["conv"].value == pytest.approx(stats.t.ppf(0.975, 4) * se, rel=1e-6)


def test_one_at_a_time_moves_are_differences_from_the_centre():
    design = OneAtATimeDesign({"k": 2}, {"k": (1, 3)})
    units = [Unit({"k": 2}, v, 0.0) for v in (1.0, 1.1)] + [Unit({"k": 3}, v, 0.0) for v in (1.3, 1.4)]
    units += [Unit({"k": 1}, v, 0.0) for v in (1.05, 1.05)]
    fit = fit_design(design, units, margin=0.05, interactions=False)
    effects = {e.term: e.estimate.value for e in fit.effects}
    assert effects == pytest.approx({"k=1": 0.0, "k=3": 0.3})
    assert fit.residual_dof == 3


def test_no_residual_degrees_of_freedom_gives_no_interval():
    design = FactorialDesign({"a": (0, 1)})
    fit = fit_design(design, [Unit({"a": 0}, 1.0, 0.1), Unit({"a": 1}, 1.2, 0.1)], 0.05, False)
    assert fit.effects == [] and fit.residual_dof == 0 and "no residual" in fit.note


@pytest.mark.parametrize(
    "low, high, expected",
    [(0.01, 0.2, RESOLVED), (-0.04, 0.03, BOUNDED), (-0.2, 0.1, NOT_DISTINGUISHABLE), (-0.3, -0.1, RESOLVED)],
)
def test_labels(low, high, expected):
    assert label(Estimate((low + high) / 2, 0.01, low, high, 5), margin=0.05)[0] == expected


def test_a_design_missing_a_point_estimates_nothing():
    """Before every point has a run, some effects are not estimable: no label may come from such a fit."""
    design = FactorialDesign({"conv": ("off", "on"), "selector": ("off", "on")})
    units = [Unit({"conv": c, "selector": "off"}, v, 0.01) for c in ("off", "on") for v in (1.0, 1.4)]
    fit = fit_design(design, units, margin=0.05, interactions=False)
    assert fit.effects == [] and "not every design point" in fit.note
