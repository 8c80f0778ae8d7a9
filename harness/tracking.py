"""MLflow naming and run lifecycle. Metric names come from `algorithms.metrics`; prefixes live here."""

from __future__ import annotations

import os
from pathlib import Path

TRAIN_PREFIX, VAL_PREFIX = "train/", "val/"
TAG_ALGORITHM, TAG_STUDY, TAG_TRIAL = "dflash_lab.algorithm", "dflash_lab.study", "dflash_lab.trial_number"
TAG_ROLE, TAG_STATUS_REASON, TAG_RUN_DIR = "dflash_lab.role", "dflash_lab.failure_reason", "dflash_lab.run_dir"
DEFAULT_EXPERIMENT = "dflash-lab"


def tracking_uri(workdir: Path) -> str:
    """MLFLOW_TRACKING_URI selects a server; otherwise a SQLite file in the work directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(workdir / 'mlflow.db').resolve()}"


def configure(workdir: Path, experiment: str = DEFAULT_EXPERIMENT) -> str:
    """Point MLflow at the store and experiment; returns the experiment id."""
    import mlflow

    workdir.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(tracking_uri(workdir))
    existing = mlflow.get_experiment_by_name(experiment)
    if existing is not None:
        return existing.experiment_id
    if os.environ.get("MLFLOW_TRACKING_URI"):  # a tracking server stores (or proxies) artifacts itself
        return mlflow.create_experiment(experiment)
    return mlflow.create_experiment(experiment, artifact_location=(workdir / "mlartifacts").resolve().as_uri())


def ui_command(workdir: Path) -> str:
    return f"mlflow ui --backend-store-uri {tracking_uri(workdir)}"


def prefixed(values: dict[str, float], prefix: str) -> dict[str, float]:
    return {f"{prefix}{name}": float(value) for name, value in values.items()}


def log_params(params: dict) -> None:
    """Log params in batches (MLflow caps one call at 100), stringifying values."""
    import mlflow

    items = sorted(params.items())
    for start in range(0, len(items), 100):
        mlflow.log_params({k: "None" if v is None else v for k, v in items[start : start + 100]})
