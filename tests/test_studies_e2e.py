"""Studies end to end on the embedded target: launch, MLflow structure, reports, resume and workers."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import optuna
import pytest

from harness import tracking
from reports.render import GENERATED_PREFIX
from studies.runner import ATTR_INFEASIBLE, ATTR_RUN_ID, ATTR_WORKER, storage_url

pytestmark = pytest.mark.slow
TINY = Path(__file__).parent / "data" / "tiny_study.yaml"
CLI = [sys.executable, "-m", "harness.cli"]


def _study_file(tmp_path: Path, name: str, **replacements) -> Path:
    text = (
        TINY.read_text()
        .replace("name: tiny", f"name: {name}")
        .replace("evaluate: {best_trials: 1", "evaluate: {best_trials: 0")
    )
    for old, new in replacements.items():
        text = text.replace(old, new)
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def _launch(study_file: Path, workdir: Path, *extra: str, cwd: Path, env=None, **kwargs):
    return subprocess.run(
        [*CLI, "study", "launch", str(study_file), "--workdir", str(workdir), *extra],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        timeout=900,
        **kwargs,
    )


@pytest.fixture(scope="session")
def launched(e2e_workspace, e2e_workdir, tmp_path_factory):
    """The tiny study, launched once through the CLI (its report lands under <cwd>/reports)."""
    cwd = tmp_path_factory.mktemp("launch")
    done = _launch(TINY, e2e_workdir, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return done, cwd


def test_launch_records_trials_baselines_and_infeasible_cells(launched, e2e_workdir):
    done, _ = launched
    assert done.stderr.count("feature cache hit") == 1 and "extracting" not in done.stderr, (
        "the target runs at most once per study"
    )
    assert "[trial 2] {'conv_group_size': 16" in done.stdout
    assert "infeasible {'conv_group_size': 7" in done.stdout
    assert "MLflow UI: mlflow ui --backend-store-uri" in done.stdout
    study = optuna.load_study(study_name="tiny", storage=storage_url(e2e_workdir, None))
    states = [t.state for t in study.trials]
    assert states.count(optuna.trial.TrialState.COMPLETE) == 2 and states.count(optuna.trial.TrialState.PRUNED) == 2
    for trial in study.trials:
        if trial.params["conv_group_size"] == 7:
            assert "divisor of the hidden size 576" in trial.user_attrs[ATTR_INFEASIBLE]

    client = mlflow.MlflowClient(tracking.tracking_uri(e2e_workdir))
    experiment = client.get_experiment_by_name("tiny")
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
                "unary_accepted_length",
                "realized_accepted_length",
                "oracle_accepted_length",
                "unary_candidate_recall_at_16",
                "unary_candidate_target_mass_at_16",
            ):
                assert f"val/{name}" in run.data.metrics
            assert run.data.metrics["val/realized_accepted_length"] == pytest.approx(trial.value)


def test_report_numbers_equal_mlflow_and_regenerate_identically(launched, e2e_workdir):
    _, cwd = launched
    report = cwd / "reports" / "tiny" / "README.md"
    markdown = report.read_text()
    client = mlflow.MlflowClient(tracking.tracking_uri(e2e_workdir))
    runs = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    leaderboard = markdown.split("## Leaderboard")[1].split("## Knob effects")[0]
    header = next(line for line in leaderboard.splitlines() if line.startswith("| run |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    rows = [line for line in leaderboard.splitlines() if line.startswith("| **baseline") or line.startswith("| trial")]
    assert len(rows) == 4
    evaluated = 0
    for run in runs:
        if run.info.status != "FINISHED" or run.data.tags.get(tracking.TAG_ROLE) not in ("trial", "baseline"):
            continue
        role = run.data.tags[tracking.TAG_ROLE]
        marker = (
            f"| **baseline {run.data.tags['dflash_lab.baseline']}**"
            if role == "baseline"
            else f"| trial {run.data.tags[tracking.TAG_TRIAL]} "
        )
        row = next(r for r in rows if r.startswith(marker))
        cell = dict(zip(columns, (c.strip() for c in row.strip("|").split("|")), strict=True))
        metrics = run.data.metrics
        unary, realized, oracle = (metrics[f"val/{n}_accepted_length"] for n in ("unary", "realized", "oracle"))
        assert [cell["unary"], cell["realized"], cell["oracle"], cell["selector gain"], cell["oracle headroom"]] == [
            f"{unary:.4f}",
            f"{realized:.4f}",
            f"{oracle:.4f}",
            f"{realized - unary:.4f}",
            f"{oracle - realized:.4f}",
        ]
        assert cell["recall@K"] == f"{metrics['val/unary_candidate_recall_at_16']:.4f}"
        assert cell["target mass@K"] == f"{metrics['val/unary_candidate_target_mass_at_16']:.4f}"
        assert cell["draft step ms"] == f"{metrics['val/draft_step_ms']:.4f}"
        assert cell["params"] == f"{int(run.data.params['draft_parameters']):,}"
        if "eval/measured_accepted_length_greedy" in metrics:  # the study's opt-in evaluation of its best trial
            evaluated += 1
            assert cell["measured T=0"] == f"{metrics['eval/measured_accepted_length_greedy']:.4f}"
    assert evaluated == 1
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
    study_file = _study_file(
        tmp_path,
        "nothing",
        **{
            "conv_group_size: [16, 7]": "conv_group_size: [7]",
            "baselines: [dflash, dflash2_defaults]": "baselines: []",
            "budget: {n_trials: 4": "budget: {n_trials: 2",
        },
    )
    done = _launch(study_file, e2e_workdir, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    markdown = (tmp_path / "reports" / "nothing" / "README.md").read_text()
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
    study_file = _study_file(
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
    done = _launch(study_file, e2e_workdir, "--no-report", cwd=tmp_path, env=env)
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
        [client.get_experiment_by_name("resumable").experiment_id], "tags.`dflash_lab.role` = 'trial'"
    )
    assert sorted(r.info.run_name for r in runs) == sorted(
        {f"resumable-trial-{t.user_attrs.get('origin_trial', t.number)}" for t in complete}
    )


@pytest.mark.skipif(
    bool(os.environ.get("DFLASH_LAB_TEST_POSTGRES_URL")),
    reason="CI covers shared storage with the PostgreSQL test below (same checks, real server)",
)
def test_two_workers_share_one_study(e2e_workspace, e2e_workdir, tmp_path):
    study_file = _study_file(
        tmp_path,
        "shared",
        **{
            "conv_group_size: [16, 7]": "conv_group_size: [16, 64]",
            "baselines: [dflash, dflash2_defaults]": "baselines: [dflash]",
        },
    )
    done = _launch(study_file, e2e_workdir, "--n-jobs", "2", "--no-report", cwd=tmp_path)
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
    study_file = _study_file(
        tmp_path,
        name,
        **{
            "conv_group_size: [16, 7]": "conv_group_size: [16, 64]",
            "baselines: [dflash, dflash2_defaults]": "baselines: []",
        },
    )
    done = _launch(study_file, e2e_workdir, "--storage", url, "--n-jobs", "2", "--no-report", cwd=tmp_path)
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
    runs = client.search_runs([client.get_experiment_by_name(name).experiment_id], "tags.`dflash_lab.role` = 'trial'")
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
    study_file = _study_file(
        tmp_path,
        name,
        **{
            "conv_group_size: [16, 7]": "conv_group_size: [16]",
            "selector_rank: [8, 16]": "selector_rank: [8]",
            "baselines: [dflash, dflash2_defaults]": "baselines: []",
            "steps_per_trial: 4": "steps_per_trial: 2",
        },
    )
    done = _launch(study_file, tmp_path / "work-server", cwd=tmp_path, env={"MLFLOW_TRACKING_URI": url})
    assert done.returncode == 0, done.stderr[-3000:]
    client = mlflow.MlflowClient(url)
    experiment = client.get_experiment_by_name(name)
    runs = client.search_runs([experiment.experiment_id])
    trials = [r for r in runs if r.data.tags.get(tracking.TAG_ROLE) == "trial"]
    assert len(trials) == 1 and trials[0].info.status == "FINISHED"
    assert "val/realized_accepted_length" in trials[0].data.metrics
    parent = next(r for r in runs if r.data.tags.get(tracking.TAG_ROLE) == "study")
    assert "study.yaml" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert "report/README.md" in {a.path for a in client.list_artifacts(parent.info.run_id, "report")}


def test_a_trial_that_raises_is_recorded_failed_and_the_study_goes_on(e2e_workspace, tmp_path):
    """An out-of-memory (or NaN) inside one trial: that trial is FAIL with its error, the next trial still runs."""
    from unittest import mock

    from studies.claims import Claims
    from studies.runner import ATTR_FAIL_REASON, StudyRunner, make_sampler
    from studies.schema import load_study

    definition = load_study(_study_file(tmp_path, "raises", **{"conv_group_size: [16, 7]": "conv_group_size: [16]"}))
    study = optuna.create_study(study_name="raises", sampler=make_sampler(definition))
    claims = Claims(study._storage, "raises", grace_s=60)
    runner = StudyRunner(definition, e2e_workspace, study, parent_run_id="unused", claims=claims)
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
    study_file = _study_file(
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
    runs = client.search_runs([client.get_experiment_by_name("together").experiment_id])
    roles = [r.data.tags.get(tracking.TAG_ROLE) for r in runs]
    assert roles.count("study") == 1, "one parent run"
    baselines = sorted(r.info.run_name for r in runs if r.data.tags.get(tracking.TAG_ROLE) == "baseline")
    assert baselines == ["together-baseline-dflash+selector-seed0", "together-baseline-dflash-seed0"]
    for run in runs:
        if run.data.tags.get(tracking.TAG_ROLE) == "baseline":
            steps = [m.step for m in client.get_metric_history(run.info.run_id, "val/realized_accepted_length")]
            assert len(steps) == len(set(steps)), f"{run.info.run_name} was trained twice: steps {steps}"
    study = optuna.load_study(study_name="together", storage=storage_url(e2e_workdir, None))
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    # each configuration trained once; a racing launcher's repeat of a cell is pruned as a duplicate
    assert len({tuple(sorted(t.params.items())) for t in complete}) == len(complete) >= 1
