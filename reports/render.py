"""Markdown tables, verdict lines that follow from the data, and PNG figures."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd

from algorithms import ALGORITHMS
from algorithms.metrics import (
    DRAFT_STEP_MS,
    ORACLE_ACCEPTED_LENGTH,
    REALIZED_ACCEPTED_LENGTH,
    TEACHER_FORCED_SELECTOR_ACC,
    UNARY_ACCEPTED_LENGTH,
)
from algorithms.registry import REFERENCE_ALGORITHM
from harness import tracking
from harness.tracking import RunStatus
from reports.collect import TUNED_KNOBS, StudyRecord

GENERATED_PREFIX = "Generated: "


def fmt(value, digits: int = 4) -> str:
    """Numbers exactly as stored, rounded to `digits`; blanks for missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or value == "":
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(cell).replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def label(row: pd.Series) -> str:
    if row["role"] == "baseline":
        return f"**baseline {row['baseline']}** (seed {row['seed']})"
    return f"trial {row['trial']}"


def completed(record: StudyRecord) -> pd.DataFrame:
    runs = record.runs
    return runs[runs["status"] == RunStatus.FINISHED] if not runs.empty else runs


def header(record: StudyRecord) -> str:
    params, runs = record.parent["params"], record.runs
    counts = runs.groupby("status").size().to_dict() if not runs.empty else {}
    trials = runs[runs["role"] == "trial"] if not runs.empty else runs
    trial_counts = trials.groupby("status").size().to_dict() if not trials.empty else {}
    first = runs.iloc[0] if not runs.empty else None
    pinned = sorted((k.removeprefix("pinned.shared."), v) for k, v in params.items() if k.startswith("pinned.shared."))
    target = (
        f"{first['target']} (weights `{first['target_hash']}`)"
        if first is not None
        else params.get("pinned.target", "–")
    )
    data = (
        f"{first['dataset']} (hash `{first['dataset_hash']}`)"
        if first is not None
        else params.get("pinned.data.dataset", "–")
    )
    lines = [
        f"# Ablation report: `{record.name}`",
        "",
        f"- **Target:** {target}",
        f"- **Data:** {data}",
        f"- **Objective:** {params.get('study.objectives', '–')} on the validation set (deterministic anchors); "
        f"sampler {params.get('study.sampler', '–')}, pruner {params.get('study.pruner', '–')}, "
        f"{params.get('study.steps_per_trial', '–')} steps per trial",
        f"- **Trials:** {sum(trial_counts.values())} "
        f"({', '.join(f'{n} {s}' for s, n in sorted(trial_counts.items())) or 'none'}); "
        f"baselines: {len(runs) - len(trials)}; "
        f"all runs: {', '.join(f'{n} {s}' for s, n in sorted(counts.items())) or 'none'}",
        f"- **MLflow:** experiment `{record.name}`, parent run `{record.parent['run_id']}`",
        f"- {GENERATED_PREFIX}{datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        "",
        "Shared knobs pinned for every trial and baseline:",
        "",
        table(["knob", "value"], [[k, v] for k, v in pinned]),
    ]
    return "\n".join(lines)


def leaderboard(record: StudyRecord) -> str:
    done = completed(record)
    if done.empty:
        return "## Leaderboard\n\nNo trial or baseline completed, so there is nothing to rank yet."
    measured = done[["measured_greedy", "measured_t1"]].notna().any().any()
    headers = [
        "run",
        *TUNED_KNOBS,
        "unary",
        "realized",
        "oracle",
        *(["measured T=0", "measured T=1"] if measured else []),
        "selector gain",
        "oracle headroom",
        "recall@K",
        "target mass@K",
        "TF selector acc",
        "draft step ms",
        "params",
    ]
    rows = [
        [
            label(r),
            *[r[k] for k in TUNED_KNOBS],
            r[UNARY_ACCEPTED_LENGTH],
            r[REALIZED_ACCEPTED_LENGTH],
            r[ORACLE_ACCEPTED_LENGTH],
            *([r["measured_greedy"], r["measured_t1"]] if measured else []),
            r["selector_gain"],
            r["oracle_headroom"],
            r["recall_at_k"],
            r["target_mass_at_k"],
            r[TEACHER_FORCED_SELECTOR_ACC],
            r[DRAFT_STEP_MS],
            f"{int(r['parameters']):,}" if not math.isnan(r["parameters"]) else "",
        ]
        for _, r in done.sort_values([REALIZED_ACCEPTED_LENGTH, "run_name"], ascending=[False, True]).iterrows()
    ]
    note = (
        "Accepted lengths include the verified anchor. *unary*: the argmax path plain DFlash decoding realizes; "
        "*realized*: the selector walk replayed for real; *oracle*: target inside the unary top-K at every slot. "
        "Target mass@K is measured on the original unary top-K (no training-time injection). "
        "K is each run's `candidate_top_k`. *Measured* columns, where present, are per-request mean "
        "acceptance of real speculative "
        "decoding with the target (MT-bench + held-out chat prompts, `dflash-lab evaluate`)."
    )
    return "## Leaderboard\n\n" + note + "\n\n" + table(headers, rows)


def knob_effects(record: StudyRecord, figure: str | None) -> str:
    done = completed(record)
    trials = done[done["role"] == "trial"] if not done.empty else done
    parts = ["## Knob effects"]
    if len(trials) < 2:
        parts.append(f"{len(trials)} completed trial(s): too few to estimate knob effects.")
        return "\n\n".join(parts)
    for knob in TUNED_KNOBS:
        values = trials[knob].replace("", pd.NA).dropna()
        if values.nunique() < 2:
            continue
        grouped = (
            trials.assign(value=trials[knob].astype(float))
            .groupby("value")[REALIZED_ACCEPTED_LENGTH]
            .agg(["mean", "std", "count"])
        )
        parts.append(
            f"**{knob}** (realized accepted length, mean ± std over trials)\n\n"
            + table(
                [knob, "mean", "std", "trials"],
                [[fmt_value(v), r["mean"], r["std"], int(r["count"])] for v, r in grouped.iterrows()],
            )
        )
    importances = {
        k.removeprefix(tracking.IMPORTANCE_PREFIX): v
        for k, v in record.parent["metrics"].items()
        if k.startswith(tracking.IMPORTANCE_PREFIX)
    }
    if importances:
        parts.append(
            "Optuna parameter importances (fANOVA on the objective):\n\n"
            + table(["knob", "importance"], [[k, v] for k, v in sorted(importances.items(), key=lambda kv: -kv[1])])
        )
    if figure:
        parts.append(f"![realized accepted length against each knob]({figure})")
    return "\n\n".join(parts)


def fmt_value(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def positions(row: pd.Series, path: str) -> list[tuple[int, float]]:
    return sorted(
        (int(c.removeprefix(f"{path}_pos")), row[c])
        for c in row.index
        if c.startswith(f"{path}_pos") and not pd.isna(row[c])
    )


def best_and_dflash(record: StudyRecord) -> list[tuple[str, pd.Series]]:
    done = completed(record)
    chosen = []
    trials = done[done["role"] == "trial"] if not done.empty else done
    if not trials.empty:
        chosen.append(
            (
                "best trial " + str(trials.iloc[0]["trial"]),
                trials.sort_values(REALIZED_ACCEPTED_LENGTH, ascending=False).iloc[0],
            )
        )
    is_reference = (done["role"] == tracking.ROLE_BASELINE) & (done["baseline"] == REFERENCE_ALGORITHM)
    dflash = done[is_reference] if not done.empty else done
    if not dflash.empty:
        chosen.append(("DFlash baseline", dflash.sort_values("seed").iloc[0]))
    return chosen


def per_position(record: StudyRecord, figure: str | None) -> str:
    chosen = best_and_dflash(record)
    parts = ["## Per-position acceptance"]
    if not chosen:
        parts.append("No completed run to show.")
        return "\n\n".join(parts)
    parts.append(
        "Conditional on every earlier slot being accepted (the shape of the DFlash2 blog's Table 1). "
        "Recall@1 is the unary argmax path, Recall@K the unary top-K (oracle) path, and *realized* the selector walk."
    )
    for title, row in chosen:
        slots = [s for s, _ in positions(row, "unary")]
        rows = [
            ["Recall@1", *[v for _, v in positions(row, "unary")], row[UNARY_ACCEPTED_LENGTH]],
            [f"Recall@{row['top_k']}", *[v for _, v in positions(row, "oracle")], row[ORACLE_ACCEPTED_LENGTH]],
            ["realized", *[v for _, v in positions(row, "realized")], row[REALIZED_ACCEPTED_LENGTH]],
        ]
        parts.append(
            f"**{title}** ({row['run_name']})\n\n" + table(["", *[f"pos {s}" for s in slots], "accepted length"], rows)
        )
    if figure:
        parts.append(f"![per-position conditional acceptance]({figure})")
    return "\n\n".join(parts)


def seed_interval(values: pd.Series, confidence: float = 0.95) -> tuple[float, float, float]:
    """Mean and the t-interval over seeds (nan bounds with fewer than two)."""
    from scipy import stats

    mean = float(values.mean())
    if len(values) < 2:
        return mean, float("nan"), float("nan")
    half = float(stats.t.ppf(0.5 + confidence / 2, len(values) - 1) * values.std(ddof=1) / math.sqrt(len(values)))
    return mean, mean - half, mean + half


def component_ablation(record: StudyRecord) -> str | None:
    """Each registered variant run as a baseline: accepted lengths over seeds, and its gain over the
    reference algorithm paired by seed. None when the study ran fewer than two variants."""
    done = completed(record)
    variants = done[(done["role"] == tracking.ROLE_BASELINE) & done["baseline"].isin(list(ALGORITHMS))]
    names = [name for name in ALGORITHMS if name in set(variants["baseline"])]
    if len(names) < 2:
        return None
    metrics = (UNARY_ACCEPTED_LENGTH, REALIZED_ACCEPTED_LENGTH, ORACLE_ACCEPTED_LENGTH)
    rows = []
    for name in names:
        runs = variants[variants["baseline"] == name]
        cells = [
            f"{fmt(runs[m].mean(), 3)} ± {fmt(runs[m].std() if len(runs) > 1 else float('nan'), 3)}" for m in metrics
        ]
        rows.append([f"`{name}`", ALGORITHMS[name].description, len(runs), *cells])
    parts = [
        "## Component ablation",
        "Every variant shares the study's pinned shared knobs and the base's conv and selector knobs; "
        "values are the mean ± standard deviation over seeds of the final validation.",
        table(["variant", "components", "seeds", "unary", "realized", "oracle"], rows),
    ]
    reference = variants[variants["baseline"] == REFERENCE_ALGORITHM].set_index("seed")
    if reference.empty:
        return "\n\n".join(parts)
    gains = []
    for name in names:
        if name == REFERENCE_ALGORITHM:
            continue
        runs = variants[variants["baseline"] == name].set_index("seed")
        seeds = sorted(set(runs.index) & set(reference.index))
        for metric in (REALIZED_ACCEPTED_LENGTH, UNARY_ACCEPTED_LENGTH):
            paired = runs.loc[seeds, metric] - reference.loc[seeds, metric]
            mean, low, high = seed_interval(paired)
            if math.isnan(low):
                verdict = "one seed: no interval"
            elif low <= 0 <= high:
                verdict = "not distinguishable from noise at this budget"
            else:
                verdict = "gain" if mean > 0 else "loss"
            interval = "–" if math.isnan(low) else f"[{low:+.3f}, {high:+.3f}]"
            gains.append(
                [
                    f"`{name}` − `{REFERENCE_ALGORITHM}`",
                    metric.split("_")[0],
                    len(seeds),
                    f"{mean:+.3f}",
                    interval,
                    verdict,
                ]
            )
    parts += [
        f"Gain of each variant over `{REFERENCE_ALGORITHM}`, paired by seed, with the 95% t-interval over seeds "
        "(the spread between seeds is the noise here; within-run anchor noise is not yet included):",
        table(["difference", "accepted length", "seeds", "mean", "95% interval", "verdict"], gains),
    ]
    return "\n\n".join(parts)


def has_selector(algorithm: str) -> bool:
    return algorithm in ALGORITHMS and ALGORITHMS[algorithm].has_selector


def verdicts(record: StudyRecord) -> str:
    """Statements computed from the recorded numbers; each says what it is based on."""
    done = completed(record)
    lines = ["## Verdicts"]
    if done.empty:
        return "## Verdicts\n\n- No completed runs: no verdict can be drawn."
    selector_runs = done[done["algorithm"].map(has_selector)]
    if not selector_runs.empty:
        best = selector_runs.sort_values(REALIZED_ACCEPTED_LENGTH, ascending=False).iloc[0]
        gain, unary = best["selector_gain"], best[UNARY_ACCEPTED_LENGTH]
        relative = 100 * gain / unary if unary else float("nan")
        verb = "beats" if gain > 0 else ("ties" if gain == 0 else "trails")
        spread = selector_runs["selector_gain"]
        lines.append(
            f"- The selector {verb} unary decoding on the best selector run ({label(best)}): "
            f"realized {fmt(best['realized_accepted_length'])} vs unary {fmt(unary)} ({fmt(gain)}, {relative:+.1f}%). "
            f"Across {len(selector_runs)} completed selector runs the gain is {fmt(spread.mean())} ± "
            f"{fmt(spread.std() if len(spread) > 1 else 0.0)}, positive in {int((spread > 0).sum())}."
        )
        headroom_note = (
            "a better re-ranker of the same candidates could still gain this much."
            if best["oracle_headroom"] > 0.05
            else "the selector is close to the top-K ceiling."
        )
        lines.append(
            f"- Oracle headroom on that run: {fmt(best['oracle_headroom'])} tokens per cycle "
            f"(oracle {fmt(best['oracle_accepted_length'])}): {headroom_note}"
        )
    reference = done[done["algorithm"] == REFERENCE_ALGORITHM]
    if not reference.empty and not selector_runs.empty:
        d1 = reference[REALIZED_ACCEPTED_LENGTH]
        best_value = selector_runs[REALIZED_ACCEPTED_LENGTH].max()
        seeds = f" (over {len(d1)} seeds: {fmt(d1.mean())} ± {fmt(d1.std())})" if len(d1) > 1 else ""
        ahead = "the selector run ahead" if best_value > d1.mean() else f"{REFERENCE_ALGORITHM} ahead or equal"
        lines.append(
            f"- Best selector run realized {fmt(best_value)} vs {REFERENCE_ALGORITHM} baseline "
            f"{fmt(d1.mean())}{seeds}: "
            f"{ahead} by {fmt(abs(best_value - d1.mean()))}."
        )
    importances = {
        k.removeprefix(tracking.IMPORTANCE_PREFIX): v
        for k, v in record.parent["metrics"].items()
        if k.startswith(tracking.IMPORTANCE_PREFIX)
    }
    if importances:
        knob, value = max(importances.items(), key=lambda kv: kv[1])
        lines.append(f"- The knob that mattered most (Optuna importance): `{knob}` ({fmt(value, 3)}).")
    return "\n".join(lines)


def problems(record: StudyRecord) -> str:
    runs = record.runs
    bad = runs[runs["status"] != RunStatus.FINISHED] if not runs.empty else runs
    if bad.empty:
        return "## Pruned, infeasible and failed runs\n\nNone."
    rows = [
        [label(r), r["status"], r["reason"] or "–", *[r[k] for k in TUNED_KNOBS]]
        for _, r in bad.sort_values("run_name").iterrows()
    ]
    return "## Pruned, infeasible and failed runs\n\n" + table(["run", "status", "reason", *TUNED_KNOBS], rows)


def knob_figure(record: StudyRecord, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trials = completed(record)
    trials = trials[trials["role"] == "trial"] if not trials.empty else trials
    knobs = [k for k in TUNED_KNOBS if not trials.empty and trials[k].replace("", pd.NA).dropna().nunique() >= 2]
    if len(trials) < 2 or not knobs:
        return False
    fig, axes = plt.subplots(1, len(knobs), figsize=(3.2 * len(knobs), 3), squeeze=False)
    for axis, knob in zip(axes[0], knobs, strict=True):
        x = trials[knob].astype(float)
        for metric, marker in (
            (UNARY_ACCEPTED_LENGTH, "s"),
            (REALIZED_ACCEPTED_LENGTH, "o"),
            (ORACLE_ACCEPTED_LENGTH, "^"),
        ):
            axis.scatter(x, trials[metric], marker=marker, label=metric.split("_")[0], alpha=0.8)
        axis.set_xlabel(knob)
        if knob in ("selector_rank", "selector_loss_alpha", "conv_group_size"):
            axis.set_xscale("log")
    axes[0][0].set_ylabel("accepted length")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def position_figure(record: StudyRecord, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = best_and_dflash(record)
    if not chosen:
        return False
    fig, axis = plt.subplots(figsize=(6, 3.5))
    for (title, row), style in zip(chosen, ("-", "--"), strict=False):
        for path_name, name in (("unary", "Recall@1"), ("oracle", f"Recall@{row['top_k']}"), ("realized", "realized")):
            points = positions(row, path_name)
            axis.plot([s for s, _ in points], [v for _, v in points], style, marker="o", label=f"{title}: {name}")
    axis.set_xlabel("draft position")
    axis.set_ylabel("conditional acceptance")
    axis.set_ylim(0, 1.02)
    axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def render(record: StudyRecord, out_dir: Path) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    knobs_png = "knob_effects.png" if knob_figure(record, out_dir / "knob_effects.png") else None
    positions_png = "per_position.png" if position_figure(record, out_dir / "per_position.png") else None
    return (
        "\n\n".join(
            [
                header(record),
                leaderboard(record),
                *filter(None, [component_ablation(record)]),
                knob_effects(record, knobs_png),
                per_position(record, positions_png),
                verdicts(record),
                problems(record),
            ]
        )
        + "\n"
    )


def render_comparison(first: StudyRecord, second: StudyRecord) -> str:
    """Two studies side by side: counts, best runs and the headline metrics."""
    rows = []
    for record in (first, second):
        done = completed(record)
        best = done.sort_values(REALIZED_ACCEPTED_LENGTH, ascending=False).iloc[0] if not done.empty else None
        rows.append(
            [
                record.name,
                len(record.runs),
                len(done),
                label(best) if best is not None else "–",
                *(
                    [
                        best[m]
                        for m in (
                            UNARY_ACCEPTED_LENGTH,
                            REALIZED_ACCEPTED_LENGTH,
                            ORACLE_ACCEPTED_LENGTH,
                            "selector_gain",
                            "oracle_headroom",
                        )
                    ]
                    if best is not None
                    else ["–"] * 5
                ),
            ]
        )
    lines = [
        f"# Comparison: `{first.name}` vs `{second.name}`",
        "",
        f"- {GENERATED_PREFIX}{datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        "",
        table(
            [
                "study",
                "runs",
                "completed",
                "best run",
                "unary",
                "realized",
                "oracle",
                "selector gain",
                "oracle headroom",
            ],
            rows,
        ),
    ]
    for record in (first, second):
        lines += ["", f"## `{record.name}`", "", leaderboard(record).split("\n", 2)[2]]
    return "\n".join(lines) + "\n"
