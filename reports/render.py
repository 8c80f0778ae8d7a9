"""Markdown tables, verdict lines that follow from the data, and PNG figures."""

from __future__ import annotations

import math
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from reports.collect import StudyRecord
from studies.schema import SWEPT_KNOBS

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
    return runs[runs["status"] == "complete"] if not runs.empty else runs


def header(record: StudyRecord) -> str:
    params, runs = record.parent["params"], record.runs
    counts = runs.groupby("status").size().to_dict() if not runs.empty else {}
    trials = runs[runs["role"] == "trial"] if not runs.empty else runs
    trial_counts = trials.groupby("status").size().to_dict() if not trials.empty else {}
    first = runs.iloc[0] if not runs.empty else None
    pinned = sorted((k.removeprefix("pinned.shared."), v) for k, v in params.items() if k.startswith("pinned.shared."))
    target = f"{first['target']} (weights `{first['target_hash']}`)" if first is not None else params.get("pinned.target", "–")
    data = f"{first['dataset']} (hash `{first['dataset_hash']}`)" if first is not None else params.get("pinned.data.dataset", "–")
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
        f"baselines: {len(runs) - len(trials)}; all runs: {', '.join(f'{n} {s}' for s, n in sorted(counts.items())) or 'none'}",
        f"- **MLflow:** experiment `{record.name}`, parent run `{record.parent['run_id']}`",
        f"- {GENERATED_PREFIX}{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
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
    headers = ["run", *SWEPT_KNOBS, "unary", "realized", "oracle", *(["measured T=0", "measured T=1"] if measured else []),
               "selector gain", "oracle headroom", "recall@K", "target mass@K", "TF selector acc", "draft step ms", "params"]
    rows = [[label(r), *[r[k] for k in SWEPT_KNOBS], r["unary_accepted_length"], r["realized_accepted_length"],
             r["oracle_accepted_length"], *([r["measured_greedy"], r["measured_t1"]] if measured else []),
             r["selector_gain"], r["oracle_headroom"], r["recall_at_k"], r["target_mass_at_k"],
             r["teacher_forced_selector_acc"], r["draft_step_ms"], f"{int(r['parameters']):,}" if not math.isnan(r["parameters"]) else ""]
            for _, r in done.sort_values(["realized_accepted_length", "run_name"], ascending=[False, True]).iterrows()]
    note = ("Accepted lengths include the verified anchor. *unary*: the argmax path plain DFlash decoding realizes; "
            "*realized*: the selector walk replayed for real; *oracle*: target inside the unary top-K at every slot. "
            "Target mass@K is measured on the original unary top-K (no training-time injection). K is each run's `selector_top_k` "
            "(DFlash: `metrics_top_k`). *Measured* columns, where present, are per-request mean acceptance of real speculative "
            "decoding with the target (MT-bench + held-out chat prompts, `dflash-lab evaluate`).")
    return "## Leaderboard\n\n" + note + "\n\n" + table(headers, rows)


def knob_effects(record: StudyRecord, figure: str | None) -> str:
    done = completed(record)
    trials = done[done["role"] == "trial"] if not done.empty else done
    parts = ["## Knob effects"]
    if len(trials) < 2:
        parts.append(f"{len(trials)} completed trial(s): too few to estimate knob effects.")
        return "\n\n".join(parts)
    for knob in SWEPT_KNOBS:
        values = trials[knob].replace("", pd.NA).dropna()
        if values.nunique() < 2:
            continue
        grouped = trials.assign(value=trials[knob].astype(float)).groupby("value")["realized_accepted_length"].agg(["mean", "std", "count"])
        parts.append(f"**{knob}** (realized accepted length, mean ± std over trials)\n\n" + table(
            [knob, "mean", "std", "trials"], [[fmt_value(v), r["mean"], r["std"], int(r["count"])] for v, r in grouped.iterrows()]))
    importances = {k.removeprefix("importance/"): v for k, v in record.parent["metrics"].items() if k.startswith("importance/")}
    if importances:
        parts.append("Optuna parameter importances (fANOVA on the objective):\n\n" + table(
            ["knob", "importance"], [[k, v] for k, v in sorted(importances.items(), key=lambda kv: -kv[1])]))
    if figure:
        parts.append(f"![realized accepted length against each knob]({figure})")
    return "\n\n".join(parts)


def fmt_value(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def positions(row: pd.Series, path: str) -> list[tuple[int, float]]:
    return sorted((int(c.removeprefix(f"{path}_pos")), row[c]) for c in row.index if c.startswith(f"{path}_pos") and not pd.isna(row[c]))


def best_and_dflash(record: StudyRecord) -> list[tuple[str, pd.Series]]:
    done = completed(record)
    chosen = []
    trials = done[done["role"] == "trial"] if not done.empty else done
    if not trials.empty:
        chosen.append(("best trial " + str(trials.iloc[0]["trial"]), trials.sort_values("realized_accepted_length", ascending=False).iloc[0]))
    dflash = done[(done["role"] == "baseline") & (done["baseline"] == "dflash")] if not done.empty else done
    if not dflash.empty:
        chosen.append(("DFlash baseline", dflash.sort_values("seed").iloc[0]))
    return chosen


def per_position(record: StudyRecord, figure: str | None) -> str:
    chosen = best_and_dflash(record)
    parts = ["## Per-position acceptance"]
    if not chosen:
        parts.append("No completed run to show.")
        return "\n\n".join(parts)
    parts.append("Conditional on every earlier slot being accepted (the shape of the DFlash2 blog's Table 1). "
                 "Recall@1 is the unary argmax path, Recall@K the unary top-K (oracle) path, and *realized* the selector walk.")
    for title, row in chosen:
        slots = [s for s, _ in positions(row, "unary")]
        rows = [[f"Recall@1", *[v for _, v in positions(row, "unary")], row["unary_accepted_length"]],
                [f"Recall@{row['top_k']}", *[v for _, v in positions(row, "oracle")], row["oracle_accepted_length"]],
                ["realized", *[v for _, v in positions(row, "realized")], row["realized_accepted_length"]]]
        parts.append(f"**{title}** ({row['run_name']})\n\n" + table(["", *[f"pos {s}" for s in slots], "accepted length"], rows))
    if figure:
        parts.append(f"![per-position conditional acceptance]({figure})")
    return "\n\n".join(parts)


def verdicts(record: StudyRecord) -> str:
    """Statements computed from the recorded numbers; each says what it is based on."""
    done = completed(record)
    lines = ["## Verdicts"]
    if done.empty:
        return "## Verdicts\n\n- No completed runs: no verdict can be drawn."
    dflash2 = done[done["algorithm"] == "dflash2"]
    if not dflash2.empty:
        best = dflash2.sort_values("realized_accepted_length", ascending=False).iloc[0]
        gain = best["selector_gain"]
        relative = 100 * gain / best["unary_accepted_length"] if best["unary_accepted_length"] else float("nan")
        verb = "beats" if gain > 0 else ("ties" if gain == 0 else "trails")
        spread = dflash2["selector_gain"]
        lines.append(f"- The selector {verb} unary decoding on the best DFlash2 run ({label(best)}): realized {fmt(best['realized_accepted_length'])} "
                     f"vs unary {fmt(best['unary_accepted_length'])} ({fmt(gain)}, {relative:+.1f}%). Across {len(dflash2)} completed DFlash2 runs the gain "
                     f"is {fmt(spread.mean())} ± {fmt(spread.std() if len(spread) > 1 else 0.0)}, positive in {int((spread > 0).sum())}.")
        lines.append(f"- Oracle headroom on that run: {fmt(best['oracle_headroom'])} tokens per cycle (oracle {fmt(best['oracle_accepted_length'])}): "
                     + ("a better re-ranker of the same candidates could still gain this much." if best["oracle_headroom"] > 0.05 else "the selector is close to the top-K ceiling."))
    dflash = done[done["algorithm"] == "dflash"]
    if not dflash.empty and not dflash2.empty:
        d1 = dflash["realized_accepted_length"]
        best_value = dflash2["realized_accepted_length"].max()
        seeds = f" (DFlash over {len(d1)} seeds: {fmt(d1.mean())} ± {fmt(d1.std())})" if len(d1) > 1 else ""
        lines.append(f"- Best DFlash2 realized {fmt(best_value)} vs DFlash baseline {fmt(d1.mean())}{seeds}: "
                     f"{'DFlash2 ahead' if best_value > d1.mean() else 'DFlash ahead or equal'} by {fmt(abs(best_value - d1.mean()))}.")
        defaults = done[(done["baseline"] == "dflash2_defaults")]
        if len(defaults) > 1 and len(d1) > 1:
            lines.append(f"- Published-default DFlash2 across {len(defaults)} seeds: {fmt(defaults['realized_accepted_length'].mean())} ± "
                         f"{fmt(defaults['realized_accepted_length'].std())}.")
    importances = {k.removeprefix("importance/"): v for k, v in record.parent["metrics"].items() if k.startswith("importance/")}
    if importances:
        knob, value = max(importances.items(), key=lambda kv: kv[1])
        lines.append(f"- The knob that mattered most (Optuna importance): `{knob}` ({fmt(value, 3)}).")
    return "\n".join(lines)


def problems(record: StudyRecord) -> str:
    runs = record.runs
    bad = runs[runs["status"].isin(["pruned", "failed", "infeasible", "running"])] if not runs.empty else runs
    if bad.empty:
        return "## Pruned, infeasible and failed runs\n\nNone."
    rows = [[label(r), r["status"], r["reason"] or "–", *[r[k] for k in SWEPT_KNOBS]] for _, r in bad.sort_values("run_name").iterrows()]
    return "## Pruned, infeasible and failed runs\n\n" + table(["run", "status", "reason", *SWEPT_KNOBS], rows)


def knob_figure(record: StudyRecord, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trials = completed(record)
    trials = trials[trials["role"] == "trial"] if not trials.empty else trials
    knobs = [k for k in SWEPT_KNOBS if not trials.empty and trials[k].replace("", pd.NA).dropna().nunique() >= 2]
    if len(trials) < 2 or not knobs:
        return False
    fig, axes = plt.subplots(1, len(knobs), figsize=(3.2 * len(knobs), 3), squeeze=False)
    for axis, knob in zip(axes[0], knobs):
        x = trials[knob].astype(float)
        for metric, marker in (("unary_accepted_length", "s"), ("realized_accepted_length", "o"), ("oracle_accepted_length", "^")):
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
    for (title, row), style in zip(chosen, ("-", "--")):
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
    return "\n\n".join([header(record), leaderboard(record), knob_effects(record, knobs_png), per_position(record, positions_png),
                        verdicts(record), problems(record)]) + "\n"


def render_comparison(first: StudyRecord, second: StudyRecord) -> str:
    """Two studies side by side: counts, best runs and the headline metrics."""
    rows = []
    for record in (first, second):
        done = completed(record)
        best = done.sort_values("realized_accepted_length", ascending=False).iloc[0] if not done.empty else None
        rows.append([record.name, len(record.runs), len(done),
                     label(best) if best is not None else "–",
                     *([best[m] for m in ("unary_accepted_length", "realized_accepted_length", "oracle_accepted_length", "selector_gain", "oracle_headroom")]
                       if best is not None else ["–"] * 5)])
    lines = [f"# Comparison: `{first.name}` vs `{second.name}`", "", f"- {GENERATED_PREFIX}{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}", "",
             table(["study", "runs", "completed", "best run", "unary", "realized", "oracle", "selector gain", "oracle headroom"], rows)]
    for record in (first, second):
        lines += ["", f"## `{record.name}`", "", leaderboard(record).split("\n", 2)[2]]
    return "\n".join(lines) + "\n"
