"""One run's owner: its directory and file names, atomic checkpoints, its MLflow run and how it ended.

Training, the study runner, the CLI and evaluation all reach a run through `Run`; none of them spells
a file name, an MLflow status or a status tag of its own.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pickle
import re
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import mlflow
import torch
from mlflow.entities import Metric, RunTag

from harness import tracking
from harness.files import atomic_write
from harness.preemption import LAUNCHED_RUN_ENV, Preempted, deferring_preemption
from harness.tracking import RunStatus

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"
STABLE_CHECKPOINT_FILE = "stable-step{step}.pt"  # a WSD run's stable-stretch checkpoint, where a branch starts
RUN_FILE = "run.json"  # the MLflow run id, written when the run starts (before any checkpoint)
LOCK_FILE = ".lock"  # held (flock) by the one process training the run
CONFIG_FILE = "config.json"
PER_POSITION_FILE = "per_position.csv"
PER_POSITION_FIGURE = "per_position.png"
VALIDATION_DOCUMENTS_FILE = "validation_documents.csv"  # per-document (sum, total) pairs of the final validation
EVAL_RECORDS_FILE = "eval_records.json"
SERVED_DIR = "served"  # GGUF files and server logs of `evaluate --engine` (the target's once per work directory)
SERVED_RECORDS_FILE = "served_records.json"
DRAFT_GGUF_FILE = "draft-f32.gguf"  # in a run's SERVED_DIR: its draft as served, also an MLflow artifact
SERVING_LOCK_FILE = ".serving.lock"  # in a run's SERVED_DIR: held (flock) by the one process serving the run
SERVERS_DIR = "servers"  # in the work directory's SERVED_DIR: one record per running llama-server
EXPORT_DIR = "export"
BATCH_METRICS = 1000  # MLflow's limit on the metrics of one log_batch
# Checkpoints up to this size are also copied into MLflow's artifact store; larger ones are only tagged.
ARTIFACT_CHECKPOINT_LIMIT = 64 * 2**20


class RunInUse(OSError):
    """Another process is training this run right now."""


class CheckpointNotSaved(OSError):
    """Writing a checkpoint failed (a full disk, most often); the run stops and is recorded failed."""


def ended_description(status: RunStatus, reason: str) -> str:
    """`PRUNED at step 40 by the median rule (realized 1.120)`, `FAILED: ...`: readable where MLflow says KILLED."""
    return f"{status.value.upper()}{'' if reason.startswith('at step') else ':'} {reason}"


def ending_tags(status: RunStatus, reason: str) -> dict[str, str]:
    """The tags of a run that ended with a reason: its status, the reason, and the description saying both."""
    return {
        tracking.TAG_STATUS: status.value,
        tracking.TAG_STATUS_REASON: reason,
        tracking.TAG_NOTE: ended_description(status, reason),
    }


def runs_root(workdir: Path) -> Path:
    return workdir / "runs"


def server_records(workdir: Path) -> Path:
    """Where the work directory's running llama-servers are recorded, so a later start stops one left behind."""
    return workdir / SERVED_DIR / SERVERS_DIR


# A run's name is its directory under <workdir>/runs: one path segment, so nothing lands outside the workdir.
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,199}")
RUN_NAME_RULE = "1-200 letters, digits, '.', '_', '+' or '-', starting with a letter or digit (no '/')"


def check_run_name(name: str, what: str = "run name") -> str:
    """`name` when it is one safe path segment; otherwise a one-line error naming `what`."""
    if not RUN_NAME.fullmatch(name):
        raise ValueError(f"invalid {what}={name[:80]!r}{'...' if len(name) > 80 else ''}: allowed {RUN_NAME_RULE}")
    return name


@dataclass
class Run:
    """A named run in a work directory: `<workdir>/runs/<name>` plus one MLflow run."""

    workdir: Path
    name: str
    experiment: str = tracking.DEFAULT_EXPERIMENT
    run_id: str | None = None
    system_metrics: bool = False  # CPU/GPU/memory series under system/*: opt-in, they crowd the UI's charts

    def __post_init__(self) -> None:
        check_run_name(self.name)
        self._lock: IO | None = None

    def hold(self) -> bool:
        """Take the run for this process: an exclusive lock on its directory, which the OS releases if the
        process dies. False when another process holds it."""
        self.directory.mkdir(parents=True, exist_ok=True)
        handle = open(self.path(LOCK_FILE), "a")  # noqa: SIM115 (held past this call, closed in release)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return False
        self._lock = handle
        return True

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the descriptor drops the lock
            self._lock = None

    @classmethod
    def locate(cls, run: Path | str, workdir: Path) -> Run:
        """A run given as its directory or its name under the work directory's runs."""
        path = Path(run)
        if path.is_dir() and (path / CHECKPOINT_FILE).exists():
            return cls(path.parent.parent, path.name)
        return cls(workdir, str(run))

    @property
    def directory(self) -> Path:
        return runs_root(self.workdir) / self.name

    def path(self, file_name: str) -> Path:
        return self.directory / file_name

    # ---- checkpoint -----------------------------------------------------------------------------

    @property
    def checkpoint_path(self) -> Path:
        return self.path(CHECKPOINT_FILE)

    def has_checkpoint(self) -> bool:
        return self.checkpoint_path.exists()

    def stable_checkpoint_path(self, step: int) -> Path:
        return self.path(STABLE_CHECKPOINT_FILE.format(step=step))

    def exists(self) -> bool:
        """Whether a run was started here (it may have been killed before its first checkpoint)."""
        return self.path(RUN_FILE).exists() or self.has_checkpoint()

    def recorded_run_id(self) -> str | None:
        path = self.path(RUN_FILE)
        return json.loads(path.read_text())["run_id"] if path.exists() else None

    def lost_checkpoint(self) -> bool:
        """The run logged metrics (which reach MLflow only with a checkpoint) but its checkpoint is gone."""
        run_id = self.recorded_run_id()
        if self.has_checkpoint() or run_id is None:
            return False
        return bool(tracking.client(self.workdir).get_run(run_id).data.metrics)

    def save_checkpoint(self, state: dict, path: Path | None = None) -> None:
        """Atomic: a kill mid-write, or a full disk, leaves the previous checkpoint intact."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = path or self.checkpoint_path
        try:
            atomic_write(path, lambda tmp: torch.save(state, tmp))
        except (OSError, RuntimeError) as error:  # torch's zip writer reports a full disk as a RuntimeError
            kept = "the previous checkpoint is kept" if self.has_checkpoint() else "no earlier checkpoint exists"
            raise CheckpointNotSaved(
                f"checkpoint {path} could not be written ({type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else 'no detail'}); {kept}: free disk space, then "
                "`train ... --resume` continues the run"
            ) from None

    def load_checkpoint(self, path: Path | None = None) -> dict:
        path = path or self.checkpoint_path
        if not path.exists():
            raise FileNotFoundError(
                f"no checkpoint at {path}; pass a run directory or a run name under {runs_root(self.workdir)}"
            )
        try:
            state = torch.load(path, weights_only=False)
        except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as error:
            raise ValueError(
                f"checkpoint {path} is unreadable ({type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else 'empty'}); restore it from the MLflow run's "
                f"checkpoint artifact, or remove {self.directory} and train under a new --run-name"
            ) from None
        self.run_id = self.run_id or state.get("run_id")
        return state

    # ---- MLflow lifecycle -----------------------------------------------------------------------

    @deferring_preemption
    def start(self, tags: dict[str, str], parent_run_id: str | None = None) -> str:
        """Start the MLflow run, or resume it when `run_id` is set (a resumed run keeps its tags)."""
        experiment_id = tracking.configure(self.workdir, self.experiment)
        if self.run_id is not None:
            active = mlflow.start_run(run_id=self.run_id, log_system_metrics=self.system_metrics)
        else:
            active = mlflow.start_run(
                experiment_id=experiment_id,
                run_name=self.name,
                tags={tracking.TAG_RUN_DIR: str(self.directory.resolve()), **tracking.who_and_where(), **tags},
                parent_run_id=parent_run_id,
                nested=parent_run_id is not None,
                log_system_metrics=self.system_metrics,
            )
        self.run_id = active.info.run_id
        # the libraries of this start (a run resumed after an upgrade says so)
        mlflow.set_tags({tracking.TAG_STATUS: RunStatus.RUNNING.value, **tracking.library_versions()})
        self.directory.mkdir(parents=True, exist_ok=True)
        record = json.dumps({"run_id": self.run_id, "name": self.name, "experiment": self.experiment})
        atomic_write(self.path(RUN_FILE), lambda tmp: tmp.write_text(record))
        if launcher_file := os.environ.get(LAUNCHED_RUN_ENV):
            launched = json.dumps({"directory": str(self.directory.resolve())})
            atomic_write(Path(launcher_file), lambda tmp: tmp.write_text(launched))
        return self.run_id

    @classmethod
    def at(cls, directory: Path) -> Run:
        """The run whose directory is `directory` (`<workdir>/runs/<name>`), with its recorded MLflow run."""
        record = json.loads((directory / RUN_FILE).read_text())
        return cls(directory.parent.parent, record["name"], record["experiment"], record["run_id"])

    @deferring_preemption
    def record_ending(self, status: RunStatus, reason: str, *, unless_ended: bool = True) -> bool:
        """Record how the run ended from outside the process that trained it (its launcher); with `unless_ended`
        only if no process recorded an end (rank 0 was killed). Whether it recorded."""
        client = tracking.client(self.workdir)
        if unless_ended and client.get_run(self.run_id).info.status != RunStatus.RUNNING.mlflow_status:
            return False
        for key, value in ending_tags(status, reason).items():
            client.set_tag(self.run_id, key, value)
        client.set_terminated(self.run_id, status=status.mlflow_status)
        return True

    @contextmanager
    def active(self, tags: dict[str, str], parent_run_id: str | None = None) -> Iterator[Run]:
        """The MLflow run is open inside; an exception ends it failed (interrupted on Ctrl-C), with the reason."""
        self.start(tags, parent_run_id)
        try:
            yield self
        except KeyboardInterrupt as stop:
            reason = str(stop) if isinstance(stop, Preempted) else "KeyboardInterrupt: stopped by the user"
            self.end_or_note(RunStatus.INTERRUPTED, reason, stop)
            raise
        except BaseException as error:
            self.end_or_note(RunStatus.FAILED, f"{type(error).__name__}: {error}", error)
            raise
        else:
            if mlflow.active_run() is not None:
                self.end_or_note(RunStatus.FINISHED, None, None)

    def end_or_note(self, status: RunStatus, reason: str | None, error: BaseException | None) -> None:
        """End the run; when the tracking server no longer answers, write the ending into run.json instead
        (one bounded wait, not one per call) and stop in one line."""
        try:
            if error is None or not tracking.server_lost(error):
                self.end(status, reason)
                return
        except Exception as recording:
            if not tracking.server_lost(recording):
                raise
        self.note_unrecorded(status, reason)
        raise tracking.TrackingServerLost(
            f"the MLflow server at {tracking.tracking_uri(self.workdir)} stopped answering; {self.path(RUN_FILE)} "
            f"records what it could not: {status.value}{f' ({reason})' if reason else ''}; the metrics not sent "
            "are in the checkpoint, and `train ... --resume` sends them once the server answers"
        ) from None

    def note_unrecorded(self, status: RunStatus, reason: str | None) -> None:
        """The ending the store did not get, in the run's own file; the MLflow run is dropped from this
        process without another call to the server."""
        from mlflow.tracking import fluent

        record = json.loads(self.path(RUN_FILE).read_text())
        record["unrecorded"] = {"status": status.value, "reason": reason or ""}
        atomic_write(self.path(RUN_FILE), lambda tmp: tmp.write_text(json.dumps(record)))
        stack = fluent._active_run_stack.get()  # MLflow has no public way to forget a run without a call
        if stack:
            stack.pop()

    @deferring_preemption
    def end(self, status: RunStatus, reason: str | None = None) -> None:
        """Record how the run ended; a run that did not finish says so in its description too."""
        tags = ending_tags(status, reason) if reason else {tracking.TAG_STATUS: status.value}
        if (
            not reason and tracking.TAG_STATUS_REASON in mlflow.get_run(self.run_id).data.tags
        ):  # a resumed run's old failure
            mlflow.delete_tag(tracking.TAG_STATUS_REASON)
        mlflow.set_tags(tags)
        mlflow.end_run(status=status.mlflow_status)

    @deferring_preemption
    def log_params(self, params: dict) -> None:
        """In batches: MLflow caps one call at 100 params."""
        items = sorted(tracking.stringified(params).items())
        for start in range(0, len(items), 100):
            mlflow.log_params(dict(items[start : start + 100]))

    @deferring_preemption
    def log_metrics(self, values: dict[str, float], prefix: str, step: int) -> None:
        mlflow.log_metrics(tracking.prefixed(values, prefix), step=step)

    @deferring_preemption
    def log_file(self, path: Path) -> None:
        mlflow.log_artifact(str(path))

    @deferring_preemption
    def log_figure(self, figure, file_name: str) -> None:
        """Log a matplotlib figure, then release it."""
        import matplotlib.pyplot as plt

        mlflow.log_figure(figure, file_name)
        plt.close(figure)

    @deferring_preemption
    def tag_start(self, world_size: int, computes_in: str) -> None:
        """What the latest (re)start ran with: its data-parallel ranks and the dtype train.precision chose there.
        Tags, since a resume (perhaps on another machine) may change either."""
        mlflow.set_tags({tracking.TAG_WORLD_SIZE: str(world_size), tracking.TAG_COMPUTES_IN: computes_in})

    @deferring_preemption
    def describe(self, text: str) -> None:
        """The one line the runs table shows in its Description column."""
        mlflow.set_tag(tracking.TAG_NOTE, text)

    @deferring_preemption
    def log_datasets(self, name: str, digest: str, source: Path, contexts: tuple[str, ...]) -> None:
        """The data as MLflow datasets (the UI's Dataset column and filter), one input per context; the name
        carries the context because MLflow keeps one input per (name, digest)."""
        from mlflow.data.dataset_source_registry import resolve_dataset_source
        from mlflow.data.meta_dataset import MetaDataset

        with warnings.catch_warnings():  # a local path matches two equivalent registered source types
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
            dataset_source = resolve_dataset_source(str(source))
        for context in contexts:
            dataset = MetaDataset(dataset_source, name=f"{name}/{context}", digest=digest)
            try:
                mlflow.log_input(dataset, context=context)
            except mlflow.MlflowException:
                # MLflow reads which datasets the experiment has, then inserts the missing ones: a second launcher
                # inserting the same one in between breaks a unique key and rolls the call back. The retry finds
                # the row and only links it; a lasting error fails it again.
                log.info("logging dataset %s again after a concurrent insert", dataset.name)
                mlflow.log_input(dataset, context=context)

    @deferring_preemption
    def log_export(self, export_dir: Path) -> None:
        """The exported draft (Z Lab / speculators layout) as the run's `export/` artifacts, where the MLflow UI
        and `mlflow artifacts download` find the trained drafter."""
        mlflow.log_artifacts(str(export_dir), EXPORT_DIR)

    @deferring_preemption
    def log_checkpoint(self) -> None:
        """The checkpoint as an artifact when small, and its path as a tag always."""
        if self.checkpoint_path.stat().st_size < ARTIFACT_CHECKPOINT_LIMIT:
            mlflow.log_artifact(str(self.checkpoint_path))
        mlflow.set_tag(tracking.TAG_CHECKPOINT, str(self.checkpoint_path.resolve()))

    # ---- a run that is not active in this process -----------------------------------------------

    @deferring_preemption
    def log_into_finished(
        self, metrics: dict[str, float], prefix: str, files: list[Path], tags: dict[str, str] | None = None
    ) -> None:
        """Add files, then metrics and tags, to this run after it ended (e.g. a later evaluation). The metrics and
        tags go in one batch, written whole or not at all (a SIGTERM waits for it), so an interrupted evaluation
        that is run again never leaves a metric logged twice."""
        client = tracking.client(self.workdir)
        for path in files:  # an artifact written again replaces the first
            client.log_artifact(self.run_id, str(path))
        now = int(time.time() * 1000)
        rows = [Metric(name, value, now, 0) for name, value in tracking.prefixed(metrics, prefix).items()]
        # MLflow takes at most 1,000 metrics a batch: any before the last batch go first, the tags (a serving's
        # `finished`) with the last, so the tags never claim metrics that did not land
        batches = [rows[start : start + BATCH_METRICS] for start in range(0, len(rows), BATCH_METRICS)] or [[]]
        for batch in batches[:-1]:
            client.log_batch(self.run_id, metrics=batch)
        run_tags = [RunTag(key, value) for key, value in (tags or {}).items()]
        client.log_batch(self.run_id, metrics=batches[-1], tags=run_tags)

    def register_export(self, model_name: str) -> str:
        """The run's logged export (`export/`) as a version of MLflow's registered model `model_name`, created
        once: a run registered before (a relaunch) returns its version."""
        from mlflow.exceptions import MlflowException

        client = tracking.client(self.workdir)
        try:
            client.create_registered_model(model_name)
        except MlflowException as error:
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        for version in client.search_model_versions(f"name = '{model_name}'"):
            if version.run_id == self.run_id:
                return version.version
        source = f"runs:/{self.run_id}/{EXPORT_DIR}"
        return client.create_model_version(model_name, source, run_id=self.run_id).version

    def tags(self) -> dict[str, str]:
        """The run's MLflow tags as recorded now."""
        return tracking.client(self.workdir).get_run(self.run_id).data.tags

    def metrics(self, prefix: str) -> dict[str, float]:
        """The run's latest MLflow metrics under `prefix`, named without it."""
        return tracking.under_prefix(tracking.client(self.workdir).get_run(self.run_id).data.metrics, prefix)

    def record_without_training(
        self, tags: dict[str, str], params: dict, parent_run_id: str | None, status: RunStatus, reason: str
    ) -> str:
        """A run that ended before it could train (an infeasible trial): params, status and reason only."""
        client = tracking.client(self.workdir)
        experiment_id = tracking.configure(self.workdir, self.experiment)
        run_tags = {
            **tags,
            **ending_tags(status, reason),
            **tracking.who_and_where(),
            **({"mlflow.parentRunId": parent_run_id} if parent_run_id else {}),
        }
        run = client.create_run(experiment_id, run_name=self.name, tags=run_tags)
        for key, value in tracking.stringified(params).items():
            client.log_param(run.info.run_id, key, value)
        client.set_terminated(run.info.run_id, status=status.mlflow_status)
        self.run_id = run.info.run_id
        return self.run_id
