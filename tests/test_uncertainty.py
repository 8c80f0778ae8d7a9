"""The interval estimators: coverage on simulated documents, hand-computed cases, pairing."""

import math

import numpy as np
import pytest
from scipy import stats

from harness.uncertainty import (
    Estimate,
    mean_estimate,
    paired_difference,
    ratio_estimate,
    unpaired_difference,
    wilson,
)


def test_clustered_interval_covers_the_truth_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    simulations, covered, naive = 1000, 0, 0
    for _ in range(simulations):
        rates = rng.beta(3, 2, size=30)  # mean 0.6
        anchors = rng.integers(5, 40, size=30)
        accepted = rng.binomial(anchors, rates)
        estimate = ratio_estimate(accepted, anchors)
        covered += estimate.low <= 0.6 <= estimate.high
        low, high = wilson(accepted.sum(), anchors.sum())  # as if anchors were independent
        naive += low <= 0.6 <= high
    assert 0.92 <= covered / simulations <= 0.98
    # Treating correlated anchors as independent undercovers badly: the reason to cluster by document.
    assert naive / simulations < 0.8


def test_one_anchor_per_document_gives_the_binomial_standard_error():
    successes = np.array([1] * 30 + [0] * 70)
    estimate = ratio_estimate(successes, np.ones(100))
    p, n = 0.3, 100
    # The linearised estimator carries the usual n / (n - 1) small-sample factor.
    assert estimate.value == pytest.approx(p)
    assert estimate.se == pytest.approx(math.sqrt(p * (1 - p) / n) * math.sqrt(n / (n - 1)))


def test_mean_estimate_is_the_t_interval():
    values = [1.0, 2.0, 4.0]
    estimate = mean_estimate(values)
    se = np.std(values, ddof=1) / math.sqrt(3)
    assert estimate.value == pytest.approx(7 / 3)
    assert estimate.se == pytest.approx(se)
    assert estimate.high - estimate.value == pytest.approx(stats.t.ppf(0.975, 2) * se)


def test_paired_difference_by_hand():
    # Per-document differences of sums [1, 0, 1] over totals [1, 2, 2]: D = 2/5, residuals [0.6, -0.8, 0.2]/5.
    estimate = paired_difference([2, 3, 4], [1, 2, 2], [1, 3, 3], [1, 2, 2])
    assert estimate.value == pytest.approx(0.4)
    assert estimate.se == pytest.approx(math.sqrt(1.5 * (0.36 + 0.64 + 0.04) / 25))
    assert estimate.high - 0.4 == pytest.approx(stats.t.ppf(0.975, 2) * estimate.se)


def test_pairing_on_shared_anchors_is_narrower_than_unpaired():
    rng = np.random.default_rng(1)
    anchors = rng.integers(5, 40, size=40)
    difficulty = rng.beta(3, 2, size=40)  # shared by both runs: what pairing cancels
    a = rng.binomial(anchors, np.clip(difficulty + 0.05, 0, 1))
    b = rng.binomial(anchors, difficulty)
    paired = paired_difference(a, anchors, b, anchors)
    unpaired = unpaired_difference(ratio_estimate(a, anchors), ratio_estimate(b, anchors))
    assert paired.value == pytest.approx(unpaired.value)
    assert paired.se < 0.7 * unpaired.se


def test_wilson_matches_the_closed_form():
    low, high = wilson(8, 10)
    z = stats.norm.ppf(0.975)
    centre = (0.8 + z * z / 20) / (1 + z * z / 10)
    half = z * math.sqrt(0.8 * 0.2 / 10 + z * z / 400) / (1 + z * z / 10)
    assert (low, high) == pytest.approx((centre - half, centre + half))
    assert wilson(0, 0) != wilson(0, 0)  # nan: no trials, no interval
    assert wilson(5, 5)[1] == 1.0


def test_estimates_round_to_what_their_uncertainty_supports():
    assert Estimate(1.41876, 0.0312, 1.35, 1.48, 24).text() == "1.419 [1.350, 1.480]"
    assert Estimate(1.41876, 0.31, 0.8, 2.0, 24).text() == "1.42 [0.80, 2.00]"
    assert Estimate(0.354, 0.05, 0.25, 0.45, 3).text(signed=True) == "+0.354 [+0.250, +0.450]"
    assert not Estimate(0.1, 0.05, -0.01, 0.2, 3).excludes_zero
    assert Estimate(0.1, 0.03, 0.02, 0.2, 3).excludes_zero
