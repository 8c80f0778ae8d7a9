"""Tracking names and the store: artifacts stay under the work directory for every local store."""

import mlflow
import pytest

from harness import tracking
from harness.tracking import RunStatus


@pytest.mark.parametrize("uri_kind", ["default", "explicit-sqlite"])
def test_artifacts_live_under_the_workdir_for_local_stores(tmp_path, monkeypatch, uri_kind):
    workdir = tmp_path / "work"
    if uri_kind == "explicit-sqlite":
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'elsewhere.db'}")
    else:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    experiment_id = tracking.configure(workdir, "artifacts-check")
    assert tracking.configure(workdir, "artifacts-check") == experiment_id  # a second launch reuses it
    location = tracking.client(workdir).get_experiment(experiment_id).artifact_location
    assert location == (workdir / "mlartifacts").resolve().as_uri()
    mlflow.set_tracking_uri("")  # leave no global store behind for other tests


def test_two_work_directories_in_one_process_keep_their_own_stores(tmp_path, monkeypatch):
    """MLflow exports the URI it is given to the environment; read back, it would send the second work
    directory's runs (and any child process's) into the first one's store."""
    import os

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for name in ("first", "second"):
        tracking.configure(tmp_path / name, "stores-check")
        assert "MLFLOW_TRACKING_URI" not in os.environ
        assert tracking.tracking_uri(tmp_path / name).endswith(f"{name}/mlflow.db")
    assert (tmp_path / "first" / "mlflow.db").exists() and (tmp_path / "second" / "mlflow.db").exists()
    mlflow.set_tracking_uri("")


def test_status_round_trips_through_tags_and_maps_to_mlflow_statuses():
    for status in RunStatus:
        assert RunStatus.of({tracking.TAG_STATUS: status.value}, "KILLED") is status
    assert RunStatus.PRUNED.mlflow_status == RunStatus.INFEASIBLE.mlflow_status == "KILLED"
    assert RunStatus.of({}, "FINISHED") is RunStatus.FINISHED and RunStatus.of({}, "RUNNING") is RunStatus.RUNNING


def test_a_resumed_run_that_finishes_drops_its_old_failure_reason(tmp_path, monkeypatch):
    from harness.run import Run

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = Run(tmp_path, "flaky", experiment="status-check")
    run.start({tracking.TAG_ROLE: tracking.ROLE_RUN})
    run.end(RunStatus.FAILED, "RuntimeError: out of memory")
    resumed = Run(tmp_path, "flaky", experiment="status-check", run_id=run.recorded_run_id())
    with resumed.active({}):
        pass
    stored = tracking.client(tmp_path).get_run(run.run_id)
    assert resumed.run_id == run.run_id and stored.info.status == "FINISHED"
    assert stored.data.tags[tracking.TAG_STATUS] == "finished" and tracking.TAG_STATUS_REASON not in stored.data.tags
    mlflow.set_tracking_uri("")


def test_a_pruned_run_reads_as_pruned_in_the_runs_table(tmp_path, monkeypatch):
    """KILLED is all MLflow's status says; the state tag and the description say pruned, and why."""
    from types import SimpleNamespace

    from harness.run import Run
    from studies.storage import pruning_hook

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    trial = SimpleNamespace(report=lambda value, step: None, should_prune=lambda: True)
    reason = pruning_hook(trial, "median", prunes=True)(40, {"realized_accepted_length": 1.12})
    assert reason == "at step 40 by the median rule (realized 1.120)"
    run = Run(tmp_path, "pruned-one", experiment="pruned-check")
    run.start({tracking.TAG_ROLE: tracking.ROLE_TRIAL})
    run.end(RunStatus.PRUNED, reason)
    stored = tracking.client(tmp_path).get_run(run.run_id)
    assert stored.info.status == "KILLED" and stored.data.tags[tracking.TAG_STATUS] == "pruned"
    assert stored.data.tags[tracking.TAG_NOTE] == "PRUNED at step 40 by the median rule (realized 1.120)"
    mlflow.set_tracking_uri("")


def test_metric_keys_put_accepted_lengths_first_and_never_embed_k():
    assert tracking.metric_key("realized_accepted_length", tracking.VAL_PREFIX) == "accept/realized"
    assert tracking.metric_key("oracle_accepted_length_se", tracking.VAL_PREFIX) == "se/accept/oracle"
    assert tracking.metric_key("realized_accepted_length_se", tracking.CURVE_PREFIX) == "se/curve/realized"
    assert tracking.metric_key("unary_candidate_recall_se", tracking.VAL_PREFIX) == "se/val/unary_candidate_recall"
    assert tracking.metric_key("unary_candidate_recall", tracking.VAL_PREFIX) == "val/unary_candidate_recall"
    assert tracking.metric_key("realized_accepted_length", tracking.TRAIN_PREFIX) == "train/realized_accepted_length"
    assert sorted(["val/loss", "train/loss", "best/x", "accept/unary", "eval/y", "system/cpu"])[0] == "accept/unary"


def test_a_copied_work_directory_keeps_every_artifact_under_itself(tmp_path, monkeypatch):
    """The SQLite store records absolute artifact locations; in a copy (or after a move) they would still
    name the original directory. The copy's store is rebased on first use, the original is left alone."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from harness.run import Run

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    original, copy = tmp_path / "original", tmp_path / "copy"
    run = Run(original, "moved", experiment="copy-check")
    with run.active({}):
        (original / "note.txt").write_text("first")
        run.log_file(original / "note.txt")
    shutil.copytree(original, copy)
    resume = f"""
from pathlib import Path
from harness.run import Run
copy = Path({str(copy)!r})
resumed = Run(copy, "moved", experiment="copy-check", run_id={run.run_id!r})
with resumed.active({{}}):
    (copy / "later.txt").write_text("second")
    resumed.log_file(copy / "later.txt")
"""
    subprocess.run([sys.executable, "-c", resume], check=True, cwd=Path(__file__).parent.parent, timeout=300)
    stored = tracking.client(copy).get_run(run.run_id)
    assert stored.info.artifact_uri.startswith((copy / "mlartifacts").resolve().as_uri() + "/")
    assert sorted(p.name for p in (copy / "mlartifacts").rglob("*.txt")) == ["later.txt", "note.txt"]
    assert [p.name for p in (original / "mlartifacts").rglob("*.txt")] == ["note.txt"]
    original_run = tracking.client(original).get_run(run.run_id)
    assert original_run.info.artifact_uri.startswith((original / "mlartifacts").resolve().as_uri() + "/")
    mlflow.set_tracking_uri("")


def test_a_target_inside_the_work_directory_is_recorded_relative_to_it(tmp_path):
    """Params are immutable: an absolute path into the work directory would refuse a resume in a copy."""
    from harness.targets import Target

    def target(source):
        return Target("smollm2-135m", str(source), "hash", None, None, None, 0, "reason")

    for workdir in (tmp_path / "a", tmp_path / "b"):
        identity = target((workdir / "targets" / "smollm2-135m").resolve()).identity(workdir)
        assert identity["target_source"] == "targets/smollm2-135m"
    assert target("/models/qwen3").identity(tmp_path / "a")["target_source"] == "/models/qwen3"
    assert target("Qwen/Qwen3-8B").identity(tmp_path / "a")["target_source"] == "Qwen/Qwen3-8B"


def test_tracking_server_waits_are_bounded_by_default_and_the_user_may_change_them(monkeypatch, tmp_path):
    import os

    for name in tracking.SERVER_WAITS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "7")
    tracking.bound_server_waits("http://127.0.0.1:1")
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "5" and os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "7"


def test_processes_starting_together_on_a_fresh_work_directory_create_one_store(tmp_path):
    """MLflow's migrations run when a SQLite store is first opened; four processes opening a fresh work
    directory's store at the same moment all succeed (the creation is serialised) and share one experiment."""
    import subprocess
    import sys
    from pathlib import Path

    workdir = tmp_path / "fresh"
    code = f"from pathlib import Path; from harness import tracking; print(tracking.configure(Path({str(workdir)!r})))"
    env = {k: v for k, v in __import__("os").environ.items() if k != "MLFLOW_TRACKING_URI"}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=Path(__file__).parent.parent,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outcomes = [process.communicate(timeout=300) for process in processes]
    assert [process.returncode for process in processes] == [0, 0, 0, 0], [err[-2000:] for _, err in outcomes]
    assert len({out.strip() for out, _ in outcomes}) == 1


def test_a_dataset_another_launcher_inserts_at_the_same_moment_is_linked_not_fatal(tmp_path, monkeypatch):
    """Replays the race two launches at once ran into: between MLflow's check for the experiment's datasets and
    its insert, another run logs the same dataset. The first try breaks a unique key; the retry links the row."""
    import uuid
    from types import SimpleNamespace

    from mlflow.entities import Dataset, DatasetInput
    from mlflow.store.tracking import sqlalchemy_store

    from harness.run import Run

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "data.jsonl").write_text("{}\n")
    rival = Run(tmp_path, "rival", experiment="race-check")
    rival.start({tracking.TAG_ROLE: tracking.ROLE_RUN})
    rival.end(RunStatus.FINISHED)
    run = Run(tmp_path, "first", experiment="race-check")
    rival_inserts = []

    def uuid_after_a_rival_insert():
        """The store draws a new dataset's id right after finding it missing: the moment the rival wins."""
        if not rival_inserts:
            rival_inserts.append(Dataset("chat/train", "d1g35t", "local", "rival"))
            tracking.client(tmp_path).log_inputs(rival.run_id, [DatasetInput(rival_inserts[0])])
        return uuid.uuid4()

    with run.active({tracking.TAG_ROLE: tracking.ROLE_RUN}):
        monkeypatch.setattr(sqlalchemy_store, "uuid", SimpleNamespace(uuid4=uuid_after_a_rival_insert))
        run.log_datasets("chat", "d1g35t", tmp_path / "data.jsonl", ("train",))
        monkeypatch.setattr(sqlalchemy_store, "uuid", uuid)
    client = tracking.client(tmp_path)
    linked = [i.dataset for i in client.get_run(run.run_id).inputs.dataset_inputs]
    rivals = [i.dataset for i in client.get_run(rival.run_id).inputs.dataset_inputs]
    assert len(rival_inserts) == len(linked) == len(rivals) == 1
    assert linked[0].name == rivals[0].name == "chat/train" and linked[0].source == "rival"  # the rival's row
    mlflow.set_tracking_uri("")
