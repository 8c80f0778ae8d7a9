"""The report's PNG figures: knob effects, per-position acceptance, accepted lengths and learning curves."""

from __future__ import annotations

import json
import math

import numpy as np

from algorithms.metrics import (
    ACCEPTED_LENGTHS,
)
from harness import tracking
from reports.collect import StudyRecord
from reports.designed import curve_figure
from reports.estimates import (
    Configuration,
    estimate,
)
from reports.markdown import fmt_value
from reports.sections import (
    PATH_LABELS,
    best_and_reference,
    knob_columns,
    knob_levels,
    knob_value,
    level_order,
    position_rows,
)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def search_kinds(record: StudyRecord) -> dict[str, dict]:
    """The study's declared dimensions (kind, log) by knob, from the parent run."""
    try:
        return json.loads(record.parent["params"].get("study.search_space", "{}"))
    except json.JSONDecodeError:
        return {}


def knob_figure(record: StudyRecord, configs: list[Configuration]):
    """Each knob's levels with 95% error bars: categorical axes for categorical knobs, plain ticks on log axes."""
    from matplotlib.ticker import FixedLocator, NullFormatter

    plt = _pyplot()
    trials = [c for c in configs if c.first["role"] == tracking.ROLE_TRIAL]
    kinds = search_kinds(record)
    knobs = [k for k in knob_columns(configs) if knob_levels(trials, k, True)]
    if len(trials) < 2 or not knobs:
        return None
    fig, axes = plt.subplots(1, len(knobs), figsize=(3.4 * len(knobs), 3.2), squeeze=False)
    for axis, knob in zip(axes[0], knobs, strict=True):
        dimension = kinds.get(knob, {})
        levels = {c.key: knob_value(c.first[knob]) for c in trials}
        categorical = dimension.get("kind") == "categorical" or any(isinstance(v, str) for v in levels.values())
        values = sorted(set(levels.values()), key=level_order)
        for offset, (metric, marker) in zip((-0.12, 0.0, 0.12), zip(ACCEPTED_LENGTHS, "so^", strict=True), strict=True):
            xs, ys, errors = [], [], []
            for c in trials:
                value, point = levels[c.key], estimate(c, metric)
                x = values.index(value) + offset if categorical else value
                xs.append(x)
                ys.append(point.value)
                errors.append(
                    [[point.value - point.low], [point.high - point.value]] if not math.isnan(point.low) else [[0], [0]]
                )
            yerr = np.array(errors).reshape(len(errors), 2).T
            axis.errorbar(xs, ys, yerr=yerr, fmt=marker, capsize=2, alpha=0.8, label=metric.split("_")[0])
        if categorical:
            axis.set_xticks(range(len(values)), [fmt_value(v) for v in values])
        elif dimension.get("log"):
            axis.set_xscale("log")
            axis.xaxis.set_major_locator(FixedLocator(_few(values)))
            axis.xaxis.set_major_formatter(lambda x, _: fmt_value(x))
            axis.xaxis.set_minor_formatter(NullFormatter())
        axis.set_xlabel(knob)
    axes[0][0].set_ylabel("accepted length (95% interval)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def _few(values: list[float], most: int = 4) -> list[float]:
    """At most `most` tick positions from the observed values, spread over their range."""
    if len(values) <= most:
        return values
    return [values[round(i * (len(values) - 1) / (most - 1))] for i in range(most)]


def position_figure(configs: list[Configuration]):
    plt = _pyplot()
    chosen = best_and_reference(configs)
    if not chosen:
        return None
    fig, axis = plt.subplots(figsize=(6.5, 3.8))
    for (title, config), style in zip(chosen, ("-", "--"), strict=False):
        positions = position_rows(config)
        for path in ("unary", "oracle", "realized"):
            shown = [r for r in positions if r[f"{path}_n"]]
            xs, ys = [r["slot"] for r in shown], [r[f"{path}_conditional_acc"] for r in shown]
            low = [y - r[f"{path}_low"] for y, r in zip(ys, shown, strict=True)]
            high = [r[f"{path}_high"] - y for y, r in zip(ys, shown, strict=True)]
            axis.errorbar(
                xs, ys, yerr=[low, high], fmt=style, marker="o", capsize=2, label=f"{title}: {PATH_LABELS[path]}"
            )
    axis.set_xlabel("draft position")
    axis.set_ylabel("conditional acceptance (95% Wilson)")
    axis.set_ylim(0, 1.02)
    axis.legend(fontsize=7)
    fig.tight_layout()
    return fig


def accepted_lengths_figure(configs: list[Configuration]):
    """The three accepted lengths of every configuration, grouped bars with 95% error bars and labels."""
    plt = _pyplot()
    if not configs:
        return None
    fig, axis = plt.subplots(figsize=(max(5.0, 0.9 * len(configs) + 2), 3.8))
    x = np.arange(len(configs))
    for offset, metric in zip((-0.27, 0.0, 0.27), ACCEPTED_LENGTHS, strict=True):
        points = [estimate(c, metric) for c in configs]
        values = [p.value for p in points]
        errors = [
            [p.value - p.low if not math.isnan(p.low) else 0 for p in points],
            [p.high - p.value if not math.isnan(p.high) else 0 for p in points],
        ]
        axis.bar(x + offset, values, width=0.27, yerr=errors, capsize=2, label=metric.split("_")[0])
    axis.set_xticks(x, [c.label for c in configs], rotation=30, ha="right", fontsize=8)
    axis.set_ylabel("accepted length (95% interval)")
    axis.legend(fontsize=7)
    fig.tight_layout()
    return fig


FIGURES = {
    "knob_effects.png": lambda record, configs: knob_figure(record, configs),
    "per_position.png": lambda record, configs: position_figure(configs),
    "accepted_lengths.png": lambda record, configs: accepted_lengths_figure(configs),
    "learning_curves.png": lambda record, configs: curve_figure(record),
}
