"""A study's report: its sections and figures, assembled from one analysis of the study, and the verdict lines a
launch ends on; and two studies side by side."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from algorithms.metrics import (
    ACCEPTED_LENGTHS,
    REALIZED_ACCEPTED_LENGTH,
)
from harness import tracking
from harness.uncertainty import unpaired_difference
from reports.analysis import StudyAnalysis, analyse, study_configurations
from reports.collect import StudyRecord
from reports.designed import curves_section, effects_section, transfer_section
from reports.estimates import (
    difference,
    estimate,
    same_anchors,
)
from reports.figures import FIGURES, _pyplot, search_kinds
from reports.markdown import table, verdict
from reports.sections import (
    GENERATED_PREFIX,
    component_ablation,
    deleted_runs,
    header,
    importances,
    knob_effects,
    leaderboard,
    noise_sources,
    pareto_section,
    per_position,
    problems,
    regime,
    served_regime,
    served_section,
    verdicts,
)

FigureHook = Callable[[str, object], None]
MAX_SUMMARY_LINES = 6  # the verdict lines a launch ends on


def render(record: StudyRecord, out_dir: Path, on_figure: FigureHook | None = None) -> str:
    """The report's markdown; its figures are written beside it (and handed to `on_figure` before closing)."""
    return render_with_summary(analyse(record), out_dir, on_figure)[0]


def render_with_summary(
    analysis: StudyAnalysis, out_dir: Path, on_figure: FigureHook | None = None
) -> tuple[str, list[str]]:
    """The report's markdown and the verdict lines a launch ends on: a design's effects, else the first of the
    report's verdicts (each with its interval and label). Every section renders what `analysis` found."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    whole, record, configs = analysis.whole, analysis.record, analysis.configs
    written = set()
    for name, build in FIGURES.items():
        figure = build(record, configs)
        if figure is None:
            continue
        figure.savefig(out_dir / name, dpi=110)
        if on_figure is not None:
            on_figure(name, figure)
        plt.close(figure)
        written.add(name)
    trials = sum(1 for c in configs if c.first["role"] == tracking.ROLE_TRIAL)
    curves, budget = curves_section(record, "learning_curves.png" if "learning_curves.png" in written else None)
    transfer, carried = transfer_section(analysis)
    designed, designed_lines = effects_section(analysis, budget, carried)
    if designed is None:
        effects, resolved = knob_effects(
            configs, search_kinds(record), "knob_effects.png" if "knob_effects.png" in written else None
        )
        searched = [effects, importances(record, trials)]
    else:
        searched, resolved = [designed], None
    sections = [
        header(whole, configs),
        *filter(None, [regime(configs, record.parent["params"].get("pinned.shared.block_size", "the block size"))]),
        served_regime(analysis.served),
        leaderboard(configs),
        *(
            ["![unary, realized and oracle accepted length per run](accepted_lengths.png)"]
            if "accepted_lengths.png" in written
            else []
        ),
        *filter(None, [component_ablation(configs), noise_sources(configs), served_section(record)]),
        *filter(None, [pareto_section(analysis.pareto, configs)]),
        *searched,
        *filter(None, [transfer]),
        curves,
        per_position(configs, "per_position.png" if "per_position.png" in written else None),
        verdict_section := verdicts(configs, resolved, designed_lines, budget),
        problems(whole),
        *filter(None, [deleted_runs(whole)]),
    ]
    summary = designed_lines or [line for line in verdict_section.splitlines() if line.startswith("- ")]
    return "\n\n".join(sections) + "\n", summary[:MAX_SUMMARY_LINES]


def render_comparison(first: StudyRecord, second: StudyRecord) -> str:
    """Two studies side by side under the same rules: intervals on every number, best against best."""
    bests = []
    rows = []
    for record in (first, second):
        configs = study_configurations(record)
        best = configs[0] if configs else None
        bests.append(best)
        rows.append(
            [
                record.name,
                len(record.runs),
                len(configs),
                best.label if best else "–",
                *([estimate(best, m).text() for m in ACCEPTED_LENGTHS] if best else ["–"] * 3),
            ]
        )
    lines = [
        f"# Comparison: `{first.name}` vs `{second.name}`",
        "",
        f"- {GENERATED_PREFIX}{datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        "",
        table(["study", "runs", "finished configurations", "best run", "unary", "realized", "oracle"], rows),
    ]
    if all(bests):
        a, b = bests
        if same_anchors([a, b]):
            effect, how = difference(a, REALIZED_ACCEPTED_LENGTH, b), "paired by document: the same anchors"
        else:
            effect = unpaired_difference(estimate(a, REALIZED_ACCEPTED_LENGTH), estimate(b, REALIZED_ACCEPTED_LENGTH))
            how = "unpaired: the studies validated on different anchors"
        lines += ["", f"Best realized of `{first.name}` − best of `{second.name}` ({how}): {verdict(effect)}."]
    for record in (first, second):
        lines += ["", f"## `{record.name}`", "", leaderboard(study_configurations(record)).split("\n", 2)[2]]
    return "\n".join(lines) + "\n"
