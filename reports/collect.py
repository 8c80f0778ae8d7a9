"""MLflow -> pandas: everything a report shows comes from the tracking store, nothing from memory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from algorithms import ALGORITHMS
from algorithms.metrics import (
    ACCEPTED_LENGTHS,
    DRAFT_STEP_MS,
    ORACLE_ACCEPTED_LENGTH,
    PATHS,
    REALIZED_ACCEPTED_LENGTH,
    TEACHER_FORCED_SELECTOR_ACC,
    UNARY_ACCEPTED_LENGTH,
    UNARY_FULL_ACC,
    conditional_acc_name,
    recall_name,
    target_mass_name,
)
from harness import tracking
from harness.tracking import RunStatus

VAL, EVAL = tracking.VAL_PREFIX, tracking.EVAL_PREFIX
# Every knob any registered algorithm tunes, in registry order: the knob columns of a report.
TUNED_KNOBS = tuple(dict.fromkeys(knob for entry in ALGORITHMS.values() for knob in entry.tuned_knobs))
MAX_SLOTS = 64


@dataclass
class StudyRecord:
    """One study as recorded: its parent run and a frame of child runs (trials and baselines)."""

    name: str
    parent: dict
    runs: pd.DataFrame  # one row per child run


def collect(study: str, workdir: Path) -> StudyRecord:
    client = tracking.client(workdir)
    experiment = client.get_experiment_by_name(study)
    if experiment is None:
        raise LookupError(
            f"no MLflow experiment named {study!r} in {tracking.tracking_uri(workdir)}; launch the study first"
        )
    runs = client.search_runs([experiment.experiment_id], max_results=50000)
    parents = [r for r in runs if r.data.tags.get(tracking.TAG_ROLE) == tracking.ROLE_STUDY]
    if not parents:
        raise LookupError(f"experiment {study!r} has no study parent run")
    parent = parents[0]
    rows = []
    for run in runs:
        role = run.data.tags.get(tracking.TAG_ROLE)
        if role not in (tracking.ROLE_TRIAL, tracking.ROLE_BASELINE):
            continue
        params, metrics, tags = run.data.params, run.data.metrics, run.data.tags
        algorithm = params.get("algorithm", "")
        top_k = int(params.get("shared.candidate_top_k") or 0)
        row = {
            "run_id": run.info.run_id,
            "run_name": run.info.run_name,
            "role": role,
            "baseline": tags.get(tracking.TAG_BASELINE, ""),
            "trial": tags.get(tracking.TAG_TRIAL, ""),
            "status": RunStatus.of(tags, run.info.status).value,
            "reason": tags.get(tracking.TAG_STATUS_REASON, ""),
            "algorithm": algorithm,
            "seed": params.get("train.seed", ""),
            "top_k": top_k,
            "parameters": float(params["draft_parameters"]) if "draft_parameters" in params else float("nan"),
            "target": params.get("target", ""),
            "target_hash": params.get("target_hash", ""),
            "dataset": params.get("dataset", ""),
            "dataset_hash": params.get("dataset_hash", ""),
        }
        for knob in TUNED_KNOBS:
            row[knob] = params.get(f"algo.{knob}", params.get(f"shared.{knob}", ""))
        for name in ACCEPTED_LENGTHS:
            row[name] = metrics.get(f"{VAL}{name}", float("nan"))
        row["recall_at_k"] = metrics.get(f"{VAL}{recall_name(top_k)}", float("nan"))
        row["target_mass_at_k"] = metrics.get(f"{VAL}{target_mass_name(top_k)}", float("nan"))
        row["unary_recall_at_1"] = metrics.get(f"{VAL}{UNARY_FULL_ACC}", float("nan"))
        row[TEACHER_FORCED_SELECTOR_ACC] = metrics.get(f"{VAL}{TEACHER_FORCED_SELECTOR_ACC}", float("nan"))
        row[DRAFT_STEP_MS] = metrics.get(f"{VAL}{DRAFT_STEP_MS}", float("nan"))
        row["measured_greedy"] = metrics.get(f"{EVAL}measured_accepted_length_greedy", float("nan"))
        row["measured_t1"] = metrics.get(f"{EVAL}measured_accepted_length_t1", float("nan"))
        for path in PATHS:
            for slot in range(MAX_SLOTS):
                key = f"{VAL}{conditional_acc_name(path, slot)}"
                if key in metrics:
                    row[f"{path}_pos{slot}"] = metrics[key]
        rows.append(row)
    frame = pd.DataFrame(rows)
    if not frame.empty:
        frame["selector_gain"] = frame[REALIZED_ACCEPTED_LENGTH] - frame[UNARY_ACCEPTED_LENGTH]
        frame["oracle_headroom"] = frame[ORACLE_ACCEPTED_LENGTH] - frame[REALIZED_ACCEPTED_LENGTH]
        frame = frame.sort_values(
            ["role", REALIZED_ACCEPTED_LENGTH, "run_name"], ascending=[True, False, True], na_position="last"
        ).reset_index(drop=True)
    return StudyRecord(
        study,
        {
            "run_id": parent.info.run_id,
            "params": parent.data.params,
            "metrics": parent.data.metrics,
            "tags": parent.data.tags,
        },
        frame,
    )
