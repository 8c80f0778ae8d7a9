"""The designed-study fit: coverage of the true effects on simulated studies, power, labels, hand cases."""

import math

import numpy as np
import pytest
from scipy import stats

from harness.design import APPEARED, GREW, HELD, INCONCLUSIVE, REVERSED, SHRANK, FactorialDesign, OneAtATimeDesign
from harness.uncertainty import Estimate, ratio_estimate
from reports.effects import (
    ARM,
    BOUNDED,
    NOT_DISTINGUISHABLE,
    RESOLVED,
    Effect,
    Unit,
    fit_design,
    label,
    transfer_label,
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


def simulate_study(rng, seeds=1, references=3, seed_sd=0.06, doc_sd=0.35, reference_sd=None):
    """The 2^(5-1) design on `seeds` seeds plus `references` reference runs (training noise `reference_sd`,
    by default the design's), on shared documents."""
    difficulty = rng.normal(0, 0.3, DOCUMENTS)  # every run meets the same documents
    sizes = rng.integers(4, 30, DOCUMENTS).astype(float)
    units = []
    for point in FIVE.points():
        mean = 1.2 + ARM_EFFECT + sum(TRUE_EFFECTS[f] / 2 * FIVE.coded_level(f, point[f]) for f in TRUE_EFFECTS)
        for _ in range(seeds):
            units.append(Unit(point, *simulate_run(rng, mean, difficulty, sizes, seed_sd, doc_sd)))
    for _ in range(references):
        noise = seed_sd if reference_sd is None else reference_sd
        units.append(Unit(None, *simulate_run(rng, 1.2, difficulty, sizes, noise, doc_sd)))
    return units


def test_intervals_cover_the_true_effects_95_percent_of_the_time():
    rng = np.random.default_rng(7)
    simulations, covered, total = 400, 0, 0
    truth = {**TRUE_EFFECTS, ARM: ARM_EFFECT}
    for _ in range(simulations):
        fit = fit_design(FIVE, simulate_study(rng), margin=0.05, interactions=False)
        assert fit.residual_dof == 16 - 6
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


def test_the_reference_arm_carries_its_own_training_noise():
    """A reference that trains far noisier than the design (DFlash against DFlash2 at 200 steps): design −
    reference must still cover at 95%. Borrowing the design's residual would cover about half the time."""
    rng = np.random.default_rng(17)
    covered, widths = 0, []
    for _ in range(400):
        units = simulate_study(rng, references=3, seed_sd=0.02, doc_sd=0.05, reference_sd=0.25)
        fit = fit_design(FIVE, units, margin=0.05, interactions=False)
        arm = next(e for e in fit.effects if e.term == ARM)
        covered += arm.estimate.low <= ARM_EFFECT <= arm.estimate.high
        widths.append(arm.estimate.high - arm.estimate.low)
        assert fit.reference_noise.runs == 3 and fit.design_noise.runs == 16
    assert 0.92 <= covered / 400 <= 0.995
    # The interval is as wide as the reference's spread makes it: t(2) * 0.25 / sqrt(3) either side, at least.
    assert float(np.median(widths)) > 2 * stats.t.ppf(0.975, 2) * 0.25 / math.sqrt(3) * 0.7


def test_a_reference_arm_of_one_run_gets_no_interval():
    rng = np.random.default_rng(2)
    fit = fit_design(FIVE, simulate_study(rng, references=1), margin=0.05, interactions=False)
    arm = next(e for e in fit.effects if e.term == ARM)
    assert math.isnan(arm.estimate.low) and arm.label == NOT_DISTINGUISHABLE
    assert all(not math.isnan(e.estimate.low) for e in fit.effects if e.term != ARM)


def test_hand_computed_reference_arm():
    """Design mean 1.5 (equal runs around it), reference 1.0, 1.2, 1.1: sample sd 0.1, se 0.1 / sqrt(3)."""
    design = FactorialDesign({"a": (0, 1)})
    units = [Unit({"a": level}, 1.5 + delta, 0.0) for level in (0, 1) for delta in (-0.01, 0.01)]
    units += [Unit(None, value, 0.01) for value in (1.0, 1.2, 1.1)]
    fit = fit_design(design, units, margin=0.05, interactions=False)
    arm = fit.effects[0]
    assert arm.term == ARM and arm.estimate.value == pytest.approx(0.4)
    design_se = math.sqrt(0.0004 / 2 / 4)  # residual variance 0.0004 on 2 df over 4 runs
    se = math.hypot(design_se, 0.1 / math.sqrt(3))
    assert arm.estimate.se == pytest.approx(se, rel=1e-6)
    assert fit.reference_noise.spread == pytest.approx(0.1) and fit.reference_noise.within_se == pytest.approx(0.01)
    assert fit.reference_noise.between == pytest.approx(math.sqrt(0.01 - 0.0001))


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


def effect_at(value: float, se: float, dof: int = 10, margin: float = 0.05) -> Effect:
    """An effect as a fit states it: a t interval on `dof` residual degrees of freedom, and its label."""
    half = stats.t.ppf(0.975, dof) * se
    estimate = Estimate(value, se, value - half, value + half, dof + 1)
    kind, bound = label(estimate, margin)
    return Effect("A", estimate, kind, bound, float("nan"))


@pytest.mark.parametrize(
    "short, long, expected",
    [
        ((0.15, 0.02), (0.17, 0.02), HELD),  # resolved at both, change +0.02 not resolved
        ((0.0, 0.01), (0.01, 0.01), HELD),  # bounded at both
        ((0.15, 0.02), (-0.12, 0.02), REVERSED),
        ((0.01, 0.03), (0.20, 0.03), APPEARED),  # not distinguishable, then resolved
        ((0.00, 0.01), (0.20, 0.03), APPEARED),  # bounded, then resolved
        ((0.10, 0.01), (0.40, 0.02), GREW),
        ((-0.10, 0.01), (-0.40, 0.02), GREW),  # larger in size, in the effect's own direction
        ((0.40, 0.02), (0.10, 0.01), SHRANK),
        ((0.15, 0.02), (0.00, 0.01), SHRANK),  # resolved, then bounded
        ((0.15, 0.02), (0.05, 0.06), INCONCLUSIVE),  # the longer budget's interval is too wide to tell
        ((0.01, 0.05), (0.02, 0.05), INCONCLUSIVE),
    ],
)
def test_transfer_labels_on_constructed_cases(short, long, expected):
    found, change = transfer_label(effect_at(*short), effect_at(*long))
    assert found == expected
    assert change.value == pytest.approx(long[0] - short[0])
    assert change.se == pytest.approx(math.hypot(short[1], long[1]))


def test_identical_runs_resolve_nothing():
    """Every run at 1.000 (nothing accepted yet): the fit's rounding leaves ~1e-17 with a ~1e-17 interval, which
    must read as bounded, not as a resolved effect."""
    design = FactorialDesign({"a": (0, 1)})
    units = [Unit({"a": level}, 1.0, 0.0) for level in (0, 1) for _ in range(2)]
    estimate = Estimate(1e-17, 1e-18, 5e-18, 2e-17, 3)
    assert label(estimate, margin=0.05)[0] == BOUNDED
    assert all(e.label == BOUNDED for e in fit_design(design, units, 0.05, False).effects)
