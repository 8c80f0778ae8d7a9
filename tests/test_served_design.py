"""Designed effects on a served response: a simulation with known effects, seed noise and launch noise.

Each simulated run is a design point at a training seed (its own draw of seed noise), served in rounds of fresh
launches (each round its own draw of launch noise); the study analysis builds its units from what MLflow would hold
(the mean over rounds and their sample variance) and fits the design. The intervals must cover the true effects at
their nominal rate, and the launch noise pooled over runs must recover the simulated one.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from harness import tracking
from harness.design import FactorialDesign
from harness.serving import metrics as served_names
from reports.analysis import RecordedDesign, launch_noise, served_units
from reports.collect import StudyRecord
from reports.effects import fit_design

DESIGN = FactorialDesign({"conv": ("off", "on"), "selector": ("off", "on")})
TRUE = {"conv": 0.06, "selector": -0.04, "conv×selector": 0.0}  # high − low; the interaction's half-difference
SPEEDUP, ROUNDS, VARIANCE = (
    served_names.OBJECTIVE_SPEEDUP,
    served_names.ROUNDS_COLUMN,
    served_names.LAUNCH_VARIANCE_COLUMN,
)


def simulated_study(rng: np.random.Generator, seeds: int, rounds: int, seed_sd: float, launch_sd: float):
    """A served 2x2 design as its StudyRecord: per run the mean round speed-up and the rounds' variance."""
    rows = []
    for point in DESIGN.points():
        x = {f: DESIGN.coded_level(f, point[f]) for f in DESIGN.levels}
        truth = 0.8 + (TRUE["conv"] * x["conv"] + TRUE["selector"] * x["selector"]) / 2
        for seed in range(seeds):
            trained = truth + rng.normal(0, seed_sd)
            speedups = trained + rng.normal(0, launch_sd, rounds)
            name = f"trial-{point['conv']}-{point['selector']}-seed-{seed}"
            rows.append(
                {
                    "run_id": name,
                    "run_name": name,
                    "status": "finished",
                    "role": tracking.ROLE_TRIAL,
                    "design_point": json.dumps(point),
                    "baseline": "",
                    SPEEDUP: speedups.mean(),
                    f"{SPEEDUP}_se": speedups.std(ddof=1) / math.sqrt(rounds) if rounds > 1 else float("nan"),
                    ROUNDS: rounds,
                    VARIANCE: speedups.var(ddof=1) if rounds > 1 else float("nan"),
                }
            )
    runs = pd.DataFrame(rows)
    return StudyRecord("served", {"params": {}}, runs, {name: pd.DataFrame() for name in runs["run_id"]})


RECORDED = RecordedDesign(DESIGN, 0.05, "true", "", [], DESIGN, {})


def coverage(seed_sd: float, launch_sd: float, rounds: int = 2, simulations: int = 300) -> tuple[float, float, float]:
    """(covered fraction of the fitted intervals, of intervals that take the launch noise as the only noise, the
    mean pooled launch sd)."""
    rng = np.random.default_rng(20261206)
    covered = naive_covered = total = 0
    pooled = []
    for _ in range(simulations):
        record = simulated_study(rng, seeds=2, rounds=rounds, seed_sd=seed_sd, launch_sd=launch_sd)
        units, noise = served_units(record, RECORDED, SPEEDUP)
        pooled.append(noise.sd)
        fit = fit_design(DESIGN, units, margin=0.05, interactions=True)
        for effect in fit.effects:
            covered += effect.estimate.low <= TRUE[effect.term] <= effect.estimate.high
            # A fixed-effect interval on the runs' own launch standard errors: what ignoring seeds would give.
            naive_se = 2 * math.sqrt(np.mean([u.se**2 for u in units]) / len(units))
            naive_covered += abs(effect.estimate.value - TRUE[effect.term]) <= 1.96 * naive_se
            total += 1
    return covered / total, naive_covered / total, float(np.mean(pooled))


@pytest.mark.parametrize("seed_sd, launch_sd", [(0.03, 0.04), (0.0, 0.04), (0.05, 0.01)])
def test_served_effects_cover_the_truth_with_seed_and_launch_noise(seed_sd, launch_sd):
    """900 intervals (300 studies x 3 terms): the 95% t intervals cover at 0.95 ± 0.03 (about 4 binomial standard
    errors) whichever noise dominates, and the pooled launch sd recovers the simulated one within 10%."""
    found, _, pooled = coverage(seed_sd, launch_sd)
    assert 0.92 <= found <= 0.98, found
    assert pooled == pytest.approx(launch_sd, rel=0.1)


def test_one_round_per_run_still_covers_the_truth_with_launch_and_seed_noise_in_the_residual():
    """The default, one round per run: no run has a launch variance of its own, but each is served in its own
    launches, so the residual around the fitted effects holds launch and seed noise together and still covers."""
    found, _, pooled = coverage(seed_sd=0.03, launch_sd=0.04, rounds=1)
    assert 0.92 <= found <= 0.98 and math.isnan(pooled), (found, pooled)


def test_intervals_that_leave_out_the_seed_noise_would_fail_the_same_check():
    """The check can fail: with seed noise as large as the launch noise, intervals built on the launch noise alone
    cover far less than 95%, while the fitted ones still do."""
    found, naive, _ = coverage(seed_sd=0.04, launch_sd=0.04)
    assert naive < 0.85 and 0.92 <= found <= 0.98, (naive, found)


def test_launch_noise_pools_the_rounds_variances_by_their_degrees_of_freedom():
    rows = pd.DataFrame({ROUNDS: [2, 3, 1, 2], VARIANCE: [0.01, 0.04, float("nan"), float("nan")]})
    noise = launch_noise(rows)
    # (1 * 0.01 + 2 * 0.04) / 3 = 0.03; the one-round run and the run without a variance add nothing
    assert noise.dof == 3 and noise.runs == 2 and noise.sd == pytest.approx(math.sqrt(0.03))


def test_without_rounds_a_run_keeps_its_own_standard_error():
    rng = np.random.default_rng(0)
    record = simulated_study(rng, seeds=2, rounds=2, seed_sd=0.01, launch_sd=0.02)
    record.runs[ROUNDS] = 1
    units, noise = served_units(record, RECORDED, SPEEDUP)
    assert math.isnan(noise.sd) and noise.dof == 0
    assert [u.se for u in units] == pytest.approx(list(record.runs[f"{SPEEDUP}_se"]))


@pytest.mark.parametrize("rounds", [1, 2])
def test_the_served_effects_section_says_where_the_launch_noise_sits(rounds):
    """Two rounds or more: each run's standard error is the pooled launch sd; one round: launch and seed noise are
    in the residual together. Either way every term gets a row beside its offline effect."""
    from reports.analysis import BudgetFit, ServedFit
    from reports.designed import served_effects

    record = simulated_study(np.random.default_rng(rounds), seeds=2, rounds=rounds, seed_sd=0.03, launch_sd=0.04)
    units, noise = served_units(record, RECORDED, SPEEDUP)
    fit = fit_design(DESIGN, units, margin=0.05, interactions=True)
    served = ServedFit(SPEEDUP, BudgetFit(None, units, fit, True, 0.0), noise)
    text, lines = served_effects(served, fit, "")
    pooled = f"the launch-to-launch sd pooled over 8 runs (8 df), {noise.sd:.3f}" if rounds > 1 else ""
    one_round = "served in one round, a fresh server launch with the draft and one without; launch-to-launch noise"
    assert (pooled in text and one_round not in text) if rounds > 1 else (one_round in text), text
    assert len(lines) == 3 and all("launch and seed noise inside" in line for line in lines), lines
