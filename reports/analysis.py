"""One analysed study: every fact its report states, computed once from the tracking store.

`analyse` slices the runs at the first budget, groups them into configurations, fits a design at each of its
budgets and labels how each effect carried to the longer ones, finds the Pareto front of a two-objective study and
where the served runs stand against their break-even. The sections (reports/sections.py, reports/designed.py)
only render what it found, and the parent run's design metrics and transfer tags come from the same object, so a
report never fits the same design twice.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import numpy as np
import pandas as pd

from algorithms.metrics import REALIZED_ACCEPTED_LENGTH
from harness import tracking
from harness.design import Design, design_from_spec
from harness.pareto import pareto_front
from harness.serving import metrics as served_names
from harness.uncertainty import Estimate, ratio_estimate
from harness.validation import pairs
from reports.collect import StudyRecord
from reports.effects import Effect, Fit, Unit, fit_design, transfer_label
from reports.estimates import Configuration, configurations, estimate

MIN_RESIDUAL_DOF = 4  # `interactions: auto` fits the resolved 2FIs only while this many residual df remain


@dataclass(frozen=True)
class RecordedDesign:
    """The design a study declared, as its parent run recorded it."""

    design: Design
    margin: float
    interactions: str
    reference: str
    budgets: list[int]  # shortest first; [] where the store has no step budget
    longer: Design  # the design the longer budgets ran (the same one unless a fraction of it)
    transfer_measured: dict  # a one-budget design's transfer measured by another study: steps, source, labels


def recorded_budgets(record: StudyRecord) -> list[int]:
    """The study's step budgets as its parent run recorded them (stores from before `budgets:` have one)."""
    params = record.parent["params"]
    if params.get("study.budgets"):
        return [int(b) for b in params["study.budgets"].split(",")]
    steps = params.get("study.steps_per_trial", "")
    return [int(steps)] if str(steps).isdigit() else []


def at_budget(record: StudyRecord, steps: int) -> StudyRecord:
    """The study's runs trained for `steps`."""
    runs = record.runs if record.runs.empty else record.runs[record.runs["max_steps"] == steps]
    return dataclasses.replace(record, runs=runs.reset_index(drop=True))


def first_budget(record: StudyRecord) -> StudyRecord:
    """What every section but the budget transfer reads: the runs at the study's first budget."""
    budgets = recorded_budgets(record)
    return at_budget(record, budgets[0]) if len(budgets) > 1 else record


def recorded_design(record: StudyRecord) -> RecordedDesign | None:
    params = record.parent["params"]
    if "study.design" not in params:
        return None
    spec = json.loads(params["study.design"])
    longer = json.loads(params.get("study.longer_design") or params["study.design"])
    return RecordedDesign(
        design_from_spec(spec),
        float(params.get("study.design_margin", 0.05)),
        params.get("study.design_interactions", "auto"),
        params.get("study.design_reference", ""),
        recorded_budgets(record),
        design_from_spec(longer),
        spec.get("transfer_measured") or {},
    )


def run_value(documents: pd.DataFrame, metric: str = REALIZED_ACCEPTED_LENGTH) -> Estimate:
    return ratio_estimate(*pairs(documents, metric))


def design_rows(record: StudyRecord, recorded: RecordedDesign) -> list[tuple[pd.Series, dict | None]]:
    """Every finished design run and reference-baseline run with its per-document pairs, with its design point
    (None for a reference run)."""
    rows = []
    for _, row in record.runs.iterrows():
        if row["status"] != "finished" or row["run_id"] not in record.documents:
            continue
        if row["role"] == tracking.ROLE_TRIAL and row["design_point"]:
            rows.append((row, json.loads(row["design_point"])))
        elif row["role"] == tracking.ROLE_BASELINE and recorded.reference and row["baseline"] == recorded.reference:
            rows.append((row, None))
    return rows


def design_units(record: StudyRecord, recorded: RecordedDesign) -> list[Unit]:
    """One unit per design and reference run: its realized accepted length over the validation documents."""
    units = []
    for row, point in design_rows(record, recorded):
        estimate = run_value(record.documents[row["run_id"]])
        units.append(Unit(point, estimate.value, estimate.se, row["run_name"]))
    return units


@dataclass(frozen=True)
class LaunchNoise:
    """The served speed-up's launch-to-launch spread within a run, pooled over the runs served in rounds."""

    sd: float  # nan where no run was served in two rounds or more
    dof: int
    runs: int


def launch_noise(rows: pd.DataFrame) -> LaunchNoise:
    """sqrt(sum (R_i - 1) v_i / sum (R_i - 1)) over runs with R_i >= 2 rounds and round variance v_i: every run is
    served alike, so one pooled launch variance measures each run's better than its own two rounds do."""
    rounds = rows.get(served_names.ROUNDS_COLUMN, pd.Series(dtype=float))
    variance = rows.get(served_names.LAUNCH_VARIANCE_COLUMN, pd.Series(dtype=float))
    usable = (rounds >= 2) & variance.notna()
    dof = int((rounds[usable] - 1).sum())
    if not dof:
        return LaunchNoise(float("nan"), 0, 0)
    return LaunchNoise(float(np.sqrt(((rounds[usable] - 1) * variance[usable]).sum() / dof)), dof, int(usable.sum()))


def served_units(record: StudyRecord, recorded: RecordedDesign, response: str) -> tuple[list[Unit], LaunchNoise]:
    """One unit per served design run: its served response. A speed-up's standard error is the pooled launch noise
    over its rounds (sd / sqrt(R_i)), so the residual's spread beyond it is the seeds' (training) noise; an accepted
    length's, its own over requests (T = 0 draws the same cycles in every launch)."""
    rows = [(row, point) for row, point in design_rows(record, recorded) if np.isfinite(row.get(response, np.nan))]
    noise = launch_noise(pd.DataFrame([row for row, _ in rows])) if rows else LaunchNoise(float("nan"), 0, 0)
    units = []
    for row, point in rows:
        se = row.get(f"{response}_se", np.nan)
        if response == served_names.OBJECTIVE_SPEEDUP and np.isfinite(noise.sd):
            se = noise.sd / np.sqrt(row[served_names.ROUNDS_COLUMN])
        units.append(Unit(point, float(row[response]), float(se), row["run_name"]))
    return units, noise


def fit_recorded(recorded: RecordedDesign, units: list[Unit]) -> tuple[Fit, bool]:
    """The fit, with the resolved two-factor interactions when asked for (or, on `auto`, when enough residual
    degrees of freedom remain); returns whether they were fitted."""
    wanted = recorded.interactions in (True, "True", "true")
    if recorded.interactions == "auto":
        fitted = fit_design(recorded.design, units, recorded.margin, interactions=True)
        wanted = bool(recorded.design.terms(True)[len(recorded.design.factors) :]) and (
            fitted.residual_dof >= MIN_RESIDUAL_DOF
        )
    return fit_design(recorded.design, units, recorded.margin, interactions=wanted), wanted


def study_configurations(record: StudyRecord) -> list[Configuration]:
    """Finished trials and baselines, best realized first."""
    found = configurations(record.runs, record.documents)
    return sorted(found, key=lambda c: (-estimate(c, REALIZED_ACCEPTED_LENGTH).value, c.key))


@dataclass(frozen=True)
class BudgetFit:
    """A design fitted on its runs at one step budget."""

    steps: int | None  # None: every run of a study with one budget
    units: list[Unit]
    fit: Fit
    with_interactions: bool
    wall_s: float  # the run wall time of its units


@dataclass(frozen=True)
class Carried:
    """How one effect carried from the first budget to a longer one."""

    term: str
    short: Effect
    long: Effect
    label: str  # held, shrank, grew, reversed, appeared, vanished, inconclusive (harness.design.TRANSFER_MEANINGS)
    change: Estimate  # longer − shorter (Welch)


@dataclass(frozen=True)
class ServedFit:
    """A design fitted on a served response of its runs at the first budget, beside the offline fit."""

    response: str  # a served objective (served_speedup, served_accepted_length)
    fit: BudgetFit
    launches: LaunchNoise


@dataclass(frozen=True)
class DesignAnalysis:
    """A designed study's fits: at its first budget, and at each longer one on the design those ran; and how each
    effect carried to each longer budget (empty where either fit has no effects yet); and, for a study whose
    objective is served, the first budget's fit on that response."""

    recorded: RecordedDesign
    first: BudgetFit
    longer: list[BudgetFit]
    carried: dict[int, list[Carried]]  # longer budget's steps -> each term's transfer
    served: ServedFit | None = None

    def transfer_labels(self) -> dict[str, str]:
        """`steps/term` -> label: the parent run's tags."""
        return {f"{steps}/{c.term}": c.label for steps, found in self.carried.items() for c in found}


@dataclass(frozen=True)
class ParetoFront:
    """A two-objective study's trials that no other trial beats on both objectives (means over seeds)."""

    objectives: list[str]
    directions: list[str]
    considered: list[Configuration]  # completed trials with both values
    front: list[tuple[Configuration, list[float]]]  # best on the second objective first


@dataclass(frozen=True)
class ServedStanding:
    """The runs served with their break-even measured, where the best of them stands, and how many pay."""

    runs: pd.DataFrame
    best: pd.Series | None  # the highest served accepted length
    paying: int  # served accepted length at or above its break-even


@dataclass(frozen=True)
class StudyAnalysis:
    """The study as every report section reads it: the whole record (the budget transfer, problems, deleted runs),
    its first budget's runs and configurations (every other section), and its design's fits."""

    whole: StudyRecord
    record: StudyRecord
    configs: list[Configuration]
    design: DesignAnalysis | None
    pareto: ParetoFront | None
    served: ServedStanding


def budget_fit(record: StudyRecord, recorded: RecordedDesign, steps: int | None) -> BudgetFit:
    at = record if steps is None else at_budget(record, steps)
    return fitted(at, recorded, steps, design_units(at, recorded))


def fitted(at: StudyRecord, recorded: RecordedDesign, steps: int | None, units: list[Unit]) -> BudgetFit:
    fit, with_interactions = fit_recorded(recorded, units)
    wall = at.runs.loc[at.runs["run_name"].isin([u.name for u in units]), "wall_s"] if units else []
    return BudgetFit(steps, units, fit, with_interactions, float(np.nansum(wall)))


def analyse_design(record: StudyRecord) -> DesignAnalysis | None:
    recorded = recorded_design(record)
    if recorded is None:
        return None
    first, *longer = recorded.budgets or [None]
    longer_design = dataclasses.replace(recorded, design=recorded.longer)
    short = budget_fit(record, recorded, first if longer else None)
    fits = [budget_fit(record, longer_design, steps) for steps in longer]
    found = DesignAnalysis(recorded, short, fits, {fit.steps: carried(short.fit, fit.fit) for fit in fits})
    objectives = record.parent["params"].get("study.objectives", "").split(",")
    responses = [o for o in objectives if o in served_names.RESPONSES]
    if not responses:
        return found
    at = at_budget(record, first) if longer else record
    units, launches = served_units(at, recorded, responses[0])
    served = ServedFit(responses[0], fitted(at, recorded, short.steps, units), launches)
    return dataclasses.replace(found, served=served)


def carried(short: Fit, long: Fit) -> list[Carried]:
    """Each effect of the first budget's fit beside the same term at a longer budget, labelled."""
    at_long = {e.term: e for e in long.effects}
    found = []
    for effect in short.effects:
        if effect.term in at_long:
            label, change = transfer_label(effect, at_long[effect.term])
            found.append(Carried(effect.term, effect, at_long[effect.term], label, change))
    return found


def pareto(record: StudyRecord, configs: list[Configuration]) -> ParetoFront | None:
    """The front of a two-objective study over its completed trials; None for a one-objective study."""
    objectives = record.parent["params"].get("study.objectives", "").split(",")
    if len(objectives) != 2 or any(o not in tracking.OBJECTIVES for o in objectives):
        return None
    directions = [tracking.OBJECTIVES[o] for o in objectives]
    trials = [
        (c, [float(c.runs[o].mean()) for o in objectives])
        for c in configs
        if c.first["role"] == tracking.ROLE_TRIAL and all(c.runs[o].notna().any() for o in objectives)
    ]
    front = pareto_front([(trial, trial[1]) for trial in trials], directions)  # keys: (config, values)
    sign = 1.0 if directions[1] == "maximize" else -1.0
    front.sort(key=lambda trial: -sign * trial[1][1])  # best on the second objective first
    return ParetoFront(objectives, directions, [c for c, _ in trials], front)


def served_standing(record: StudyRecord) -> ServedStanding:
    runs = record.runs
    column = served_names.BREAK_EVEN_COLUMN
    served = runs[runs[column].notna()] if column in runs else runs.iloc[0:0]
    if served.empty:
        return ServedStanding(served, None, 0)
    best = served.loc[served[served_names.GREEDY_COLUMN].idxmax()]
    return ServedStanding(served, best, int((served[served_names.GREEDY_COLUMN] >= served[column]).sum()))


def analyse(record: StudyRecord) -> StudyAnalysis:
    first = first_budget(record)
    configs = study_configurations(first)
    return StudyAnalysis(record, first, configs, analyse_design(record), pareto(first, configs), served_standing(first))
