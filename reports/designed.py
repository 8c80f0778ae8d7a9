"""Report sections of a designed study (its fitted effects, cost, budget transfer and verdicts) and every study's
learning curves, rendered from the study's analysis (reports/analysis.py), which fitted the design once."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from algorithms.metrics import REALIZED_ACCEPTED_LENGTH, se_name
from harness.design import FACTORIAL, TRANSFER_MEANINGS
from harness.serving import metrics as served_names
from harness.uncertainty import Estimate, mean_estimate, t_interval, unpaired_difference
from harness.validation import SUBSET_ROWS
from reports.analysis import RecordedDesign, ServedFit, StudyAnalysis, run_value
from reports.collect import StudyRecord
from reports.effects import ARM, BOUNDED, RESOLVED, Effect, Fit
from reports.markdown import plain_table

LAST_PART = 1 / 3  # the learning-curve gain is measured over the last third of training


def term_label(term: str, reference: str) -> str:
    if term == ARM:
        return f"design runs (mean over its points) − `{reference}`"
    return f"`{term}`"


def effects_section(
    analysis: StudyAnalysis, improving: str, carried: dict[str, str] | None = None
) -> tuple[str | None, list[str]]:
    """The designed-effects section and its verdict lines (None for a study without a design), at the first
    budget; `carried` adds to a term's verdict line how it carried to the longer budgets."""
    if analysis.design is None:
        return None, []
    recorded, first = analysis.design.recorded, analysis.design.first
    fit, with_interactions = first.fit, first.with_interactions
    design = recorded.design
    params = analysis.whole.parent["params"]
    reference_seeds = (
        f"; the reference arm `{recorded.reference}` at seeds {params['study.reference_seeds']}"
        if recorded.reference and params.get("study.reference_seeds")
        else ""
    )
    parts = [
        "## Designed effects",
        f"**Design:** {design.describe()}, seeds {params.get('study.seeds')}{reference_seeds}.",
    ]
    parts.append("Alias structure:\n\n" + "\n".join(f"- {line}" for line in design.alias_lines()))
    cost = (
        f"**Cost:** {len(first.units)} runs ({first.wall_s / 60:.1f} min of run wall time), {fit.residual_dof} "
        "residual degrees of freedom."
    )
    parts.append(cost)
    if not fit.effects:
        parts.append(f"No effect can be estimated yet: {fit.note or 'no finished design run'}.")
        return "\n\n".join(parts), [f"- Designed effects: none estimable ({fit.note or 'no finished run'})."]
    parts.append(
        "Each run is one unit: its realized accepted length on every validation anchor, weighted by "
        "1 / (τ² + its clustered within-run variance), with τ² the variance between runs beyond measurement "
        f"(training noise and unfitted terms; estimated τ = {math.sqrt(fit.tau2):.3f}). The effects' 95% intervals "
        f"are t intervals on the {fit.residual_dof} residual degrees of freedom, so training noise is inside them"
        f"{'; design − reference is a Welch difference of the two arms (below)' if fit.reference_noise else ''}. "
        f"*Resolved*: the interval excludes 0. *Bounded*: it lies inside ±{recorded.margin:g} accepted tokens "
        "(the study's margin), so the knob does not matter at this budget. *Detectable* is the smallest "
        "|effect| this design resolves with 80% power."
        + (
            ""
            if with_interactions or len(design.terms(True)) == len(design.factors)
            else " Two-factor interactions are not fitted (too few residual degrees of freedom): they are pooled "
            "into the residual, which widens the intervals if they exist."
        )
    )
    rows = [
        [term_label(e.term, recorded.reference), e.estimate.text(signed=True), e.label, f"{e.detectable:.3f}"]
        for e in fit.effects
    ]
    # A factorial's effect is its high level minus its low; a one-at-a-time move's, the move minus the centre
    # (a member design's `algorithm=M`: M − the base member).
    difference = "high − low" if design.kind == FACTORIAL else "move − centre"
    parts.append(plain_table([f"effect ({difference})", "estimate [95% interval]", "label", "detectable"], rows))
    if fit.reference_noise is not None:
        parts.append(noise_by_arm(fit, recorded.reference))
    measured = recorded.transfer_measured
    if not carried and measured:
        parts.append(measured_transfer_text(measured, recorded.reference))
        carried = {
            term: f"; at {measured['steps']} steps {found} (measured separately: {measured['source']})"
            for term, found in measured["labels"].items()
        }
    carried = carried or {}
    lines = [
        f"- {term_label(e.term, recorded.reference)}: {e.text()} ({dof_text(e, fit)}){improving}"
        f"{carried.get(e.term, '')}."
        for e in fit.effects
    ]
    if analysis.design.served is not None:
        served_part, served_lines = served_effects(analysis.design.served, fit, recorded.reference)
        parts.append(served_part)
        lines += served_lines
    return "\n\n".join(parts), lines


def served_effects(served: ServedFit, offline: Fit, reference: str) -> tuple[str, list[str]]:
    """The design's effects on its served response beside its effects on offline realized acceptance, with the
    noise each served effect carries, and where the two disagree."""
    fit, launches = served.fit.fit, served.launches
    title = f"### Effects on `{served.response}` (served by llama.cpp)"
    if not fit.effects:
        return f"{title}\n\nNo effect can be estimated yet: {fit.note or 'no served run'}.", [
            f"- Served effects: none estimable ({fit.note or 'no served run'})."
        ]
    if served.response == served_names.OBJECTIVE_SPEEDUP and math.isfinite(launches.sd):
        noise = (
            f"Every run was served in rounds, each a fresh server launch with the draft and one without; a run's "
            f"value is its mean round speed-up, and its standard error the launch-to-launch sd pooled over "
            f"{launches.runs} runs ({launches.dof} df), {launches.sd:.3f}, over the square root of its rounds. The "
            f"spread between runs beyond that, τ = {math.sqrt(fit.tau2):.3f}, is the seeds' (training) noise: both "
            f"are inside the intervals ({fit.residual_dof} residual df)."
        )
    else:
        own = (
            "Every run was served in one round, a fresh server launch with the draft and one without"
            if served.response == served_names.OBJECTIVE_SPEEDUP
            else "A run's standard error is its own over requests"
        )
        noise = (
            f"{own}; launch-to-launch noise is not measured within runs and sits, with the seeds' noise "
            f"(τ = {math.sqrt(fit.tau2):.3f}), in the residual ({fit.residual_dof} df)."
        )
    offline_by_term = {e.term: e for e in offline.effects}
    rows = [
        [
            term_label(e.term, reference),
            effect_cell(offline_by_term[e.term]) if e.term in offline_by_term else "–",
            effect_cell(e),
            f"{e.detectable:.3f}",
            agreement(offline_by_term.get(e.term), e),
        ]
        for e in fit.effects
    ]
    headers = ["effect", "offline realized accepted length", f"`{served.response}`", "detectable", "reading"]
    table = plain_table(headers, rows)
    lines = [
        f"- {term_label(e.term, reference)} on `{served.response}`: {e.text()} ({dof_text(e, fit)}, launch and seed "
        f"noise inside); {agreement(offline_by_term.get(e.term), e)}."
        for e in fit.effects
    ]
    return f"{title}\n\n{noise}\n\n{table}", lines


def effect_cell(effect: Effect) -> str:
    """An effect's estimate, interval and label in a table cell (no `|`)."""
    bound = f" (< {effect.bound:.3f})" if effect.label == BOUNDED and effect.bound > 0 else ""
    return f"{effect.estimate.text(signed=True)}: {effect.label}{bound}"


def agreement(offline: Effect | None, served: Effect) -> str:
    """How an effect on served speed reads against the same effect on offline acceptance."""
    if offline is None:
        return "no offline effect to compare"
    if offline.label == RESOLVED and served.label == RESOLVED:
        same = (offline.estimate.value > 0) == (served.estimate.value > 0)
        return "the same direction served" if same else "opposite directions: the cycle's cost reverses it"
    if offline.label == RESOLVED:
        return "an effect on acceptance that the served speed does not show (the cycle's cost may eat it)"
    if served.label == RESOLVED:
        return "an effect on served speed without one on acceptance: the cycle's cost"
    return "neither resolves"


def measured_transfer_text(measured: dict, reference: str) -> str:
    """The transfer this one-budget design cites: measured by another study, at another time, maybe elsewhere."""
    lines = [f"- {term_label(term, reference)}: *{found}*" for term, found in measured["labels"].items()]
    return (
        f"**At {measured['steps']} steps.** This study runs one budget. The same design at {measured['steps']} steps "
        f"was measured by another study, published in `{measured['source']}` (its machine and date are there; "
        "it is cited by the study file, not recomputed from this store; what each label means: docs/uncertainty.md, "
        "Budget transfer):\n\n" + "\n".join(lines)
    )


def dof_text(effect: Effect, fit: Fit) -> str:
    """The degrees of freedom an effect's interval rests on: the design's residual, or the arm difference's."""
    if effect.term == ARM:
        runs = fit.reference_noise.runs if fit.reference_noise else 0
        return f"Welch, {runs} reference run{'s' * (runs != 1)}"
    return f"{fit.residual_dof} residual df"


def noise_by_arm(fit: Fit, reference: str) -> str:
    """Each arm's spread between runs beside its within-run standard error, and what the arm difference uses."""
    rows = []
    for name, noise, how in (
        ("design runs", fit.design_noise, "residual around the fitted effects: training noise and unfitted terms"),
        (f"`{reference}` (reference)", fit.reference_noise, "between its seeds"),
    ):
        between = "–" if math.isnan(noise.between) else f"{noise.between:.3f}"
        spread = "– (one run)" if math.isnan(noise.spread) else f"{noise.spread:.3f} ({how})"
        rows.append([name, noise.runs, spread, f"{noise.within_se:.3f}", between])
    return (
        "**Training noise by arm.** Each arm's runs spread by training noise (seed, data order) on top of "
        "measurement noise (which validation anchors there are, the within-run SE). The reference arm trains another "
        "algorithm and keeps its own spread: design − reference is the difference of the two arms' means, each "
        "with its own variance (Welch), so the reference's seed noise is inside that interval.\n\n"
        + plain_table(["arm", "runs", "spread between runs (sd)", "within-run SE (rms)", "beyond measurement"], rows)
    )


def curve_estimate(row: pd.Series, metric: str = REALIZED_ACCEPTED_LENGTH) -> Estimate:
    se = row.get(se_name(metric), float("nan"))
    return t_interval(float(row[metric]), float(se), int(row.get(SUBSET_ROWS, 0) or 0))


def last_part_gain(curve: pd.DataFrame, metric: str = REALIZED_ACCEPTED_LENGTH) -> tuple[Estimate, int, int] | None:
    """The subset's gain from the validation nearest before the last third to the last one. Both are on the
    same anchors, but the difference is taken unpaired (the per-row pairs are not kept), so its interval is
    conservative."""
    steps = curve["step"].tolist()
    if len(steps) < 2 or metric not in curve:
        return None
    last = steps[-1]
    earlier = [s for s in steps[:-1] if s <= last * (1 - LAST_PART)] or steps[:1]
    start = earlier[-1]
    at = curve.set_index("step")
    return unpaired_difference(curve_estimate(at.loc[last], metric), curve_estimate(at.loc[start], metric)), start, last


@dataclass(frozen=True)
class LateGains:
    """Each run's gain over the last third of its training on the validation subset (`last_part_gain`), by run id
    in the record's order, and their mean over runs, which carries training noise."""

    runs: dict[str, tuple[Estimate, int, int]]  # run id -> (gain, its first step, its last step)
    mean: Estimate

    @property
    def improving(self) -> bool:
        """Whether the runs were still improving: the mean gain's interval lies above 0."""
        return not math.isnan(self.mean.low) and self.mean.low > 0

    @property
    def budget(self) -> str:
        """The last steps of the runs, as a verdict names its budget: `600` or `60, 240`."""
        return ", ".join(map(str, sorted({last for _, _, last in self.runs.values()})))


def late_gains(record: StudyRecord) -> LateGains | None:
    """Every run's late gain where it recorded a learning curve; None where none did."""
    runs = {}
    for run_id in record.runs.get("run_id", []):  # a study with no run yet has no columns
        curve = record.curves.get(run_id)
        found = last_part_gain(curve) if curve is not None else None
        if found is not None:
            runs[run_id] = found
    return LateGains(runs, mean_estimate([gain.value for gain, _, _ in runs.values()])) if runs else None


def curves_section(record: StudyRecord, figure: str | None) -> tuple[str, str]:
    """Learning curves and each run's late gain; returns the section and the suffix every verdict carries."""
    parts = ["## Learning curves"]
    late = late_gains(record)
    if late is None:
        parts.append("No run recorded a learning curve (curve/* metrics).")
        return "\n\n".join(parts), ""
    names = dict(zip(record.runs["run_id"], record.runs["run_name"], strict=True))
    rows = [[names[run], f"{start} → {last}", gain.text(signed=True)] for run, (gain, start, last) in late.runs.items()]
    budget = late.budget
    parts.append(
        "Realized accepted length on the fixed subset of validation anchors at every validation (the solid "
        "lines); the final value on every anchor, which the tables above use, is the separate marker at the last "
        "step. *Gain* is each run's change over the last third of training on the subset, with a conservative "
        "(unpaired) 95% interval; the mean gain over runs carries training noise."
    )
    if figure:
        parts.append(f"![learning curves]({figure})")
    parts.append(
        f"**Mean gain over the last third, over {len(late.runs)} runs:** {late.mean.text(signed=True)}. "
        + (
            f"The runs were still improving at {budget} steps: every verdict in this report is a statement "
            f"about drafts trained {budget} steps, not about converged ones."
            if late.improving
            else f"No improvement over the last third is resolved at {budget} steps. That is not convergence: "
            "under a learning rate that decays to zero the last third trains at under a third of its peak, so a flat "
            "last third is what the schedule produces whether or not a longer budget would help."
        )
    )
    parts.append(plain_table(["run", "steps", "gain [95% interval]"], rows))
    suffix = f", at {budget} steps, still improving" if late.improving else f", at {budget} steps"
    return "\n\n".join(parts), suffix


def curve_figure(record: StudyRecord):
    """Every run's subset learning curve, with its final every-anchor value as a separate marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not record.curves:
        return None
    fig, axis = plt.subplots(figsize=(7.0, 4.0))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (_, run) in enumerate(record.runs[record.runs["run_id"].isin(record.curves)].iterrows()):
        curve, color = record.curves[run["run_id"]], colors[index % len(colors)]
        axis.plot(curve["step"], curve[REALIZED_ACCEPTED_LENGTH], "-o", color=color, markersize=3, lw=1)
        if run["run_id"] in record.documents:
            final = run_value(record.documents[run["run_id"]])
            axis.plot([curve["step"].iloc[-1]], [final.value], "x", color=color, markersize=7)
    axis.plot([], [], "-o", color="gray", markersize=3, label="fixed subset of anchors")
    axis.plot([], [], "x", color="gray", label="final: every anchor")
    axis.set_xlabel("step")
    axis.set_ylabel("realized accepted length")
    axis.legend(fontsize=7)
    fig.tight_layout()
    return fig


def design_metrics(analysis: StudyAnalysis) -> dict[str, float]:
    """What a design cost and resolved, for the parent run: runs, wall time, residual degrees of freedom."""
    if analysis.design is None:
        return {}
    first = analysis.design.first
    return {
        "design/runs": float(len(first.units)),
        "design/run_wall_s": first.wall_s,
        "design/residual_dof": float(first.fit.residual_dof),
        "design/resolved_effects": float(sum(e.label == "resolved" for e in first.fit.effects)),
    }


def transfer_section(analysis: StudyAnalysis) -> tuple[str | None, dict[str, str]]:
    """How each effect carried from the first budget to each longer one (labelled in the analysis). Returns the
    section (None with one budget) and each term's verdict-line suffix."""
    if analysis.design is None or not analysis.design.longer:
        return None, {}
    recorded, short_fit = analysis.design.recorded, analysis.design.first.fit
    first, *longer = recorded.budgets
    parts = [
        "## Budget transfer",
        "The same question asked again at a longer budget: every run trained from the start for "
        f"{', '.join(map(str, longer))} steps, with the learning rate's schedule stretched to its length, and "
        f"fitted as at {first} steps. The change is longer − shorter, the two fits' runs independent (Welch). "
        "What each label means:\n\n"
        + "\n".join(f"- *{name}*: {meaning}." for name, meaning in TRANSFER_MEANINGS.items()),
    ]
    suffixes: dict[str, str] = {}
    for at_longer in analysis.design.longer:
        steps, long_fit = at_longer.steps, at_longer.fit
        parts.append(f"### {first} → {steps} steps")
        parts.append(longer_design_text(recorded, steps))
        if not short_fit.effects or not long_fit.effects:
            parts.append(f"No transfer can be labelled yet: {long_fit.note or short_fit.note or 'no finished run'}.")
            continue
        rows = []
        for found in analysis.design.carried[steps]:
            cells = [f"{e.estimate.text(signed=True)} {e.label}" for e in (found.short, found.long)]  # no `|` inside
            rows.append(
                [
                    term_label(found.term, recorded.reference),
                    *cells,
                    found.change.text(signed=True),
                    f"**{found.label}**",
                ]
            )
            suffixes[found.term] = (
                suffixes.get(found.term, "") + f"; at {steps} steps {found.long.text()}: {found.label}"
            )
        parts.append(plain_table(["effect", f"at {first} steps", f"at {steps} steps", "change", "transfer"], rows))
        parts.append(budget_gains(short_fit, long_fit, first, steps, recorded))
    return "\n\n".join(parts), suffixes


def longer_design_text(recorded: RecordedDesign, steps: int) -> str:
    """Which points the longer budget ran, and why they are enough."""
    if recorded.longer.describe() == recorded.design.describe():
        return f"**Design at {steps} steps:** the same {recorded.design.describe()}."
    return (
        f"**Design at {steps} steps:** {recorded.longer.describe()}, the fraction that keeps every main effect "
        "estimable at half the runs or fewer. Its main effects are aliased with two-factor interactions, so each is "
        "read as the main effect plus the interactions named below: enough to see whether a main effect held, "
        "reversed or vanished, not to separate it from an interaction that appears only at the longer budget.\n\n"
        + "\n".join(f"- {line}" for line in recorded.longer.alias_lines())
    )


def budget_gains(short: Fit, long: Fit, first: int, steps: int, recorded: RecordedDesign) -> str:
    """The measured convergence label: what the longer budget gained over the first, per arm."""
    lines = [f"**Did {steps} steps help over {first}?** The measured answer, per arm (realized accepted length):"]
    arms = [("design runs (mean over its points)", short.design_mean, long.design_mean)]
    if recorded.reference:
        arms.append(
            (f"`{recorded.reference}` (reference, mean over its seeds)", short.reference_mean, long.reference_mean)
        )
    for name, before, after in arms:
        if before is None or after is None:
            continue
        gain = unpaired_difference(after, before)
        label = gain_label(gain, first, recorded.margin)
        lines.append(f"- {name}: {before.text()} → {after.text()}, {gain.text(signed=True)}: {label}.")
    return "\n".join(lines)


def gain_label(gain: Estimate, first: int, margin: float) -> str:
    """Whether the first budget had converged, as a longer budget measured it."""
    if math.isnan(gain.low):
        return "not measured (no interval)"
    if gain.excludes_zero:
        return f"not converged at {first} steps: the longer budget {'gains' if gain.value > 0 else 'loses'}"
    if max(abs(gain.low), abs(gain.high)) < margin:
        return f"converged at {first} steps within ±{margin:g}: the longer budget changes nothing beyond the margin"
    return "not distinguishable: these runs cannot tell whether the longer budget helps"
