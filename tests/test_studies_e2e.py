"""Studies end to end on the embedded target: launch, MLflow structure, reports, resume and workers."""

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from unittest import mock

import mlflow
import optuna
import pandas as pd
import pytest
from scipy import stats

from harness import tracking
from harness.devices import computes_in
from reports.sections import GENERATED_PREFIX
from studies.storage import ATTR_INFEASIBLE, ATTR_RUN_ID, ATTR_WORKER, storage_url

from conftest import CLI, TINY_STUDY, launch_study, link_caches, mlflow_server, tiny_study_file

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def launched(e2e_workspace, e2e_workdir, tmp_path_factory):
    """The tiny study, launched once through the CLI from an empty directory (its report lands in the workdir)."""
    cwd = tmp_path_factory.mktemp("launch")
    done = launch_study(TINY_STUDY, e2e_workdir, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return done, cwd


def test_launch_records_trials_baselines_and_infeasible_cells(launched, e2e_workdir):
    done, _ = launched
    assert done.stderr.count("feature cache hit") == 1 and "extracting" not in done.stderr, (
        "the target runs at most once per study"
    )
    assert "[trial 2] {'conv_group_size': 16" in done.stdout
    assert "infeasible {'conv_group_size': 7" in done.stdout
    # The launch ends on its answer: the verdict lines, the report's path, the MLflow UI line, the regenerate
    # command; MLflow's per-artifact download bars no longer bury them.
    assert "Downloading artifacts" not in done.stderr + done.stdout
    lines = done.stdout.strip().splitlines()
    after = lines[lines.index("Verdicts of study tiny:") + 1 :]
    verdicts, rest = after[: after.index("")], after[after.index("") + 1 :]
    assert 1 <= len(verdicts) <= 6 and all(v.startswith("- ") for v in verdicts) and "[" in verdicts[0]
    assert [line.split()[0] for line in rest] == ["Report:", "MLflow", "Regenerate"]
    assert re.search(
        r"MLflow UI \(dflash-lab/tiny\): mlflow ui --backend-store-uri sqlite:///\S+, then open "
        r"http://127\.0\.0\.1:5000/#/experiments/\d+/runs\?workflowType=machine_learning",
        done.stdout,
    )
    study = optuna.load_study(study_name="tiny", storage=storage_url(e2e_workdir, None))
    states = [t.state for t in study.trials]
    assert states.count(optuna.trial.TrialState.COMPLETE) == 2 and states.count(optuna.trial.TrialState.PRUNED) == 2
    for trial in study.trials:
        if trial.params["conv_group_size"] == 7:
            assert "divisor of the hidden size 576" in trial.user_attrs[ATTR_INFEASIBLE]

    client = mlflow.MlflowClient(tracking.tracking_uri(e2e_workdir))
    experiment = client.get_experiment_by_name("dflash-lab/tiny")
    runs = client.search_runs([experiment.experiment_id])
    parent = [r for r in runs if r.data.tags.get(tracking.TAG_ROLE) == "study"]
    assert len(parent) == 1
    parent_id = parent[0].info.run_id
    assert "study.yaml" in {a.path for a in client.list_artifacts(parent_id)}
    assert "best/realized_accepted_length" in parent[0].data.metrics
    children = [r for r in runs if r.data.tags.get(tracking.TAG_ROLE) in ("trial", "baseline")]
    assert len(children) == 6 and all(r.data.tags.get("mlflow.parentRunId") == parent_id for r in children)
    assert {
        r.data.tags.get("dflash_lab.baseline") for r in children if r.data.tags[tracking.TAG_ROLE] == "baseline"
    } == {"dflash", "dflash2_defaults"}
    by_id = {r.info.run_id: r for r in children}
    for trial in study.trials:  # both directions of the link
        run = by_id[trial.user_attrs[ATTR_RUN_ID]]
        assert run.data.tags[tracking.TAG_TRIAL] == str(trial.number) and run.data.tags[tracking.TAG_STUDY] == "tiny"
        if trial.state == optuna.trial.TrialState.COMPLETE:
            for name in (
                "accept/unary",
                "accept/realized",
                "accept/oracle",
                "se/accept/unary",
                "se/accept/realized",
                "se/accept/oracle",
                "val/unary_candidate_recall",
                "se/val/unary_candidate_recall",
                "val/unary_candidate_target_mass",
                "val/num_anchors",
                "val/num_documents",
            ):
                assert name in run.data.metrics, name
            assert run.data.metrics["accept/realized"] == pytest.approx(trial.value)
            assert not [k for k in run.data.metrics if k.startswith("val/") and "accepted_length" in k]
            assert not [k for k in run.data.metrics if re.search(r"_at_\d+", k)], "K is a param, not in names"
            # the final validation used every anchor; the intermediate ones the fixed subset
            anchors = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val/num_anchors")}
            assert anchors[4] > anchors[2] == anchors[0]
            assert {"validation_documents.csv", "per_position.csv", "per_position.png"} <= {
                a.path for a in client.list_artifacts(run.info.run_id)
            }


def test_the_mlflow_ui_columns_read_well(launched, e2e_workdir, tmp_path):
    """What a user sees in the runs table: descriptions, states, datasets, no system metrics, and the parent's
    figure, table and tags; every artifact under the work directory."""
    client = mlflow.MlflowClient(tracking.tracking_uri(e2e_workdir))
    experiment = client.get_experiment_by_name("dflash-lab/tiny")
    assert experiment.tags[tracking.TAG_EXPERIMENT_KIND] == tracking.EXPERIMENT_KIND
    runs = client.search_runs([experiment.experiment_id])
    children = {r.info.run_id: r for r in runs if r.data.tags.get(tracking.TAG_ROLE) in ("trial", "baseline")}
    workdir_uri = (e2e_workdir / "mlartifacts").resolve().as_uri()
    for run in runs:
        tags = run.data.tags
        assert run.info.artifact_uri.startswith(workdir_uri)
        assert not [k for k in run.data.metrics if k.startswith("system/")], "system metrics are opt-in"
        assert tags.get(tracking.TAG_USER) and tags.get(tracking.TAG_SOURCE)
        if run.info.run_id not in children:
            continue
        note = tags[tracking.TAG_NOTE]
        if tags[tracking.TAG_STATUS] == "finished":
            interval = r"[\d.]+ \[[\d.]+, [\d.]+\]"
            assert re.fullmatch(rf"unary {interval} \| realized {interval} \| oracle {interval}", note), note
            datasets = {(d.dataset.name, d.tags[0].value, d.dataset.digest) for d in run.inputs.dataset_inputs}
            digest = run.data.params["dataset_hash"]
            assert datasets == {("chitchat/train", "train", digest), ("chitchat/validation", "validation", digest)}
        else:
            assert tags[tracking.TAG_STATUS] == "infeasible" and note.startswith("INFEASIBLE: invalid knob")
    # every run of the study validated on the same documents and anchor positions, DFlash and DFlash2 alike
    anchors = {}
    for run_id, run in children.items():
        if run.data.tags[tracking.TAG_STATUS] == "finished":
            path = client.download_artifacts(run_id, "validation_documents.csv", str(tmp_path / run_id))
            anchors[run.data.params["algorithm"], run_id] = pd.read_csv(path)[["document", "anchor_positions"]]
    assert {algorithm for algorithm, _ in anchors} == {"dflash", "dflash2"}
    first = next(iter(anchors.values()))
    assert all(frame.equals(first) for frame in anchors.values()) and len(first) == 8
    parent = next(r for r in runs if r.data.tags.get(tracking.TAG_ROLE) == "study")
    tags = parent.data.tags
    assert tags[tracking.TAG_BEST_RUN_ID] in children and tags[tracking.TAG_TRIALS_USED] == "4 of 4"
    assert tags[tracking.TAG_STATUS] == "finished" and tags[tracking.TAG_NOTE].startswith("best: ")
    assert parent.data.params["pinned.train.max_steps"] == "4", "the steps each run actually trained"
    assert {"report/accepted_lengths.png", "report/leaderboard.json"} <= {
        a.path for a in client.list_artifacts(parent.info.run_id, "report")
    }
    # evaluate.register: the best run's export is a version of the registered model, made once
    name, _, version = tags[tracking.TAG_REGISTERED_MODEL].partition(" version ")
    registered = client.get_model_version(name, version)
    assert name == "tiny-drafter" and registered.run_id == tags[tracking.TAG_BEST_RUN_ID]
    assert registered.source == f"runs:/{registered.run_id}/export"
    assert {"export/config.json", "export/model.safetensors"} <= {
        a.path for a in client.list_artifacts(registered.run_id, "export")
    }
    versions = client.search_model_versions("name = 'tiny-drafter'")
    assert [str(v.version) for v in versions if v.run_id == registered.run_id] == [version]


def test_report_numbers_equal_mlflow_and_regenerate_identically(launched, e2e_workdir):
    _, cwd = launched
    assert [p.name for p in cwd.iterdir()] == [], "nothing is written outside the workdir"
    report = e2e_workdir / "reports" / "tiny" / "README.md"
    markdown = report.read_text()
    client = mlflow.MlflowClient(tracking.tracking_uri(e2e_workdir))
    runs = client.search_runs([client.get_experiment_by_name("dflash-lab/tiny").experiment_id])
    leaderboard = markdown.split("## Leaderboard")[1].split("\n## ")[0]
    header = next(line for line in leaderboard.splitlines() if line.startswith("| run |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    rows = [line for line in leaderboard.splitlines() if line.startswith(("| baseline", "| trial"))]
    assert len(rows) == 4
    evaluated = 0
    for run in runs:
        if run.info.status != "FINISHED" or run.data.tags.get(tracking.TAG_ROLE) not in ("trial", "baseline"):
            continue
        role = run.data.tags[tracking.TAG_ROLE]
        marker = (
            f"| baseline {run.data.tags['dflash_lab.baseline']} |"
            if role == "baseline"
            else f"| trial {run.data.tags[tracking.TAG_TRIAL]} |"
        )
        row = next(r for r in rows if r.startswith(marker))
        cell = dict(zip(columns, (c.strip() for c in row.strip("|").split("|")), strict=True))
        metrics = run.data.metrics
        documents = int(metrics["val/num_documents"])
        for path in ("unary", "realized", "oracle"):  # the value as MLflow holds it, and its t interval
            value, se = metrics[f"accept/{path}"], metrics[f"se/accept/{path}"]
            half = stats.t.ppf(0.975, documents - 1) * se
            _assert_interval(cell[path], value, value - half, value + half)
        _assert_interval(cell["recall@K"], metrics["val/unary_candidate_recall"])
        assert cell["draft step ms"] == f"{metrics['val/draft_step_ms']:.2f}"
        assert cell["params"] == f"{int(run.data.params['draft_parameters']):,}"
        if "eval/measured_accepted_length_greedy" in metrics:  # the study's opt-in evaluation of its best trial
            evaluated += 1
            _assert_interval(cell["measured T=0"], metrics["eval/measured_accepted_length_greedy"])
    assert evaluated == 1
    assert "95% interval" in markdown and "Validation:** " in markdown
    finished = sum(
        r.data.tags.get(tracking.TAG_ROLE) != "study" and r.data.tags[tracking.TAG_STATUS] == "finished" for r in runs
    )
    dtype = computes_in("cpu", "auto")  # what the study's train.precision `auto` chooses here
    assert f"- **Computed in:** {dtype} ({finished} runs). " in markdown
    assert re.search(r"\| trial \d+ \| infeasible \| invalid knob conv_group_size=7", markdown)

    # every image link resolves to a real, non-empty PNG
    for link in [part.split(")")[0] for part in markdown.split("](")[1:]]:
        image = report.parent / link
        assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.stat().st_size > 5000
    # tables are well formed: every row of a table has as many cells as its header
    for block in markdown.split("\n\n"):
        lines = [line for line in block.splitlines() if line.startswith("|")]
        if lines:
            assert len({line.count("|") - line.count("\\|") for line in lines}) == 1, block[:200]

    # regenerate from the store alone, in a fresh process
    regenerated = subprocess.run(
        [*CLI, "report", "tiny", "--workdir", str(e2e_workdir), "--out", str(cwd / "again")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert regenerated.returncode == 0, regenerated.stderr[-2000:]
    strip = lambda text: [line for line in text.splitlines() if GENERATED_PREFIX not in line]  # noqa: E731
    assert strip((cwd / "again" / "tiny" / "README.md").read_text()) == strip(markdown)
    # and the report is logged on the parent run
    parent = next(r for r in runs if r.data.tags.get(tracking.TAG_ROLE) == "study")
    assert {"report/README.md", "report/per_position.png"} <= {
        a.path for a in client.list_artifacts(parent.info.run_id, "report")
    }


def _assert_interval(cell: str, value: float, low: float | None = None, high: float | None = None) -> None:
    """A report cell `v [lo, hi]` (or `v`) shows these numbers, rounded to the digits it prints."""
    numbers = [float(n) for n in re.findall(r"[-+]?\d+\.\d+", cell)]
    digits = len(cell.split()[0].split(".")[1])
    expected = [value] + ([low, high] if low is not None else numbers[1:])
    assert numbers == pytest.approx(expected, abs=0.51 * 10**-digits), (cell, expected)


def test_study_status_and_list(launched, e2e_workdir):
    status = subprocess.run(
        [*CLI, "study", "status", "tiny", "--workdir", str(e2e_workdir)], capture_output=True, text=True, timeout=120
    )
    assert status.returncode == 0 and "COMPLETE" in status.stdout and "divisor of the hidden size" in status.stdout
    listing = subprocess.run(
        [*CLI, "study", "list", "--workdir", str(e2e_workdir)], capture_output=True, text=True, timeout=120
    )
    assert listing.returncode == 0 and "tiny: 4 trials" in listing.stdout


def test_report_for_study_without_completed_trials_says_so(launched, e2e_workdir, tmp_path):
    study_file = tiny_study_file(
        tmp_path,
        "nothing",
        **{
            "conv_group_size: [16, 7]": "conv_group_size: [7]",
            "baselines: [dflash, dflash2_defaults]": "baselines: []",
            "budget: {n_trials: 4": "budget: {n_trials: 2",
        },
    )
    done = launch_study(study_file, e2e_workdir, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    markdown = (e2e_workdir / "reports" / "nothing" / "README.md").read_text()
    assert "No trial or baseline completed, so there is nothing to rank yet." in markdown
    assert "0 completed trial(s): too few to estimate knob effects." in markdown
    assert markdown.count("| infeasible |") == 2
    compared = subprocess.run(
        [*CLI, "report", "--compare", "tiny", "nothing", "--workdir", str(e2e_workdir), "--out", str(tmp_path / "cmp")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert compared.returncode == 0, compared.stderr[-2000:]
    comparison = (tmp_path / "cmp" / "compare-tiny-vs-nothing" / "README.md").read_text()
    assert (
        "# Comparison: `tiny` vs `nothing`" in comparison and "| tiny |" in comparison and "| nothing |" in comparison
    )


def test_killed_study_resumes_and_finishes_its_budget(e2e_workspace, e2e_workdir, tmp_path):
    study_file = tiny_study_file(
        tmp_path,
        "resumable",
        **{
            "conv_group_size: [16, 7]": "conv_group_size: [16]",
            "baselines: [dflash, dflash2_defaults]": "baselines: []",
            "steps_per_trial: 4": "steps_per_trial: 6",
        },
    )
    env = {"DFLASH_LAB_HEARTBEAT_GRACE_S": "3"}
    process = subprocess.Popen(
        [*CLI, "study", "launch", str(study_file), "--workdir", str(e2e_workdir), "--no-report"],
        cwd=tmp_path,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = storage_url(e2e_workdir, None)
    deadline = time.time() + 400
    killed = False
    while time.time() < deadline and process.poll() is None:
        time.sleep(0.5)
        try:
            study = optuna.load_study(study_name="resumable", storage=url)
        except KeyError:
            continue
        running = [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
        if running and (e2e_workdir / "runs" / f"resumable-trial-{running[0].number}" / "checkpoint.pt").exists():
            process.send_signal(signal.SIGKILL)
            killed = True
            break
    process.wait()
    assert killed, "the study must be killed while a trial is running"
    time.sleep(4)  # past the heartbeat grace period: the trial is dead
    done = launch_study(study_file, e2e_workdir, "--no-report", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    study = optuna.load_study(study_name="resumable", storage=url)
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == 2
    interrupted = study.user_attrs["interrupted_trials"]
    assert len(interrupted) == 1 and study.trials[interrupted[0]].state == optuna.trial.TrialState.FAIL
    retried = [t for t in complete if t.user_attrs.get("origin_trial") == interrupted[0]]
    assert len(retried) == 1, "the interrupted config is retried"
    assert "resuming resumable-trial-" in done.stderr, "the retried trial resumes its checkpoint and MLflow run"
    status = subprocess.run(
        [*CLI, "study", "status", "resumable", "--workdir", str(e2e_workdir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        f"{interrupted[0]:>5}  FAIL" in status.stdout
        and "interrupted: its worker stopped sending heartbeats" in status.stdout
    )
    client = mlflow.MlflowClient(tracking.tracking_uri(e2e_workdir))
    runs = client.search_runs(
        [client.get_experiment_by_name("dflash-lab/resumable").experiment_id], "tags.`dflash_lab.role` = 'trial'"
    )
    assert sorted(r.info.run_name for r in runs) == sorted(
        {f"resumable-trial-{t.user_attrs.get('origin_trial', t.number)}" for t in complete}
    )


@pytest.mark.skipif(
    bool(os.environ.get("DFLASH_LAB_TEST_POSTGRES_URL")),
    reason="CI covers shared storage with the PostgreSQL test below (same checks, real server)",
)
def test_two_workers_share_one_study(e2e_workspace, e2e_workdir, tmp_path):
    study_file = tiny_study_file(
        tmp_path,
        "shared",
        **{
            "conv_group_size: [16, 7]": "conv_group_size: [16, 64]",
            "baselines: [dflash, dflash2_defaults]": "baselines: [dflash]",
        },
    )
    done = launch_study(study_file, e2e_workdir, "--n-jobs", "2", "--no-report", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    study = optuna.load_study(study_name="shared", storage=storage_url(e2e_workdir, None))
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == 4
    assert len({tuple(sorted(t.params.items())) for t in complete}) == 4, "the grid is shared, not repeated"
    assert len({t.user_attrs[ATTR_WORKER] for t in complete}) == 2, "both processes ran trials"


@pytest.mark.skipif(
    not os.environ.get("DFLASH_LAB_TEST_POSTGRES_URL"),
    reason="no PostgreSQL server: .ci/run starts one with scripts/postgres.sh and sets DFLASH_LAB_TEST_POSTGRES_URL",
)
def test_workers_share_a_postgresql_study(e2e_workspace, e2e_workdir, tmp_path):
    url = os.environ["DFLASH_LAB_TEST_POSTGRES_URL"]
    name = f"pg{int(time.time())}"
    study_file = tiny_study_file(
        tmp_path,
        name,
        **{
            "conv_group_size: [16, 7]": "conv_group_size: [16, 64]",
            "baselines: [dflash, dflash2_defaults]": "baselines: []",
        },
    )
    done = launch_study(study_file, e2e_workdir, "--storage", url, "--n-jobs", "2", "--no-report", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    study = optuna.load_study(study_name=name, storage=url)
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == 4 and len({tuple(sorted(t.params.items())) for t in complete}) == 4
    assert len({t.user_attrs[ATTR_WORKER] for t in complete}) == 2
    listing = subprocess.run(
        [*CLI, "study", "list", "--workdir", str(e2e_workdir), "--storage", url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        listing.returncode == 0 and f"{name}: " in listing.stdout
    )  # a worker racing for the last grid cell adds a pruned duplicate
    client = mlflow.MlflowClient(tracking.tracking_uri(e2e_workdir))
    runs = client.search_runs(
        [client.get_experiment_by_name(f"dflash-lab/{name}").experiment_id], "tags.`dflash_lab.role` = 'trial'"
    )
    assert len(runs) == 4 and len({r.info.run_name for r in runs}) == 4, (
        "every finished trial has exactly one MLflow child run"
    )


@pytest.mark.skipif(
    not os.environ.get("DFLASH_LAB_TEST_MLFLOW_URL"),
    reason="no MLflow server: .ci/run starts one with scripts/mlflow_server.sh and sets DFLASH_LAB_TEST_MLFLOW_URL",
)
def test_a_trial_logs_to_an_mlflow_tracking_server(e2e_workspace, e2e_workdir, tmp_path):
    url = os.environ["DFLASH_LAB_TEST_MLFLOW_URL"]
    name = f"server{int(time.time())}"
    study_file = tiny_study_file(
        tmp_path,
        name,
        **{
            "conv_group_size: [16, 7]": "conv_group_size: [16]",
            "selector_rank: [8, 16]": "selector_rank: [8]",
            "baselines: [dflash, dflash2_defaults]": "baselines: []",
            "steps_per_trial: 4": "steps_per_trial: 2",
        },
    )
    workdir = tmp_path / "work-server"  # its own local stores; the shared target, data and feature caches
    link_caches(workdir, e2e_workdir)
    done = launch_study(study_file, workdir, cwd=tmp_path, env={"MLFLOW_TRACKING_URI": url})
    assert done.returncode == 0, done.stderr[-3000:]
    client = mlflow.MlflowClient(url)
    experiment = client.get_experiment_by_name(f"dflash-lab/{name}")
    runs = client.search_runs([experiment.experiment_id])
    trials = [r for r in runs if r.data.tags.get(tracking.TAG_ROLE) == "trial"]
    assert len(trials) == 1 and trials[0].info.status == "FINISHED"
    assert "accept/realized" in trials[0].data.metrics
    parent = next(r for r in runs if r.data.tags.get(tracking.TAG_ROLE) == "study")
    assert "study.yaml" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert "report/README.md" in {a.path for a in client.list_artifacts(parent.info.run_id, "report")}


def test_a_trial_that_raises_is_recorded_failed_and_the_study_goes_on(e2e_workspace, tmp_path):
    """An out-of-memory (or NaN) inside one trial: that trial is FAIL with its error, the next trial still runs."""

    from harness.train import Workspaces
    from studies.claims import Claims
    from studies.runner import StudyRunner, make_sampler
    from studies.schema import load_study
    from studies.storage import ATTR_FAIL_REASON

    definition = load_study(
        tiny_study_file(tmp_path, "raises", **{"conv_group_size: [16, 7]": "conv_group_size: [16]"})
    )
    study = optuna.create_study(study_name="raises", sampler=make_sampler(definition))
    claims = Claims(study._storage, "raises", grace_s=60)
    workspaces = Workspaces(e2e_workspace.workdir)  # finds the e2e caches
    runner = StudyRunner(definition, workspaces, study, parent_run_id="unused", claims=claims)
    outcomes = iter([RuntimeError("CPU out of memory: tried to allocate 40.00 GiB"), None])

    def fake_train(*args, **kwargs):
        error = next(outcomes)
        if error:
            raise error
        from harness.train import TrainResult

        return TrainResult(
            "run-2",
            tmp_path,
            {"realized_accepted_length": 1.5, "unary_accepted_length": 1.2, "oracle_accepted_length": 2.0},
        )

    with mock.patch("studies.runner.train", side_effect=fake_train):
        study.optimize(runner.objective, n_trials=2, catch=(Exception,))
    first, second = study.trials
    assert first.state == optuna.trial.TrialState.FAIL and "out of memory" in first.user_attrs[ATTR_FAIL_REASON]
    assert second.state == optuna.trial.TrialState.COMPLETE and second.value == 1.5


def test_two_launches_at_the_same_moment_run_each_baseline_and_config_once(e2e_workspace, e2e_workdir, tmp_path):
    study_file = tiny_study_file(
        tmp_path,
        "together",
        **{
            "conv_group_size: [16, 7]": "conv_group_size: [16]",
            "baselines: [dflash, dflash2_defaults]": "baselines: [dflash, dflash+selector]",
            "n_trials: 4": "n_trials: 2",
        },
    )
    command = [*CLI, "study", "launch", str(study_file), "--workdir", str(e2e_workdir), "--no-report"]
    launches = [
        subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    errors = [launch.communicate(timeout=900)[1] for launch in launches]
    assert [launch.returncode for launch in launches] == [0, 0], [e[-2000:] for e in errors]
    client = mlflow.MlflowClient(tracking.tracking_uri(e2e_workdir))
    runs = client.search_runs([client.get_experiment_by_name("dflash-lab/together").experiment_id])
    roles = [r.data.tags.get(tracking.TAG_ROLE) for r in runs]
    assert roles.count("study") == 1, "one parent run"
    baselines = sorted(r.info.run_name for r in runs if r.data.tags.get(tracking.TAG_ROLE) == "baseline")
    assert baselines == ["together-baseline-dflash+selector-seed0", "together-baseline-dflash-seed0"]
    for run in runs:
        if run.data.tags.get(tracking.TAG_ROLE) == "baseline":
            steps = [m.step for m in client.get_metric_history(run.info.run_id, "accept/realized")]
            assert len(steps) == len(set(steps)), f"{run.info.run_name} was trained twice: steps {steps}"
    study = optuna.load_study(study_name="together", storage=storage_url(e2e_workdir, None))
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    # each configuration trained once; a racing launcher's repeat of a cell is pruned as a duplicate
    assert len({tuple(sorted(t.params.items())) for t in complete}) == len(complete) >= 1


def _rest(base: str, endpoint: str, payload: dict | None = None) -> dict:
    request = urllib.request.Request(
        f"{base}/api/2.0/mlflow/{endpoint}",
        data=json.dumps(payload).encode() if payload is not None else None,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture
def ui_server(launched, e2e_workdir):
    """`mlflow server` on a free local port over the finished tiny study, as a user would open it."""
    with mlflow_server(tracking.tracking_uri(e2e_workdir)) as (url, _):
        yield url


def test_the_runs_table_through_the_mlflow_rest_api(launched, ui_server):
    """The names, descriptions and headline metrics the UI's runs table shows, fetched from a real server."""
    done, _ = launched
    experiment = _rest(ui_server, "experiments/get-by-name?experiment_name=dflash-lab/tiny")["experiment"]
    path = f"/#/experiments/{experiment['experiment_id']}/runs?workflowType=machine_learning"
    assert f"{tracking.UI_ADDRESS}{path}" in done.stdout  # what `mlflow ui` serves by default
    with urllib.request.urlopen(f"{ui_server}/", timeout=30) as page:  # the page the link's fragment routes in
        assert page.status == 200 and b"<html" in page.read().lower()
    runs = _rest(ui_server, "runs/search", {"experiment_ids": [experiment["experiment_id"]], "max_results": 100})[
        "runs"
    ]
    seen = {}
    for run in runs:
        tags = {t["key"]: t["value"] for t in run["data"].get("tags", [])}
        metrics = {m["key"]: m["value"] for m in run["data"].get("metrics", [])}
        seen[run["info"]["run_name"]] = (tags.get(tracking.TAG_NOTE, ""), tags.get(tracking.TAG_STATUS), metrics)
    assert {"tiny-trial-2", "tiny-trial-3", "tiny-baseline-dflash-seed0", "study-tiny"} <= set(seen)
    note, state, metrics = seen["tiny-trial-2"]
    assert state == "finished" and note.startswith("unary ") and " | realized " in note
    assert {"accept/unary", "accept/realized", "accept/oracle", "se/accept/realized"} <= set(metrics)
    assert note.split(" | ")[1].split()[1] == f"{metrics['accept/realized']:.{_decimals(note)}f}"
    assert seen["tiny-trial-0"][1] == "infeasible" and seen["tiny-trial-0"][0].startswith("INFEASIBLE: ")
    assert seen["study-tiny"][0].startswith("best: ")


def _decimals(note: str) -> int:
    return len(note.split(" | ")[1].split()[1].split(".")[1])


@pytest.mark.skipif(
    not (shutil.which("chromium") or shutil.which("chromium-browser")), reason="no Chromium installed (optional)"
)
def test_the_printed_link_opens_the_runs_table_in_a_browser(ui_server, tmp_path):
    experiment = _rest(ui_server, "experiments/get-by-name?experiment_name=dflash-lab/tiny")["experiment"]
    link = f"{ui_server}/#/experiments/{experiment['experiment_id']}/runs?workflowType=machine_learning"
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    dom = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=20000", "--dump-dom", link],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "study-tiny" in dom


def test_deleted_runs_are_named_in_the_report_and_a_deleted_parent_refuses_a_relaunch(launched, e2e_workdir, tmp_path):
    """In a copy of the tiny study's stores: the best trial's run deleted in MLflow is named in the report and
    ranked nowhere; with the parent run deleted too, a relaunch and a report each refuse in one line."""
    from reports.collect import collect
    from reports.render import render

    workdir = tmp_path / "copy"
    workdir.mkdir()
    for store in ("mlflow.db", "optuna.db"):
        shutil.copy(e2e_workdir / store, workdir / store)
    link_caches(workdir, e2e_workdir)
    client = tracking.client(workdir)
    record = collect("tiny", workdir)
    best = record.parent["tags"][tracking.TAG_BEST_RUN_ID]
    best_name = client.get_run(best).info.run_name
    client.delete_run(best)
    record = collect("tiny", workdir)
    assert best not in set(record.runs["run_id"]) and [r["run_id"] for r in record.deleted] == [best]
    markdown = render(record, tmp_path / "report")
    deleted = markdown.split("## Deleted runs", 1)[1]
    assert f"`{best_name}`" in deleted and "Optuna's best" in deleted
    assert f"`{best_name}`" not in markdown.split("## Deleted runs", 1)[0]
    client.delete_run(record.parent["run_id"])
    for command in (["study", "launch", str(TINY_STUDY)], ["report", "tiny"]):
        done = subprocess.run(
            [*CLI, *command, "--workdir", str(workdir)], capture_output=True, text=True, timeout=600, cwd=tmp_path
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert (
            "its MLflow parent run" in lines[-1] and "was deleted" in lines[-1] and "mlflow runs restore" in lines[-1]
        )
