"""The study's Optuna storage and the attributes its trials carry: shared by the runner and torchrun jobs.

RDB storage (SQLite by default, PostgreSQL for many workers) with heartbeats: a killed worker's trial is
failed and re-queued with the same params, and the retry resumes the dead trial's run.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import optuna
import sqlalchemy

from algorithms.metrics import REALIZED_ACCEPTED_LENGTH
from harness.layout import OPTUNA_STORE
from harness.train import ValidationHook

ATTR_PARENT_RUN = "mlflow_parent_run_id"
ATTR_DEFINITION = "definition_yaml"
ATTR_RUN_ID = "mlflow_run_id"  # the trial's first seed's run
ATTR_SEED_VALUES = "seed_values"  # the objective values of each seed, in the study's seed order
ATTR_FAIL_REASON = "fail_reason"
ATTR_INFEASIBLE = "infeasible_reason"
ATTR_PRUNED = "pruned_reason"
ATTR_INTERRUPTED = "interrupted_trials"  # study attr: failed trials whose worker died (they use no budget)
ATTR_SERVED = "served_runs"  # study attr: runs already served by the study's engine
ATTR_EVALUATED = "evaluated_trials"  # study attr: trials whose draft was already evaluated by speculative decoding
ATTR_WORKER = "worker"
ATTR_ORIGIN = "origin_trial"  # the first trial number of a retried config: its run name, so the run resumes
ATTR_DESIGN_POINT = "design_point"  # an enqueued design point's index in the design's order


def storage_url(workdir: Path, storage: str | None) -> str:
    return storage or f"sqlite:///{(workdir / OPTUNA_STORE).resolve()}"


def missing_local_storage(workdir: Path, storage: str | None) -> bool:
    """True where the default SQLite storage has not been created yet: a command that only reads answers from
    that, instead of creating an empty store."""
    return storage is None and not (workdir / OPTUNA_STORE).exists()


def heartbeat_grace_s() -> int:
    return int(os.environ.get("DFLASH_LAB_HEARTBEAT_GRACE_S", "60"))


def make_storage(url: str) -> optuna.storages.RDBStorage:
    """RDB storage with heartbeats: a killed worker's trial is failed and re-queued with the same params.

    A trial counts as dead after DFLASH_LAB_HEARTBEAT_GRACE_S seconds (default 60) without a heartbeat.
    """
    grace = heartbeat_grace_s()
    # SQLite waits for a busy writer; a database server that does not answer fails within 10 s.
    connect = {"timeout": 60} if url.startswith("sqlite") else {"connect_timeout": 10}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # heartbeats are what we rely on
        try:
            storage = optuna.storages.RDBStorage(
                url,
                heartbeat_interval=max(1, grace // 3),
                grace_period=grace,
                heartbeat_stale_trial_callback=requeue_interrupted,
                engine_kwargs={"connect_args": connect},
            )
        except sqlalchemy.exc.OperationalError as error:
            reason = str(error.orig).strip().splitlines()[0] if error.orig else str(error)
            raise ConnectionError(
                f"invalid --storage={url!r}: {reason}; allowed a reachable database (sqlite or postgresql URL)"
            ) from None
    if url.startswith("sqlite"):
        _lock_sqlite_transactions(storage.engine)
    return storage


def _lock_sqlite_transactions(engine: sqlalchemy.Engine) -> None:
    """Make each SQLite transaction take the write lock when it begins.

    Optuna's state changes read a row and then write it (WAITING -> RUNNING succeeds only from WAITING), which is
    atomic only inside one locked transaction. SQLite ignores SELECT ... FOR UPDATE, and pysqlite opens a
    transaction only at its first write, so two processes could both read WAITING and both take one trial (or one
    claim). `BEGIN IMMEDIATE` serialises them; Optuna's sessions last one storage call, so the lock is brief.
    """

    @sqlalchemy.event.listens_for(engine, "connect")
    def _no_implicit_transactions(dbapi_connection, _record) -> None:  # noqa: ANN001 (a DB-API connection)
        dbapi_connection.isolation_level = None  # SQLAlchemy's begin below opens every transaction itself

    @sqlalchemy.event.listens_for(engine, "begin")
    def _begin_immediate(connection: sqlalchemy.Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # connections pooled while Optuna set the schema up predate the listeners


def requeue_interrupted(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
    """Record a dead worker's (already failed) trial as interrupted and re-queue its params.

    The retry resumes the dead trial's run.
    """
    study.set_user_attr(ATTR_INTERRUPTED, sorted({*study.user_attrs.get(ATTR_INTERRUPTED, []), trial.number}))
    study.add_trial(
        optuna.create_trial(
            state=optuna.trial.TrialState.WAITING,
            params=trial.params,
            distributions=trial.distributions,
            user_attrs={
                ATTR_ORIGIN: trial.user_attrs.get(ATTR_ORIGIN, trial.number),
                **{k: trial.user_attrs[k] for k in (ATTR_DESIGN_POINT,) if k in trial.user_attrs},
            },
            system_attrs=dict(trial.system_attrs),  # keeps a grid sampler's cell id, so the cell is not counted twice
        )
    )


def pruning_hook(trial: optuna.Trial, pruner: str, prunes: bool) -> ValidationHook:
    """Report each validation to Optuna; a returned reason stops the run as pruned (`prunes`: the study has
    one objective; Optuna cannot prune multi-objective trials)."""

    def on_validation(step: int, metrics: dict[str, float]) -> str | None:
        realized = metrics[REALIZED_ACCEPTED_LENGTH]
        trial.report(realized, step)
        if prunes and trial.should_prune():
            return f"at step {step} by the {pruner} rule (realized {realized:.3f})"
        return None

    return on_validation
