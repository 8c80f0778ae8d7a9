"""MLflow -> pandas: everything a report shows comes from the tracking store, nothing from memory."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from mlflow.entities import ViewType
from mlflow.exceptions import MlflowException

from algorithms import ALGORITHMS, SharedKnobs
from algorithms.metrics import ACCEPTED_LENGTHS, DRAFT_STEP_MS, HEADLINE_METRICS, REALIZED_ACCEPTED_LENGTH, se_name
from harness import tracking
from harness.config import TrainConfig
from harness.data import DataConfig
from harness.run import VALIDATION_DOCUMENTS_FILE
from harness.serving import metrics as served_names
from harness.tracking import RunStatus
from harness.validation import SUBSET_ROWS

VAL, EVAL = tracking.VAL_PREFIX, tracking.EVAL_PREFIX
# Every knob any registered algorithm tunes, in registry order: the knob columns of a report.
TUNED_KNOBS = tuple(dict.fromkeys(knob for entry in ALGORITHMS.values() for knob in entry.tuned_knobs))
# The shared, training and data knobs a study may also sweep: a report shows those that differ between its runs.
OTHER_KNOBS = tuple(
    k for k in (*SharedKnobs.SWEEPABLE, *TrainConfig.SWEEPABLE, *DataConfig.SWEEPABLE) if k not in TUNED_KNOBS
)
KNOB_SECTIONS = ("algo", "shared", "train", "data")  # where a run's params spell each knob
MEASURED = {
    "measured_greedy": "measured_accepted_length_greedy",
    "measured_t1": "measured_accepted_length_t1",
    # committed tokens per token the target verified (a confidence-scheduled member verifies fewer)
    "measured_per_verified": "measured_accepted_length_greedy_accepted_per_verified",
}


@dataclass
class StudyRecord:
    """One study as recorded: its parent run and a frame of child runs (trials and baselines)."""

    name: str
    parent: dict
    runs: pd.DataFrame  # one row per child run; `config` groups the seeds of one trial or baseline
    documents: dict[str, pd.DataFrame] = field(default_factory=dict)  # run id -> per-document validation pairs
    curves: dict[str, pd.DataFrame] = field(default_factory=dict)  # run id -> learning curve (step, metric, se)
    deleted: list[dict] = field(default_factory=list)  # child runs deleted in MLflow: run_id, run_name, label


def collect(study: str, workdir: Path) -> StudyRecord:
    client = tracking.client(workdir)
    experiment = client.get_experiment_by_name(tracking.experiment_name(study))
    if experiment is None:
        raise LookupError(
            f"no MLflow experiment named {tracking.experiment_name(study)!r} in {tracking.tracking_uri(workdir)}; "
            "launch the study first"
        )
    runs = client.search_runs([experiment.experiment_id], max_results=50000)
    deleted = client.search_runs([experiment.experiment_id], run_view_type=ViewType.DELETED_ONLY, max_results=50000)
    parents = [r for r in runs if r.data.tags.get(tracking.TAG_ROLE) == tracking.ROLE_STUDY]
    if not parents:
        gone = any(r.data.tags.get(tracking.TAG_ROLE) == tracking.ROLE_STUDY for r in deleted)
        raise LookupError(
            f"study {study!r}: its MLflow parent run was deleted; restore it (`mlflow runs restore --run-id ID`)"
            if gone
            else f"experiment {study!r} has no study parent run"
        )
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
            # the seeds of one trial or baseline share it
            "config": f"{role}:{tags.get(tracking.TAG_BASELINE) or tags.get(tracking.TAG_TRIAL, '')}",
            "top_k": top_k,
            "parameters": float(params["draft_parameters"]) if "draft_parameters" in params else float("nan"),
            "target": params.get("target", ""),
            "target_hash": params.get("target_hash", ""),
            "dataset_hash": params.get("dataset_hash", ""),
            "validation_data": params.get("data.validation_data", "None"),
            "design_point": tags.get(tracking.TAG_DESIGN_POINT, ""),
            "computes_in": tags.get(tracking.TAG_COMPUTES_IN, ""),
            "max_steps": int(params.get("train.max_steps") or 0),
            "wall_s": float("nan") if (wall := tracking.wall_seconds(run.info)) is None else wall,
        }
        for knob in (*TUNED_KNOBS, *OTHER_KNOBS):
            row[knob] = next((params[f"{s}.{knob}"] for s in KNOB_SECTIONS if f"{s}.{knob}" in params), "")
        for name in (*HEADLINE_METRICS, DRAFT_STEP_MS):
            row[name] = metrics.get(tracking.metric_key(name, VAL), float("nan"))
        for prefix, columns in ((EVAL, MEASURED), (served_names.PREFIX, served_names.COLUMNS)):
            for column, name in columns.items():
                row[column] = metrics.get(tracking.metric_key(name, prefix), float("nan"))
                row[se_name(column)] = metrics.get(tracking.metric_key(se_name(name), prefix), float("nan"))
        rows.append(row)
    frame = pd.DataFrame(rows)
    if not frame.empty:
        frame = frame.sort_values(
            ["role", REALIZED_ACCEPTED_LENGTH, "run_name"], ascending=[True, False, True], na_position="last"
        ).reset_index(drop=True)
    return StudyRecord(
        study,
        {
            "run_id": parent.info.run_id,
            "experiment": experiment.name,
            "params": parent.data.params,
            "metrics": parent.data.metrics,
            "tags": parent.data.tags,
        },
        frame,
        validation_documents(client, frame),
        learning_curves(client, frame),
        [
            {"run_id": r.info.run_id, "run_name": r.info.run_name, "label": child_label(r.data.tags)}
            for r in sorted(deleted, key=lambda r: r.info.run_name)
            if r.data.tags.get(tracking.TAG_ROLE) in (tracking.ROLE_TRIAL, tracking.ROLE_BASELINE)
        ],
    )


def child_label(tags: dict[str, str]) -> str:
    """`baseline dflash` or `trial 3`: how the report names a child run's configuration."""
    if tags.get(tracking.TAG_ROLE) == tracking.ROLE_BASELINE:
        return f"baseline {tags.get(tracking.TAG_BASELINE, '')}"
    return f"trial {tags.get(tracking.TAG_TRIAL, '')}"


@contextmanager
def no_download_bars():
    """MLflow draws a progress bar for every artifact it downloads: a report reads one small file per run, and
    its bars would bury the command's own output."""
    name = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    before = os.environ.get(name)
    os.environ[name] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name)
        else:
            os.environ[name] = before


def validation_documents(client, runs: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Each finished run's per-document validation pairs (its logged artifact); runs without one are left out."""
    found = {}
    finished = runs[runs["status"] == RunStatus.FINISHED] if not runs.empty else runs
    with tempfile.TemporaryDirectory() as scratch, no_download_bars():
        for run_id in finished.get("run_id", []):
            try:
                path = client.download_artifacts(run_id, VALIDATION_DOCUMENTS_FILE, f"{scratch}/{run_id}")
            except (MlflowException, OSError):
                continue
            found[run_id] = pd.read_csv(path, keep_default_na=False)
    return found


def learning_curves(client, runs: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Each finished run's subset validations by step (curve/*): accepted lengths and their standard errors."""
    found = {}
    finished = runs[runs["status"] == RunStatus.FINISHED] if not runs.empty else runs
    names = [(metric, tracking.metric_key(metric, tracking.CURVE_PREFIX)) for metric in ACCEPTED_LENGTHS]
    names += [(se_name(m), tracking.metric_key(se_name(m), tracking.CURVE_PREFIX)) for m in ACCEPTED_LENGTHS]
    names.append((SUBSET_ROWS, tracking.metric_key(SUBSET_ROWS, tracking.CURVE_PREFIX)))
    for run_id in finished.get("run_id", []):
        columns = {}
        for column, key in names:
            for point in client.get_metric_history(run_id, key):
                columns.setdefault(point.step, {})[column] = point.value
        if columns:
            found[run_id] = pd.DataFrame([{"step": step, **values} for step, values in sorted(columns.items())])
    return found
