"""The report's sections, each rendering what the study's analysis (reports/analysis.py) found: the header, the
regime, the leaderboard, the served runs, the Pareto front, knob effects, per-position acceptance and verdicts.

A difference whose 95% interval contains 0 is reported as not distinguishable from noise, never ranked.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import UTC, datetime

import numpy as np
import pandas as pd

from algorithms import ALGORITHMS
from algorithms.metrics import (
    ACCEPTED_LENGTHS,
    DRAFT_STEP_MS,
    ORACLE_ACCEPTED_LENGTH,
    REALIZED_ACCEPTED_LENGTH,
    TEACHER_FORCED_SELECTOR_ACC,
    UNARY_ACCEPTED_LENGTH,
    UNARY_CANDIDATE_RECALL,
    UNARY_CANDIDATE_TARGET_MASS,
    UNARY_FULL_ACC,
    se_name,
)
from algorithms.registry import REFERENCE_ALGORITHM
from harness import tracking
from harness.serving import metrics as served_names
from harness.serving.break_even import interval_text
from harness.tracking import RunStatus
from harness.uncertainty import Estimate, mean_estimate, unpaired_difference
from harness.validation import per_position_rows, pooled_counts
from reports.analysis import ParetoFront, ServedStanding, recorded_budgets
from reports.collect import OTHER_KNOBS, TUNED_KNOBS, StudyRecord
from reports.estimates import (
    Configuration,
    difference,
    estimate,
    mean_of_estimates,
    same_anchors,
    within_run,
)
from reports.markdown import IDENTICAL, NOISE, fmt, fmt_value, table, verdict

GENERATED_PREFIX = "Generated: "
PATH_LABELS = {"unary": "unary (Recall@1)", "oracle": "oracle (Recall@K)", "realized": "realized"}
MIN_TRIALS_PER_LEVEL = 2  # a knob's effect is judged only between levels that pool several trials
# fANOVA fits a random forest of the objective on the knobs; with fewer than about four completed trials per
# tuned knob, and under ten in all, its importances mostly reflect which trials happened to be sampled.
MIN_TRIALS_PER_KNOB, MIN_TRIALS_FOR_IMPORTANCE = 4, 10
FigureHook = Callable[[str, object], None]


def computed_in(runs: pd.DataFrame) -> str:
    """The dtypes the finished runs computed in, counted: `train.precision: auto` chooses per machine."""
    runs = runs[runs["status"] == RunStatus.FINISHED] if not runs.empty else runs
    if runs.empty:
        return "no finished run"
    recorded = runs["computes_in"] if "computes_in" in runs else pd.Series("", index=runs.index)
    dtypes = recorded.replace("", "not recorded")  # runs from before the tag existed
    counts = ", ".join(f"{dtype} ({n} run{'s' * (n != 1)})" for dtype, n in sorted(dtypes.value_counts().items()))
    mixed = "; MIXED: these comparisons include runs that computed in different dtypes" if dtypes.nunique() > 1 else ""
    return (
        f"{counts}{mixed}. `auto` computes in bf16 on an accelerator or a CPU with native bf16 and in fp32 elsewhere, "
        "so a seeded run repeats its numbers only where it computes alike"
    )


def knobs_that_differ(knobs, configs: list[Configuration]) -> list[str]:
    """Those of `knobs` whose value is not the same in every configuration."""
    return [k for k in knobs if len({str(c.first.get(k, "")) for c in configs}) > 1]


def differing_knobs(configs: list[Configuration]) -> list[str]:
    """The shared and training knobs that differ between the study's configurations (a sweep over block size,
    depth or learning rate): each gets a column, and the comparison is like for like in every other knob."""
    return knobs_that_differ(OTHER_KNOBS, configs)


def knob_columns(configs: list[Configuration]) -> list[str]:
    """The knobs a table shows: those the study's members tune (each row's own, a blank where a member has none)
    and the other knobs that differ between its configurations; never a knob no member has."""
    members = [ALGORITHMS[name] for name in dict.fromkeys(c.first["algorithm"] for c in configs) if name in ALGORITHMS]
    owned = [k for k in TUNED_KNOBS if any(k in entry.tuned_knobs for entry in members)]
    return [*owned, *differing_knobs(configs)]


def header(record: StudyRecord, configs: list[Configuration]) -> str:
    params, runs = record.parent["params"], record.runs
    counts = runs.groupby("status").size().to_dict() if not runs.empty else {}
    trials = runs[runs["role"] == tracking.ROLE_TRIAL] if not runs.empty else runs
    trial_counts = trials.groupby("status").size().to_dict() if not trials.empty else {}
    first = runs.iloc[0] if not runs.empty else None
    differing = differing_knobs(configs)
    pinned = sorted(
        (k.removeprefix("pinned.shared."), v)
        for k, v in params.items()
        if k.startswith("pinned.shared.") and k.removeprefix("pinned.shared.") not in differing
    )
    target = f"{first['target']} (weights `{first['target_hash']}`)" if first is not None else "–"
    data = f"{first['dataset']} (hash `{first['dataset_hash']}`)" if first is not None else "–"
    if "dataset" in differing:
        data = f"swept (the `dataset` column below); every run validated on {first['validation_data']}"
    if configs:
        documents = configs[0].documents[configs[0].seeds[0]]
        anchors = sum(len(cell.split()) for cell in documents["anchor_positions"])
        shared = "identical for every run" if same_anchors(configs) else "NOT identical across runs"
        validation = f"{anchors} anchors from {len(documents)} documents, {shared}"
    else:
        validation = "no finished run recorded its validation anchors"
    lines = [
        f"# Ablation report: `{record.name}`",
        "",
        f"- **Target:** {target}",
        f"- **Data:** {data}",
        f"- **Objective:** {objective_text(params.get('study.objectives', ''))}; "
        f"sampler {params.get('study.sampler', '–')}, pruner {params.get('study.pruner', '–')}, "
        f"{budget_text(record)}, seeds {params.get('study.seeds', '–')}",
        f"- **Validation:** {validation}",
        f"- **Runs:** {sum(trial_counts.values())} trials "
        f"({', '.join(f'{n} {s}' for s, n in sorted(trial_counts.items())) or 'none'}); "
        f"{len(runs) - len(trials)} baseline runs; "
        f"all: {', '.join(f'{n} {s}' for s, n in sorted(counts.items())) or 'none'}",
        f"- **Computed in:** {computed_in(runs)}",
        f"- **MLflow:** experiment `{record.parent.get('experiment', record.name)}`, "
        f"parent run `{record.parent['run_id']}`",
        f"- {GENERATED_PREFIX}{datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        "",
        "**How to read the intervals.** Every value is followed by its 95% interval. Anchors of one document are "
        "correlated, so the within-run standard error is clustered by document; where a configuration ran several "
        "seeds, the spread between seeds is added. Differences are paired by document (and by seed where both "
        f"sides ran the same seeds). A difference whose interval contains 0 is marked *{NOISE}*.",
        "",
        *(
            [
                f"Knobs that differ between runs (each a column below): {', '.join(f'`{k}`' for k in differing)}; "
                "every other knob is the same for every trial and baseline.",
                "",
            ]
            if differing
            else []
        ),
        "Shared knobs pinned for every trial and baseline:",
        "",
        table(["knob", "value"], [[k, v] for k, v in pinned]),
    ]
    return "\n".join(lines)


def budget_text(record: StudyRecord) -> str:
    budgets = recorded_budgets(record)
    again = f", and the design again at {', '.join(map(str, budgets[1:]))} steps" if len(budgets) > 1 else ""
    if len(budgets) > 1 and record.parent["params"].get("study.budgets_by") == tracking.BUDGETS_AS_BRANCHES:
        shorter = ", ".join(map(str, budgets[:-1]))
        again += f" (each {shorter}-step run a warmup-stable-decay branch of its point's {budgets[-1]}-step run)"
    return f"{budgets[0] if budgets else '–'} steps per run{again}"


def reference_configs(configs: list[Configuration]) -> list[Configuration]:
    """The reference algorithm's baseline configurations (DFlash), best first as `configs` are."""
    return [
        c for c in configs if c.first["role"] == tracking.ROLE_BASELINE and c.first["baseline"] == REFERENCE_ALGORITHM
    ]


def regime(configs: list[Configuration], block_size: str) -> str | None:
    """Where training stands: the reference arm's (else the best run's) unary top-1 accuracy and accepted length
    against the floor and the ceiling, so that a verdict about learning speed is not read as one about trained
    drafters."""
    reference = reference_configs(configs)
    chosen = reference[0] if reference else (configs[0] if configs else None)
    if chosen is None:
        return None
    seeds = len(chosen.seeds)
    who = f"`{REFERENCE_ALGORITHM}` (the reference)" if reference else f"the best run ({chosen.label})"
    steps = float(chosen.first.get("max_steps", float("nan")))  # a float where a frame mixes it with NaN
    steps = f"{steps:.0f}" if math.isfinite(steps) else "–"
    return (
        f"**Regime.** {who} at {steps} steps ({seeds} seed{'s' * (seeds != 1)}): unary top-1 "
        f"accuracy {estimate(chosen, UNARY_FULL_ACC).text()}, realized accepted length "
        f"{estimate(chosen, REALIZED_ACCEPTED_LENGTH).text()}, where a drafter that is never accepted scores 1 (the "
        f"anchor alone) and one always accepted scores {block_size} (the block). The verdicts below are about drafts "
        "at this stage of training; they say which knobs learn faster here, not which make the better trained drafter."
    )


def served_regime(standing: ServedStanding) -> str:
    """Where the served drafters stand against the accepted length at which a draft of their shape pays for itself
    on the serving machine, so that no verdict is read as one about drafters that speed decoding up."""
    if standing.best is None:
        return (
            "**Against the break-even.** No run of this study was served with its break-even measured, so whether "
            "these drafters would speed decoding up was not measured here (`evaluate: {serve: llama.cpp}`; "
            "docs/scale.md)."
        )
    best, served = standing.best, standing.runs
    verdict = (
        "none of the served runs pays for itself, so the verdicts below compare drafters that slow decoding down"
        if standing.paying == 0
        else f"{standing.paying} of {len(served)} served runs pay for themselves"
    )
    return (
        f"**Against the break-even.** Served by llama.cpp, the best run (`{best['run_name']}`) accepted "
        f"{best[served_names.GREEDY_COLUMN]:.2f} tokens per cycle (speed-up {speedup_text(best)}) against a "
        f"break-even of {break_even_text(best)}; {verdict}."
    )


def pareto_section(found: ParetoFront | None, configs: list[Configuration]) -> str | None:
    """A two-objective study (e.g. accepted length or the served speed-up against the draft's step time): the
    trials no other trial beats on both, each with its values; None for a one-objective study."""
    if found is None:
        return None
    knobs = knobs_that_differ(knob_columns(configs), found.considered)  # the swept ones
    rows = [
        [c.label, *[fmt_value(c.first[k]) for k in knobs], *[f"{v:.3f}" for v in values]] for c, values in found.front
    ]
    wanted = " and ".join(
        f"{o} ({'higher' if d == 'maximize' else 'lower'} is better)"
        for o, d in zip(found.objectives, found.directions, strict=True)
    )
    note = (
        f"The trials no other trial beats on both objectives, {wanted}, best on the second first: "
        f"{len(found.front)} of {len(found.considered)} completed trials. Each value is the mean over the trial's "
        "seeds; a point's own interval is in the leaderboard."
    )
    return "## Pareto front\n\n" + note + "\n\n" + table(["trial", *knobs, *found.objectives], rows)


def leaderboard(configs: list[Configuration]) -> str:
    if not configs:
        return "## Leaderboard\n\nNo trial or baseline completed, so there is nothing to rank yet."
    best = configs[0]
    measured = any(c.runs[["measured_greedy", "measured_t1"]].notna().any().any() for c in configs)
    served = any(
        c.runs[served_names.GREEDY_COLUMN].notna().any() for c in configs if served_names.GREEDY_COLUMN in c.runs
    )
    members = len({c.first["algorithm"] for c in configs}) > 1  # a family comparison names each row's member
    knobs = knob_columns(configs)
    headers = [
        "run",
        *(["algorithm"] if members else []),
        *knobs,
        "seeds",
        "unary",
        "realized",
        "oracle",
        "realized − best",
        *(["measured T=0", "measured T=1", "accepted / verified T=0"] if measured else []),
        *(["served (llama.cpp) T=0", "served = harness cycles"] if served else []),
        "selector gain",
        "oracle headroom",
        "recall@K",
        "target mass@K",
        "TF selector acc",
        "draft step ms",
        "params",
    ]
    rows = []
    for config in configs:
        first = config.first
        versus_best = "best" if config is best else verdict(difference(config, REALIZED_ACCEPTED_LENGTH, best))
        rows.append(
            [
                config.label,
                *([first["algorithm"]] if members else []),
                *[fmt_value(first[k]) if first[k] != "" else "" for k in knobs],
                len(config.seeds),
                *[estimate(config, m).text() for m in ACCEPTED_LENGTHS],
                versus_best,
                *(
                    [
                        measured_text(config, "measured_greedy"),
                        measured_text(config, "measured_t1"),
                        fmt(float(config.runs["measured_per_verified"].mean())),
                    ]
                    if measured
                    else []
                ),
                *(
                    [
                        measured_text(config, served_names.GREEDY_COLUMN),
                        fmt(float(config.runs[served_names.AGREEMENT_COLUMN].mean())),
                    ]
                    if served
                    else []
                ),
                difference(config, REALIZED_ACCEPTED_LENGTH, config, UNARY_ACCEPTED_LENGTH).text(signed=True),
                difference(config, ORACLE_ACCEPTED_LENGTH, config, REALIZED_ACCEPTED_LENGTH).text(signed=True),
                *[
                    estimate(config, m).text()
                    for m in (UNARY_CANDIDATE_RECALL, UNARY_CANDIDATE_TARGET_MASS, TEACHER_FORCED_SELECTOR_ACC)
                ],
                fmt(float(config.runs[DRAFT_STEP_MS].mean()), 2),
                f"{int(first['parameters']):,}" if not math.isnan(first["parameters"]) else "",
            ]
        )
    note = (
        "Accepted lengths include the verified anchor. *unary*: the argmax path plain DFlash decoding realizes; "
        "*realized*: the selector walk replayed for real; *oracle*: target inside the unary top-K at every slot. "
        "*Selector gain* is realized − unary and *oracle headroom* oracle − realized, both paired within the run. "
        "Target mass@K is measured on the original unary top-K; K is each run's `candidate_top_k`. "
        "*Measured* columns, where present, are real speculative decoding with the target (per-request mean, "
        "`dflash-lab evaluate`); *accepted / verified* is committed tokens per token the target verified (a "
        "member that verifies whole blocks sets the baseline a confidence-scheduled one is compared with). "
        "*Served* is the same draft in llama.cpp on the same prompts (`evaluate --engine llama.cpp`), and *served = "
        "harness cycles* the fraction of verify cycles in which it accepted exactly what the harness's decoder "
        "accepted. "
        "The best row is selected on this same validation set, so its lead is optimistic."
    )
    return "## Leaderboard\n\n" + note + "\n\n" + table(headers, rows)


def measured_text(config: Configuration, column: str) -> str:
    values = config.runs[column].dropna()
    if values.empty:
        return "–"
    if len(values) > 1:
        return mean_estimate(values).text()
    row = config.runs.loc[values.index[0]]
    se = row.get(column + "_se", float("nan"))
    return Estimate(float(values.iloc[0]), se, *_normal(values.iloc[0], se), 0).text()


def _normal(value: float, se: float) -> tuple[float, float]:
    return (value - 1.96 * se, value + 1.96 * se) if math.isfinite(se) else (float("nan"), float("nan"))


def noise_sources(configs: list[Configuration]) -> str | None:
    """Mean over seeds, spread between seeds and within-run standard error, and which one dominates."""
    seeded = [c for c in configs if len(c.seeds) > 1]
    if not seeded:
        return (
            "## Seeds and noise\n\nEvery configuration ran one seed, so the spread between seeds is not measured: "
            "the intervals above cover the choice of validation anchors only, not the randomness of training."
        )
    rows = []
    for config in seeded:
        values = config.per_seed(REALIZED_ACCEPTED_LENGTH)
        spread = float(np.std(values, ddof=1))
        within = float(np.mean([within_run(_single(config, s), REALIZED_ACCEPTED_LENGTH).se for s in config.seeds]))
        dominant = "seeds" if spread > within else "anchors"
        rows.append(
            [config.label, len(values), " / ".join(f"{v:.3f}" for v in values), fmt(spread), fmt(within), dominant]
        )
    return "## Seeds and noise\n\n" + (
        "Realized accepted length per seed. *Seed spread* is the standard deviation between seeds (training "
        "noise); *within-run SE* the mean clustered standard error of one run (anchor noise). The larger one "
        "dominates the intervals.\n\n"
        + table(["run", "seeds", "per seed", "seed spread", "within-run SE", "dominates"], rows)
    )


def _single(config: Configuration, seed: str) -> Configuration:
    return Configuration(config.key, config.label, config.runs, {seed: config.documents[seed]})


def component_ablation(configs: list[Configuration]) -> str | None:
    """Each registered variant run as a baseline: accepted lengths, and its gain over the reference algorithm.
    None when the study ran fewer than two variants."""
    variants = {
        c.first["baseline"]: c
        for c in configs
        if c.first["role"] == tracking.ROLE_BASELINE and c.first["baseline"] in ALGORITHMS
    }
    names = [name for name in ALGORITHMS if name in variants]
    if len(names) < 2:
        return None
    rows = [
        [
            f"`{n}`",
            ALGORITHMS[n].description,
            len(variants[n].seeds),
            *[estimate(variants[n], m).text() for m in ACCEPTED_LENGTHS],
        ]
        for n in names
    ]
    parts = [
        "## Component ablation",
        "Every variant shares the study's pinned shared knobs and the base's conv and selector knobs; "
        "values are over seeds, with 95% intervals.",
        table(["variant", "components", "seeds", "unary", "realized", "oracle"], rows),
    ]
    reference = variants.get(REFERENCE_ALGORITHM)
    if reference is None:
        return "\n\n".join(parts)
    gains = []
    for name in names:
        if name == REFERENCE_ALGORITHM:
            continue
        for metric in (REALIZED_ACCEPTED_LENGTH, UNARY_ACCEPTED_LENGTH):
            effect = difference(variants[name], metric, reference)
            seeds = len(set(variants[name].seeds) & set(reference.seeds))
            word = "gain" if effect.value > 0 else "loss"
            gains.append(
                [
                    f"`{name}` − `{REFERENCE_ALGORITHM}`",
                    metric.split("_")[0],
                    seeds,
                    effect.text(signed=True),
                    word if effect.excludes_zero else IDENTICAL if effect.identical else NOISE,
                ]
            )
    parts += [
        f"Gain of each variant over `{REFERENCE_ALGORITHM}`, paired by document and seed:",
        table(["difference", "accepted length", "seeds", "effect [95% interval]", "verdict"], gains),
    ]
    return "\n\n".join(parts)


def knob_levels(trials: list[Configuration], knob: str, categorical: bool) -> list[tuple[str, list[Configuration]]]:
    """The trials at each level of a knob. A numeric knob with more than two distinct values splits at its
    median, so each half pools several trials (one trial per level would compare single runs); a knob with a
    value that is not a number (a data mixture) is categorical."""
    values = {c.key: knob_value(c.first[knob]) for c in trials if c.first[knob] != ""}
    numeric = all(isinstance(v, float) for v in values.values())
    distinct = sorted(set(values.values()), key=level_order)
    if len(distinct) < 2:
        return []
    if categorical or not numeric or len(distinct) == 2:
        return [(fmt_value(v), [c for c in trials if values.get(c.key) == v]) for v in distinct]
    median = float(np.median(list(values.values())))
    low = [c for c in trials if c.key in values and values[c.key] <= median]
    high = [c for c in trials if c.key in values and values[c.key] > median]
    return [(f"≤ {fmt_value(median)}", low), (f"> {fmt_value(median)}", high)]


def knob_value(recorded) -> float | str:
    """A knob's recorded value: a number where it is one, else its text (a data mixture)."""
    try:
        return float(recorded)
    except (TypeError, ValueError):
        return str(recorded)


def level_order(value: float | str) -> tuple:
    """Numbers in order, then texts in order."""
    return (isinstance(value, str), value)


def level_estimate(configs: list[Configuration]) -> Estimate:
    values = [estimate(c, REALIZED_ACCEPTED_LENGTH).value for c in configs]
    return mean_of_estimates(values, estimate(configs[0], REALIZED_ACCEPTED_LENGTH))


def knob_effects(configs: list[Configuration], kinds: dict[str, dict], figure: str | None) -> tuple[str, list[str]]:
    """Per knob: realized accepted length at each level with its interval; returns the section and the knobs
    whose effect is distinguishable from noise."""
    trials = [c for c in configs if c.first["role"] == tracking.ROLE_TRIAL]
    parts = ["## Knob effects"]
    if len(trials) < 2:
        parts.append(f"{len(trials)} completed trial(s): too few to estimate knob effects.")
        return "\n\n".join(parts), []
    parts.append(
        "Realized accepted length at each level: the mean over the level's trials with its t interval (the spread "
        "between trials carries the other knobs' changes and the training noise), or, for a level with one trial, "
        "that trial's own interval. *Effect* compares the best level with the worst; it is resolved only when both "
        f"levels hold at least {MIN_TRIALS_PER_LEVEL} trials and its interval excludes 0, or when the trials differ "
        "in that knob alone and the two levels' trials ran the same two or more seeds: then the effect is their "
        "difference paired by document and seed, with the spread over seeds (training noise) inside its interval."
    )
    resolved, columns = [], knob_columns(configs)
    varying = knobs_that_differ(columns, trials)
    for knob in columns:
        levels = knob_levels(trials, knob, kinds.get(knob, {}).get("kind") == "categorical")
        if not levels:
            continue
        estimates = [(name, members, level_estimate(members)) for name, members in levels]
        ranked = sorted(estimates, key=lambda e: -e[2].value)
        best, worst = ranked[0], ranked[-1]
        effect = unpaired_difference(best[2], worst[2])
        if like_for_like(varying, knob, best[1], worst[1]):
            effect = difference(best[1][0], REALIZED_ACCEPTED_LENGTH, worst[1][0])
            statement = (
                f"{verdict(effect)} (the trials differ in `{knob}` alone: paired by document and seed, over "
                f"{len(best[1][0].seeds)} seeds)"
            )
            if effect.excludes_zero:
                resolved.append(knob)
        elif min(len(best[1]), len(worst[1])) < MIN_TRIALS_PER_LEVEL:
            statement = (
                f"{effect.text(signed=True)}: not resolved, a level with one trial compares single runs that "
                "differ in every other knob and in training noise"
            )
        else:
            statement = verdict(effect)
            if effect.excludes_zero:
                resolved.append(knob)
        parts.append(
            f"**{knob}**: effect {best[0]} − {worst[0]} = {statement}\n\n"
            + table(
                [knob, "trials", "realized [95% interval]"],
                [[name, len(members), e.text()] for name, members, e in estimates],
            )
        )
    if figure:
        parts.append(f"![realized accepted length at each level of each knob]({figure})")
    return "\n\n".join(parts), resolved


def like_for_like(varying: list[str], knob: str, best: list[Configuration], worst: list[Configuration]) -> bool:
    """Whether two levels of `knob` are one trial each that differ from each other in that knob alone, both run at
    the same two or more seeds: a comparison with training noise inside it, though neither level pools trials."""
    if varying != [knob] or len(best) != 1 or len(worst) != 1:
        return False
    return best[0].seeds == worst[0].seeds and len(best[0].seeds) >= 2


def importances(record: StudyRecord, trials: int) -> str:
    values = {
        k.removeprefix(tracking.IMPORTANCE_PREFIX): v
        for k, v in record.parent["metrics"].items()
        if k.startswith(tracking.IMPORTANCE_PREFIX)
    }
    knobs = max(1, len(values) or len(TUNED_KNOBS))
    needed = max(MIN_TRIALS_FOR_IMPORTANCE, MIN_TRIALS_PER_KNOB * knobs)
    if not values:
        return "Optuna parameter importances were not computed (no completed trials with varied knobs)."
    if trials < needed:
        return (
            f"Optuna parameter importances are not shown: {trials} completed trials for {knobs} knobs, and fANOVA "
            f"needs at least {needed} (four per knob, ten in all) before its ranking reflects the knobs rather than "
            "which trials happened to be sampled."
        )
    return "Optuna parameter importances (fANOVA on the objective):\n\n" + table(
        ["knob", "importance"], [[k, fmt(v, 2)] for k, v in sorted(values.items(), key=lambda kv: -kv[1])]
    )


def best_and_reference(configs: list[Configuration]) -> list[tuple[str, Configuration]]:
    chosen = []
    trials = [c for c in configs if c.first["role"] == tracking.ROLE_TRIAL]
    if trials:
        chosen.append(("best " + trials[0].label, trials[0]))
    reference = reference_configs(configs)
    if reference:
        chosen.append((f"{REFERENCE_ALGORITHM} baseline", reference[0]))
    return chosen


def position_rows(config: Configuration) -> list[dict]:
    """The configuration's per-slot rates with their Wilson intervals, pooled over its seeds."""
    return per_position_rows(pooled_counts(pd.concat(config.documents.values(), ignore_index=True)))


def per_position(configs: list[Configuration], figure: str | None) -> str:
    chosen = best_and_reference(configs)
    parts = ["## Per-position acceptance"]
    if not chosen:
        parts.append("No completed run to show.")
        return "\n\n".join(parts)
    parts.append(
        "Conditional on every earlier slot being accepted, pooled over seeds, with a 95% Wilson interval and the "
        "number of anchors each rate rests on (*n*). Few anchors reach the late slots, so their rates are wide."
    )
    for title, config in chosen:
        positions = position_rows(config)
        rows = [["anchors", *[r["anchors"] for r in positions], ""]]
        for path in ("unary", "oracle", "realized"):
            cells = [
                f"{r[f'{path}_conditional_acc']:.2f} [{r[f'{path}_low']:.2f}, {r[f'{path}_high']:.2f}] "
                f"n={r[f'{path}_n']}"
                if r[f"{path}_n"]
                else "–"
                for r in positions
            ]
            rows.append([PATH_LABELS[path], *cells, estimate(config, f"{path}_accepted_length").text()])
        parts.append(
            f"**{title}** ({config.first['run_name']})\n\n"
            + table(["", *[f"pos {r['slot']}" for r in positions], "accepted length"], rows)
        )
    if figure:
        parts.append(f"![per-position conditional acceptance]({figure})")
    return "\n\n".join(parts)


def verdicts(configs: list[Configuration], resolved_knobs: list[str] | None, designed: list[str], budget: str) -> str:
    """Statements computed from the recorded numbers, each with its interval and the budget it is about
    (`budget`: ", at N steps[, still improving]"); `resolved_knobs` is None for a designed study, whose
    `designed` lines replace the level comparisons."""
    if not configs:
        return "## Verdicts\n\n- No completed runs: no verdict can be drawn."
    lines = []
    selector = [
        c for c in configs if c.first["algorithm"] in ALGORITHMS and ALGORITHMS[c.first["algorithm"]].has_selector
    ]
    if selector:
        best = selector[0]
        gain = difference(best, REALIZED_ACCEPTED_LENGTH, best, UNARY_ACCEPTED_LENGTH)
        headroom = difference(best, ORACLE_ACCEPTED_LENGTH, best, REALIZED_ACCEPTED_LENGTH)
        lines.append(
            f"- Selector gain (realized − unary) on the best selector run, {best.label}: {verdict(gain)}; "
            f"positive and resolved in {sum(_resolved_gain(c) for c in selector)} of {len(selector)} selector runs."
        )
        lines.append(f"- Oracle headroom (oracle − realized) on that run: {verdict(headroom)} tokens per cycle.")
    reference = reference_configs(configs)
    if reference and selector:
        ahead = difference(selector[0], REALIZED_ACCEPTED_LENGTH, reference[0])
        seeds = "paired by document and seed" if selector[0].seeds == reference[0].seeds else "paired by document"
        lines.append(
            f"- {selector[0].label} − {REFERENCE_ALGORITHM} baseline, realized accepted length ({seeds}, mean over "
            f"seeds against mean over seeds): {verdict(ahead)}."
        )
        for baseline in (c for c in selector[1:] if c.first["role"] == tracking.ROLE_BASELINE):
            effect = difference(baseline, REALIZED_ACCEPTED_LENGTH, reference[0])
            lines.append(
                f"- {baseline.label} − {REFERENCE_ALGORITHM} baseline, realized accepted length (fixed in advance, "
                f"not selected on this validation set): {verdict(effect)}."
            )
    trials = sum(1 for c in configs if c.first["role"] == tracking.ROLE_TRIAL)
    if trials >= 2 and resolved_knobs is not None:
        lines.append(
            f"- Knobs whose effect is distinguishable from noise: {', '.join(f'`{k}`' for k in resolved_knobs)}."
            if resolved_knobs
            else f"- No knob's effect is distinguishable from noise at this budget ({trials} completed trials)."
        )
    if all(len(c.seeds) < 2 for c in configs) and not designed:
        lines.append("- One seed per configuration: training noise is not in these intervals.")
    return "\n".join(["## Verdicts", *designed, *(line.rstrip(".") + f"{budget}." for line in lines)])


def headline(configs: list[Configuration]) -> str:
    """The study's one-line verdict (the parent run's description): the best run against the reference."""
    if not configs:
        return "no finished run yet"
    best = configs[0]
    line = f"best: {best.label}, realized {estimate(best, REALIZED_ACCEPTED_LENGTH).text()}"
    reference = reference_configs(configs)
    if reference and reference[0] is not best:
        line += (
            f"; − {REFERENCE_ALGORITHM} baseline: {verdict(difference(best, REALIZED_ACCEPTED_LENGTH, reference[0]))}"
        )
    return line


def leaderboard_frame(configs: list[Configuration]) -> pd.DataFrame:
    """The leaderboard as a table for MLflow (`log_table`): each accepted length with its interval."""
    rows = []
    for config in configs:
        row = {"run": config.label, "run_id": config.first["run_id"], "seeds": len(config.seeds)}
        for metric in ACCEPTED_LENGTHS:
            point, short = estimate(config, metric), metric.removesuffix("_accepted_length")
            row |= {short: point.value, f"{short}_low": point.low, f"{short}_high": point.high}
        rows.append(row)
    return pd.DataFrame(rows)


def _resolved_gain(config: Configuration) -> bool:
    gain = difference(config, REALIZED_ACCEPTED_LENGTH, config, UNARY_ACCEPTED_LENGTH)
    return gain.excludes_zero and gain.value > 0


def objective_text(objectives: str) -> str:
    """Each objective and where it is measured: the final validation, or the run served by llama.cpp."""
    if not objectives:
        return "–"
    served = set(served_names.OBJECTIVES)
    return ", ".join(
        f"{o} ({'served by llama.cpp at the end of the run' if o in served else 'on the final validation'})"
        for o in objectives.split(",")
    )


def served_section(record: StudyRecord) -> str | None:
    """Each run a serving engine checked: its served acceptance beside the harness's, and how they agreed."""
    runs = record.runs
    if runs.empty or served_names.GREEDY_COLUMN not in runs or runs[served_names.GREEDY_COLUMN].isna().all():
        return None
    rows = [
        [
            f"`{run['run_name']}`",
            fmt(run["realized_accepted_length"]),
            fmt(run["measured_greedy"]),
            fmt(run[served_names.GREEDY_COLUMN]),
            *compared_cells(run),
            speedup_text(run),
            launches_text(run),
            break_even_text(run),
        ]
        for _, run in runs[runs[served_names.GREEDY_COLUMN].notna()].iterrows()
    ]
    note = (
        "The run's draft served by llama.cpp (`evaluate --engine llama.cpp`, or the study's `evaluate.serve`) on "
        "MT-bench and held-out chat prompts at T = 0, beside the harness's offline *realized* and its own measured "
        "decoding. *Cycles agreeing*: the fraction of verify cycles, among those in which both drafted the whole "
        "block, where llama.cpp accepted exactly what the harness's decoder accepted. *Flips*: requests whose served "
        "tokens differ from the same engine without the draft / from the harness's greedy reference. *Speed-up*: "
        "served tokens/s with the draft over without, on the machine that ran it. A compared run (one launch) has its "
        "95% interval over requests (each request timed alone before and after the draft's server, the mean of the "
        "two; launch-to-launch differences are not inside it); a run served for its speed alone (a study's served "
        "objective: no cycle comparison) is the mean over *launches* rounds, each a fresh server with the draft and "
        "one without, with its interval over rounds (launch noise inside). *Break-even*: the accepted length "
        "at which a draft of this shape would start to pay for itself on that machine (llama.cpp at synthetic "
        "accepted lengths, 95% interval over prompts), and how many accepted tokens per cycle the run is short of it. "
        "docs/metrics.md defines each."
    )
    headers = [
        "run",
        "realized",
        "measured T=0",
        "served T=0",
        "cycles agreeing",
        "flips",
        "speed-up",
        "launches",
        "break-even",
    ]
    return "## Served (llama.cpp)\n\n" + note + "\n\n" + table(headers, rows) + ngram_table(runs)


def ngram_table(runs: pd.DataFrame) -> str:
    """The compared runs' speed-up beside llama.cpp's n-gram types, served on the same prompts between the same
    alone passes; empty where no run was served with them."""
    columns = list(served_names.NGRAM_COLUMNS)
    compared = runs[runs[columns].notna().any(axis=1)] if set(columns) <= set(runs) else runs.iloc[0:0]
    if compared.empty:
        return ""

    def cell(run, column: str) -> str:
        se = run.get(se_name(column), float("nan"))
        return fmt(run[column], 2) if math.isnan(se) else f"{run[column]:.2f} ± {se:.2f}"

    rows = [
        [f"`{run['run_name']}`", speedup_text(run), *(cell(run, c) for c in columns)] for _, run in compared.iterrows()
    ]
    kinds = [f"`{kind}`" for kind in served_names.NGRAM_TYPES]
    return (
        "\n\n**Beside llama.cpp's training-free speculation.** Each n-gram type served on the same prompts at T = 0, "
        "between the same two alone passes as the run's draft, its speed-up ± SE over requests (one launch each):\n\n"
        + table(["run", "draft", *kinds], rows)
    )


def compared_cells(run) -> list[str]:
    """Cycles agreeing and flips; dashes for a run served for its speed alone (nothing was compared)."""
    if math.isnan(run[served_names.CYCLES_COLUMN]):
        return ["– (speed only)", "–"]
    return [
        f"{run[served_names.AGREEMENT_COLUMN]:.3f} of {int(run[served_names.CYCLES_COLUMN])}",
        f"{int(run[served_names.FLIPS_COLUMN])} / {int(run[served_names.FLIPS_HARNESS_COLUMN])}",
    ]


def launches_text(run) -> str:
    """The rounds of fresh launches the speed-up is a mean over (1 for a compared run, or one served before rounds)."""
    rounds = run.get(served_names.ROUNDS_COLUMN, float("nan"))
    return "1" if rounds is None or math.isnan(rounds) else str(int(rounds))


def speedup_text(run) -> str:
    """`0.87 [0.76, 0.99]`: the served speed-up with its interval over requests; the value alone for a run served
    before the interval was measured."""
    se = run.get(served_names.se(served_names.OBJECTIVE_SPEEDUP), float("nan"))
    if se is None or math.isnan(se):
        return fmt(run[served_names.OBJECTIVE_SPEEDUP], 2)
    return Estimate(
        run[served_names.OBJECTIVE_SPEEDUP],
        se,
        run[served_names.low(served_names.OBJECTIVE_SPEEDUP)],
        run[served_names.high(served_names.OBJECTIVE_SPEEDUP)],
        0,
    ).text()


def break_even_text(run) -> str:
    """`3.62 [3.41, 3.85], 2.38 short`; `not measured` for a run served before break-evens were measured."""
    needed = run.get(served_names.BREAK_EVEN_COLUMN, float("nan"))
    if needed is None or math.isnan(needed):
        return "not measured"
    if math.isinf(needed):
        return "not reached within the block"
    interval = interval_text(
        needed,
        run[served_names.low(served_names.BREAK_EVEN_COLUMN)],
        run[served_names.high(served_names.BREAK_EVEN_COLUMN)],
    )
    short = needed - run[served_names.GREEDY_COLUMN]
    return f"{interval}, {short:.2f} short" if short > 0 else f"{interval}, paid for"


def deleted_runs(record: StudyRecord) -> str | None:
    """The child runs deleted in MLflow: named, and left out of every table, fit and ranking."""
    if not record.deleted:
        return None
    best_run = record.parent["tags"].get(tracking.TAG_BEST_RUN_ID, "")
    lines = [
        "## Deleted runs",
        "",
        f"{len(record.deleted)} child run(s) were deleted in MLflow; every table, fit and ranking above uses only "
        "the runs that exist (`mlflow runs restore --run-id ID`, then rebuild the report, brings one back):",
        "",
        *(f"- `{r['run_name']}` ({r['label']}, run id `{r['run_id']}`)" for r in record.deleted),
    ]
    if any(r["run_id"] == best_run for r in record.deleted):
        best = record.parent["tags"].get(tracking.TAG_BEST_TRIAL, "")
        lines += ["", f"Optuna's best ({best}) is among them: the leaderboard's first row is the best that exists."]
    return "\n".join(lines)


def problems(record: StudyRecord) -> str:
    runs = record.runs
    bad = runs[runs["status"] != RunStatus.FINISHED] if not runs.empty else runs
    if bad.empty:
        return "## Pruned, infeasible and failed runs\n\nNone."
    rows = [
        [
            f"baseline {r['baseline']} seed {r['seed']}"
            if r["role"] == tracking.ROLE_BASELINE
            else f"trial {r['trial']}",
            r["status"],
            r["reason"] or "–",
            *[fmt_value(r[k]) if r[k] != "" else "" for k in TUNED_KNOBS],
        ]
        for _, r in bad.sort_values("run_name").iterrows()
    ]
    return "## Pruned, infeasible and failed runs\n\n" + table(["run", "status", "reason", *TUNED_KNOBS], rows)
