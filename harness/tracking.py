"""Every MLflow name dflash-lab writes: tags, roles, statuses, param and metric prefixes, and the store.

Metric names themselves come from `algorithms.metrics`; this module owns how they are prefixed.
Reports read these names from here, so renaming one is a one-line change.
"""

from __future__ import annotations

import getpass
import logging
import os
import sys
from enum import StrEnum
from pathlib import Path

import mlflow

from algorithms.metrics import ACCEPTED_LENGTHS, DRAFT_STEP_MS, REALIZED_ACCEPTED_LENGTH, SE_SUFFIX
from harness.files import file_lock
from harness.layout import ARTIFACTS, MLFLOW_STORE
from harness.serving import metrics as served_names

log = logging.getLogger(__name__)

# Metric prefixes. The validation accepted lengths get their own, `accept/`, which sorts first among
# metrics and forms its own chart section in the MLflow UI: accept/unary, accept/realized, accept/oracle.
TRAIN_PREFIX, VAL_PREFIX, EVAL_PREFIX, ACCEPT_PREFIX = "train/", "val/", "eval/", "accept/"
# The learning curve: accepted lengths on the fixed subset of anchors at every validation, the last included
# (accept/* at the last step is every anchor instead): curve/unary, curve/realized, curve/oracle (+ _se).
CURVE_PREFIX = "curve/"
# Standard errors get a chart section of their own, se/<name as logged>: logged once at the last step, they would
# otherwise sit as single points between the curves of the accept/, curve/ and val/ sections.
SE_PREFIX = "se/"
BEST_PREFIX, IMPORTANCE_PREFIX = "best/", "importance/"
# A study's objectives and their directions, named as a trial run's columns are in reports (served ones: serving's).
OBJECTIVES = {
    REALIZED_ACCEPTED_LENGTH: "maximize",
    DRAFT_STEP_MS: "minimize",
    **dict.fromkeys(served_names.OBJECTIVES, "maximize"),
}
# Param prefixes of a study's parent run.
PINNED_PREFIX, STUDY_PREFIX = "pinned.", "study."

# Tags.
TAG_ALGORITHM, TAG_STUDY, TAG_TRIAL = "dflash_lab.algorithm", "dflash_lab.study", "dflash_lab.trial_number"
TAG_ROLE, TAG_RUN_DIR, TAG_CHECKPOINT = "dflash_lab.role", "dflash_lab.run_dir", "dflash_lab.checkpoint"
TAG_STATUS, TAG_STATUS_REASON = "dflash_lab.state", "dflash_lab.failure_reason"
TAG_BASELINE, TAG_BEST_TRIAL, TAG_OBJECTIVES = "dflash_lab.baseline", "dflash_lab.best_trial", "dflash_lab.objectives"
TAG_PARETO_FRONT = "dflash_lab.pareto_front"  # a multi-objective study's non-dominated trials: "trial 0, trial 3"
TAG_BEST_RUN_ID, TAG_TRIALS_USED = "dflash_lab.best_run_id", "dflash_lab.trials_used"
TAG_REGISTERED_MODEL = "dflash_lab.registered_model"  # the best run's export in the model registry: "NAME version N"
TAG_DESIGN_POINT = "dflash_lab.design_point"  # a designed study's trial: its point as JSON
TAG_WORLD_SIZE = "dflash_lab.world_size"  # data-parallel ranks of the latest (re)start
TAG_COMPUTES_IN = "dflash_lab.computes_in"  # bf16 or fp32: what train.precision chose at the latest (re)start
TRANSFER_TAG_PREFIX = "dflash_lab.transfer."  # a parent run's tag per effect and longer budget: its transfer label
# The serving engine that checked a run's acceptance (`evaluate --engine llama.cpp`): its commit and the GGUF
# converter's version.
TAG_ENGINE_COMMIT, TAG_GGUF_VERSION = "dflash_lab.served.llama_cpp_commit", "dflash_lab.served.gguf_version"
# How the latest serving of a run went (a RunStatus value: running, finished, interrupted, failed), and why it
# stopped: the served/* metrics land in one batch with `finished`, so a run never holds half a serving.
TAG_SERVED_STATUS, TAG_SERVED_REASON = "dflash_lab.served.state", "dflash_lab.served.reason"
# MLflow's own tags, behind the UI's Description, Source and Created-by columns and the experiment's page.
TAG_NOTE, TAG_SOURCE, TAG_USER = "mlflow.note.content", "mlflow.source.name", "mlflow.user"
TAG_EXPERIMENT_KIND, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"

# Roles (TAG_ROLE values).
ROLE_RUN, ROLE_TRIAL, ROLE_BASELINE, ROLE_STUDY = "run", "trial", "baseline", "study"
# A study's `budgets_by` (param study.budgets_by): every budget trains from step 0, or the shorter budgets' runs
# are warmup-stable-decay branches of the longest budget's run of the same point and seed
BUDGETS_FROM_SCRATCH, BUDGETS_AS_BRANCHES = "scratch", "branches"

EXPERIMENT_PREFIX = "dflash-lab/"  # never collides with MLflow's own `Default`
DEFAULT_EXPERIMENT = f"{EXPERIMENT_PREFIX}runs"  # single `train` runs
UI_ADDRESS = "http://127.0.0.1:5000"  # where `mlflow ui` serves a local store by default


def experiment_name(study: str) -> str:
    return f"{EXPERIMENT_PREFIX}{study}"


class RunStatus(StrEnum):
    """How a run ended. MLflow has fewer statuses, so the exact one is also a tag."""

    FINISHED = "finished"
    FAILED = "failed"
    PRUNED = "pruned"
    INFEASIBLE = "infeasible"
    INTERRUPTED = "interrupted"
    RUNNING = "running"  # not an end: a run still going, or one whose process died

    @property
    def mlflow_status(self) -> str:
        return {"finished": "FINISHED", "failed": "FAILED", "running": "RUNNING"}.get(self.value, "KILLED")

    @classmethod
    def of(cls, tags: dict[str, str], mlflow_status: str) -> RunStatus:
        """The status a run recorded; a run that never recorded one is read from MLflow's."""
        if TAG_STATUS in tags:
            return cls(tags[TAG_STATUS])
        return {"FINISHED": cls.FINISHED, "FAILED": cls.FAILED, "KILLED": cls.INTERRUPTED}.get(
            mlflow_status, cls.RUNNING
        )


def mark_status(client: mlflow.MlflowClient, run_id: str, status: RunStatus, reason: str | None = None) -> None:
    """A run's status tag and MLflow's own status together: the UI shows a stopped run as stopped, and a
    reopened one as running again."""
    client.set_tag(run_id, TAG_STATUS, status.value)
    if reason is not None:
        client.set_tag(run_id, TAG_STATUS_REASON, reason)
    if status is RunStatus.RUNNING:
        client.update_run(run_id, status=status.mlflow_status)
    else:
        client.set_terminated(run_id, status=status.mlflow_status)


def tracking_uri(workdir: Path) -> str:
    """MLFLOW_TRACKING_URI selects a server; otherwise a SQLite file in the work directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(workdir / MLFLOW_STORE).resolve()}"


def local_store(workdir: Path) -> Path | None:
    """The work directory's SQLite store file, where no tracking server is configured."""
    return None if is_server(tracking_uri(workdir)) else workdir / MLFLOW_STORE


# How long a call waits for a tracking server that stopped answering (each may be set in the environment):
# 5 retries with backoff 2, 4, 8, 16, 32 s (about a minute) and 30 s per request, then the command stops.
SERVER_WAITS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "5",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "2",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}


class TrackingServerLost(ConnectionError):
    """The tracking server stopped answering mid-command; the run's local state says what it did not get."""


def server_lost(error: BaseException) -> bool:
    """Whether `error` (or one it was raised from) is a tracking server that does not answer."""
    import requests

    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (requests.exceptions.ConnectionError, requests.exceptions.Timeout)):
            return True
        error = error.__cause__ or error.__context__
    return False


def bound_server_waits(uri: str) -> None:
    if is_server(uri):
        for name, value in SERVER_WAITS.items():
            os.environ.setdefault(name, value)


STORE_LOCK = f".{MLFLOW_STORE}.lock"  # serialises the creation (and migration) of the work directory's SQLite store
_ready_stores: set[str] = set()


def ensure_store(workdir: Path) -> None:
    """Create (or migrate) the work directory's own SQLite store once, under a lock: two processes starting
    on a fresh work directory would otherwise run MLflow's migrations at the same moment, and one would fail."""
    uri = tracking_uri(workdir)
    if "MLFLOW_TRACKING_URI" in os.environ or uri in _ready_stores:
        return
    with file_lock(workdir / STORE_LOCK, "creating the MLflow store"):
        mlflow.MlflowClient(uri).search_experiments(max_results=1)
    _ready_stores.add(uri)


def wall_seconds(info) -> float | None:
    """An MLflow run's wall time (its RunInfo's): first start to last end, a resumed run's pause included; None
    while it has not ended."""
    return (info.end_time - info.start_time) / 1000 if info.end_time else None


def client(workdir: Path) -> mlflow.MlflowClient:
    bound_server_waits(tracking_uri(workdir))
    ensure_store(workdir)
    return mlflow.MlflowClient(tracking_uri(workdir))


def configure(workdir: Path, experiment: str = DEFAULT_EXPERIMENT) -> str:
    """Point MLflow at the store and experiment; returns the experiment id."""
    workdir.mkdir(parents=True, exist_ok=True)
    chosen = os.environ.get("MLFLOW_TRACKING_URI")
    bound_server_waits(tracking_uri(workdir))
    ensure_store(workdir)
    mlflow.set_tracking_uri(tracking_uri(workdir))
    # MLflow also exports the URI to the environment, where it would read as the user's choice of server: a
    # later work directory in this process (or a child process) would then write into this one's store.
    if chosen is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    if chosen is None:
        rebase_local_store(workdir)
    existing = mlflow.get_experiment_by_name(experiment)
    if existing is not None:
        return existing.experiment_id
    # A server stores (or proxies) artifacts itself; every local store keeps them under the work directory.
    local = not is_server(tracking_uri(workdir))
    location = (workdir / ARTIFACTS).resolve().as_uri() if local else None
    try:
        return mlflow.create_experiment(
            experiment, artifact_location=location, tags={TAG_EXPERIMENT_KIND: EXPERIMENT_KIND}
        )
    except mlflow.exceptions.MlflowException:  # another launch created it a moment ago
        existing = mlflow.get_experiment_by_name(experiment)
        if existing is None:
            raise
        return existing.experiment_id


def rebase_local_store(workdir: Path) -> None:
    """A copied or moved work directory's SQLite store still names the old directory's artifact root, where
    new artifacts would land: point its experiments and runs at this directory's `mlartifacts` instead."""
    import sqlite3

    database, root = workdir / MLFLOW_STORE, (workdir / ARTIFACTS).resolve().as_uri()
    if not database.exists():
        return
    with sqlite3.connect(database, timeout=60) as connection:
        try:
            locations = [row[0] for row in connection.execute("SELECT DISTINCT artifact_location FROM experiments")]
        except sqlite3.OperationalError:  # a store MLflow has not created its tables in yet
            return
        for old in {loc for loc in locations if loc and loc.endswith("/mlartifacts") and loc != root}:
            connection.execute("UPDATE experiments SET artifact_location = ? WHERE artifact_location = ?", (root, old))
            connection.execute(
                "UPDATE runs SET artifact_uri = ? || substr(artifact_uri, ?) WHERE artifact_uri LIKE ? || '/%'",
                (root, len(old) + 1, old),
            )
            log.info("work directory copied or moved: artifacts recorded under %s now resolve under %s", old, root)


def is_server(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def check_reachable(workdir: Path, timeout_s: float = 5.0) -> None:
    """Fail fast, before any work, when the tracking server does not answer."""
    import urllib.error
    import urllib.request

    uri = tracking_uri(workdir)
    if not is_server(uri):
        return
    try:
        urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s).close()
    except (urllib.error.URLError, OSError) as error:
        raise ConnectionError(
            f"invalid MLFLOW_TRACKING_URI={uri!r}: no MLflow server answered within {timeout_s:.0f} s ({error}); "
            "allowed a running tracking server, or unset it to use the work directory's SQLite store"
        ) from None


def ui_command(workdir: Path) -> str:
    return f"mlflow ui --backend-store-uri {tracking_uri(workdir)}"


def runs_link(workdir: Path, experiment_id: str) -> str:
    """The experiment's runs table (not MLflow's GenAI overview), on the server or a local `mlflow ui`."""
    uri = tracking_uri(workdir)
    base = uri.rstrip("/") if is_server(uri) else UI_ADDRESS
    return f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"


def run_link(workdir: Path, run_id: str) -> str:
    """One run's page, on the server or a local `mlflow ui`."""
    experiment_id = client(workdir).get_run(run_id).info.experiment_id
    return runs_link(workdir, experiment_id).replace("/runs?", f"/runs/{run_id}?")


def ui_hint(workdir: Path, experiment: str) -> str:
    """What a command prints after logging: how to start the UI (local stores) and the link to open."""
    experiment_id = configure(workdir, experiment)
    start = "" if is_server(tracking_uri(workdir)) else f"{ui_command(workdir)}, then open "
    return f"MLflow UI ({experiment}): {start}{runs_link(workdir, experiment_id)}"


def transfer_tag(key: str) -> str:
    """`240/conv_kernel_size` -> `dflash_lab.transfer.240.conv_kernel_size`; MLflow's tag names allow no `×`."""
    steps, _, term = key.partition("/")
    return f"{TRANSFER_TAG_PREFIX}{steps}.{term.replace('×', '_x_')}"


def metric_key(name: str, prefix: str) -> str:
    """The logged name: `accept/<path>` for validation accepted lengths, else prefix+name; a standard error is
    `se/` + its metric's logged name (`se/accept/realized`, `se/val/unary_candidate_recall`)."""
    if name.endswith(SE_SUFFIX):
        return SE_PREFIX + metric_key(name.removesuffix(SE_SUFFIX), prefix)
    if prefix in (VAL_PREFIX, CURVE_PREFIX) and name in ACCEPTED_LENGTHS:
        short = ACCEPT_PREFIX if prefix == VAL_PREFIX else CURVE_PREFIX
        return f"{short}{name.removesuffix('_accepted_length')}"
    return f"{prefix}{name}"


def prefixed(values: dict[str, float], prefix: str) -> dict[str, float]:
    return {metric_key(name, prefix): float(value) for name, value in values.items()}


def under_prefix(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    """The logged metrics under `prefix`, named without it (their standard errors, under se/, left out)."""
    return {name.removeprefix(prefix): value for name, value in metrics.items() if name.startswith(prefix)}


# The versions a run's numbers depend on, one tag per library: dflash_lab.version.<distribution>
VERSION_TAG_PREFIX = "dflash_lab.version."
VERSIONED = ("dflash-lab", "torch", "transformers", "mlflow", "optuna", "safetensors")


def library_versions() -> dict[str, str]:
    """`dflash_lab.version.<name>` tags for the installed distributions the harness runs on."""
    from importlib.metadata import PackageNotFoundError, version

    tags = {}
    for name in VERSIONED:
        try:
            tags[f"{VERSION_TAG_PREFIX}{name}"] = version(name)
        except PackageNotFoundError:
            tags[f"{VERSION_TAG_PREFIX}{name}"] = "not installed"
    return tags


def who_and_where() -> dict[str, str]:
    """The Created-by and Source columns for runs created through the client (start_run fills them itself)."""
    # The UI shows a source's last path segment, so paths in the command line keep only their file name.
    words = [Path(word).name if "/" in word else word for word in sys.argv[1:]]
    return {TAG_USER: getpass.getuser(), TAG_SOURCE: " ".join(["dflash-lab", *words])}


def stringified(params: dict) -> dict[str, object]:
    """MLflow params as logged: None spelled out."""
    return {k: "None" if v is None else v for k, v in params.items()}


class ChangedMetrics:
    """Logs a run's metric only when it differs from the value the run holds: a relaunch or a rebuilt report
    adds no duplicate rows."""

    def __init__(self, client: mlflow.MlflowClient, run_id: str) -> None:
        self.client, self.run_id = client, run_id
        self.current = dict(client.get_run(run_id).data.metrics)

    def log(self, key: str, value: float) -> None:
        if self.current.get(key) != float(value):
            self.client.log_metric(self.run_id, key, float(value))
            self.current[key] = float(value)
