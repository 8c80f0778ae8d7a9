"""Configurations (one trial or baseline across its seeds) and the intervals a report states about them.

Two sources of noise enter every number: which validation anchors there are (the within-run standard error,
clustered by document) and how training happened to go (the spread between seeds). A configuration's
interval combines both when it has several seeds; with one seed it can only carry the first, and says so.
Comparisons pair by document, and by seed where both sides ran the same seeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

from harness import tracking
from harness.uncertainty import CONFIDENCE, NO_ESTIMATE, Estimate, paired_difference, ratio_estimate
from harness.validation import ANCHORS_COLUMN, DOCUMENT_COLUMN, SUM_SUFFIX, TOTAL_SUFFIX, pairs


@dataclass
class Configuration:
    """One trial or baseline: its finished runs (one per seed) and their per-document validation pairs."""

    key: str
    label: str
    runs: pd.DataFrame
    documents: dict[str, pd.DataFrame]  # seed -> per-document frame

    @property
    def seeds(self) -> list[str]:
        return sorted(self.documents)

    @property
    def first(self) -> pd.Series:
        return self.runs.sort_values("seed").iloc[0]

    def has(self, metric: str) -> bool:
        return any(metric + SUM_SUFFIX in frame for frame in self.documents.values())

    def pooled(self, metric: str, seeds: list[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Per-document (sum, total) added over `seeds` (all by default), aligned by document."""
        seeds = seeds if seeds is not None else self.seeds
        frames = [
            self.documents[s].set_index(DOCUMENT_COLUMN) for s in seeds if metric + SUM_SUFFIX in self.documents[s]
        ]
        if not frames:
            return np.zeros(0), np.zeros(0)
        sums = sum(f[metric + SUM_SUFFIX] for f in frames).sort_index()
        totals = sum(f[metric + TOTAL_SUFFIX] for f in frames).sort_index()
        return sums.to_numpy(float), totals.to_numpy(float)

    def per_seed(self, metric: str) -> list[float]:
        values = []
        for seed in self.seeds:
            sums, totals = pairs(self.documents[seed], metric) if self.has(metric) else ([], [])
            total = float(np.sum(totals))
            if total > 0:
                values.append(float(np.sum(sums)) / total)
        return values

    def anchors(self) -> pd.Series:
        return self.documents[self.seeds[0]].set_index(DOCUMENT_COLUMN)[ANCHORS_COLUMN].sort_index()


def configurations(runs: pd.DataFrame, documents: dict[str, pd.DataFrame]) -> list[Configuration]:
    """Finished runs with their per-document pairs, grouped by trial or baseline."""
    if runs.empty:
        return []
    done = runs[(runs["status"] == "finished") & runs["run_id"].isin(documents)]
    found = []
    for key, group in done.groupby("config", sort=False):
        row = group.iloc[0]
        label = f"baseline {row['baseline']}" if row["role"] == tracking.ROLE_BASELINE else f"trial {row['trial']}"
        found.append(
            Configuration(key, label, group, {str(r["seed"]): documents[r["run_id"]] for _, r in group.iterrows()})
        )
    return found


def _welch(value: float, parts: list[tuple[float, int]], confidence: float = CONFIDENCE) -> Estimate:
    """value ± t * sqrt(sum of variances), degrees of freedom by Welch-Satterthwaite; parts: (variance, dof)."""
    parts = [(v, d) for v, d in parts if math.isfinite(v) and d >= 1]
    variance = sum(v for v, _ in parts)
    if not parts:
        return Estimate(value, float("nan"), float("nan"), float("nan"), 0)
    if variance <= 0:  # every unit agreed exactly (e.g. nothing accepted anywhere): a zero-width interval
        return Estimate(value, 0.0, value, value, 0)
    dof = variance**2 / sum(v * v / d for v, d in parts)
    half = float(stats.t.ppf(0.5 + confidence / 2, dof)) * math.sqrt(variance)
    return Estimate(value, math.sqrt(variance), value - half, value + half, int(round(dof)))


def seed_variance(values: list[float]) -> tuple[float, int]:
    """Variance of a mean over seeds, and its degrees of freedom (nan below two seeds)."""
    if len(values) < 2:
        return float("nan"), 0
    return float(np.var(values, ddof=1)) / len(values), len(values) - 1


def estimate(config: Configuration, metric: str) -> Estimate:
    """The configuration's metric over its seeds: anchor noise (clustered by document) plus seed spread."""
    if not config.has(metric):
        return NO_ESTIMATE
    within = ratio_estimate(*config.pooled(metric))
    return _welch(within.value, [(within.se**2, within.n - 1), seed_variance(config.per_seed(metric))])


def within_run(config: Configuration, metric: str) -> Estimate:
    """Anchor noise only: the clustered interval of the seed-pooled metric."""
    return ratio_estimate(*config.pooled(metric)) if config.has(metric) else NO_ESTIMATE


def difference(a: Configuration, metric_a: str, b: Configuration, metric_b: str | None = None) -> Estimate:
    """a.metric_a - b.metric_b on the same documents: paired by document, and by seed where both ran the same
    seeds; otherwise each side's mean over all its seeds, with each side's seed spread (a reference arm run at
    more seeds than a trial keeps its own spread). `a is b` gives a within-run difference (e.g. realized -
    unary)."""
    metric_b = metric_b or metric_a
    if not (a.has(metric_a) and b.has(metric_b)):
        return NO_ESTIMATE
    common = a.seeds if a is b or a.seeds == b.seeds else []
    seeds_a, seeds_b = (common, common) if common else (a.seeds, b.seeds)
    within = paired_difference(*a.pooled(metric_a, seeds_a), *b.pooled(metric_b, seeds_b))
    if common:
        by_seed = [paired_difference(*a.pooled(metric_a, [s]), *b.pooled(metric_b, [s])).value for s in common]
        spread = [seed_variance(by_seed)]
    else:
        spread = [seed_variance(a.per_seed(metric_a)), seed_variance(b.per_seed(metric_b))]
    return _welch(within.value, [(within.se**2, within.n - 1), *spread])


def same_anchors(configs: list[Configuration]) -> bool:
    """Whether every configuration was validated on identical documents and anchor positions."""
    return len({tuple(c.anchors().items()) for c in configs}) <= 1


def mean_of_estimates(values: list[float], single: Estimate) -> Estimate:
    """A level of a knob: the t interval over its trials, or the one trial's own interval."""
    if len(values) < 2:
        return single
    se = float(np.std(values, ddof=1)) / math.sqrt(len(values))
    return _welch(float(np.mean(values)), [(se * se, len(values) - 1)])
