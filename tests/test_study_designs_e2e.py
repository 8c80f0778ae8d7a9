"""Designed studies end to end on the embedded target: kills and SIGTERMs mid-design, served objectives, budgets,
branches and swept knobs (the tiny study's launch, reports and workers are in test_studies_e2e.py)."""

import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path
from unittest import mock

import mlflow
import optuna
import pytest
import yaml

import reports.analysis
from harness import tracking
from harness.design import TRANSFER_MEANINGS
from harness.run import DRAFT_GGUF_FILE, SERVED_DIR, SERVED_RECORDS_FILE
from harness.serving import metrics as served_names
from reports.build import build_report_with_summary
from reports.sections import GENERATED_PREFIX
from studies.storage import storage_url

from conftest import CLI, gone, launch_study, started_server, tiny_study_file

pytestmark = pytest.mark.slow

DESIGN = Path(__file__).parent / "data" / "tiny_design.yaml"


def test_a_killed_design_with_two_workers_runs_every_point_once_and_reports_its_effects(
    e2e_workspace, e2e_workdir, tmp_path
):
    """A one-factor design on two seeds and two workers, killed (launcher and worker) mid-trial and
    relaunched: every point completes exactly once, every (point, seed) run exists once, and the report fits
    the effect."""
    env = {**os.environ, "DFLASH_LAB_HEARTBEAT_GRACE_S": "3"}
    args = [*CLI, "study", "launch", str(DESIGN), "--workdir", str(e2e_workdir), "--n-jobs", "2"]
    process = subprocess.Popen(
        [*args, "--no-report"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # the launcher and its worker form one group, killed together
    )
    url, deadline, killed = storage_url(e2e_workdir, None), time.time() + 400, False
    while time.time() < deadline and process.poll() is None:
        time.sleep(0.5)
        try:
            study = optuna.load_study(study_name="tiny-design", storage=url)
        except KeyError:
            continue
        running = [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
        # killed inside a point, between its seeds: the finished seed's run must not train again
        if any((e2e_workdir / "runs" / f"tiny-design-trial-{t.number}-seed1").exists() for t in running):
            os.killpg(process.pid, signal.SIGKILL)
            killed = True
            break
    process.wait()
    assert killed, "the design must be killed while a point is running"
    time.sleep(4)  # past the heartbeat grace period
    relaunched = launch_study(DESIGN, e2e_workdir, "--n-jobs", "2", cwd=tmp_path, env=env)
    assert relaunched.returncode == 0, relaunched.stderr[-3000:]
    study = optuna.load_study(study_name="tiny-design", storage=url)
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    points = sorted(tuple(sorted(t.params.items())) for t in complete)
    assert len(points) == 2 and len(set(points)) == 2, "each design point completes exactly once"
    assert sorted(t.user_attrs["design_point"] for t in complete) == [0, 1]
    client = mlflow.MlflowClient(tracking.tracking_uri(e2e_workdir))
    experiment = client.get_experiment_by_name("dflash-lab/tiny-design").experiment_id
    runs = client.search_runs([experiment], "tags.`dflash_lab.role` = 'trial'")
    names = [r.info.run_name for r in runs]
    assert len(names) == len(set(names)) == 4, "one run per point and seed, none twice"
    assert all(r.data.tags[tracking.TAG_STATUS] == "finished" for r in runs)
    report = (e2e_workdir / "reports" / "tiny-design" / "README.md").read_text()
    section = report.split("## Designed effects")[1].split("## Learning curves")[0]
    assert "full 2^1 factorial: 2 points" in section and "4 runs" in section and "2 residual degrees" in section
    assert "| `conv` |" in section
    # A relaunch of a finished design runs nothing and logs the parent's design metrics no second time.
    again = launch_study(DESIGN, e2e_workdir, cwd=tmp_path, env=env)
    assert again.returncode == 0 and "[trial" not in again.stdout
    parent = client.search_runs([experiment], "tags.`dflash_lab.role` = 'study'")[0].info.run_id
    assert len(client.get_metric_history(parent, "design/runs")) == 1
    assert len(optuna.load_study(study_name="tiny-design", storage=url).trials) == len(study.trials)


def test_sigterm_to_a_study_records_the_trial_interrupted_and_a_relaunch_resumes_it(
    e2e_workspace, e2e_workdir, tmp_path
):
    study_file = tiny_study_file(
        tmp_path,
        "preempted",
        **{
            "conv_group_size: [16, 7]": "conv_group_size: [16]",
            "baselines: [dflash, dflash2_defaults]": "baselines: []",
            "steps_per_trial: 4": "steps_per_trial: 6",
        },
    )
    args = [*CLI, "study", "launch", str(study_file), "--workdir", str(e2e_workdir), "--no-report"]
    process = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    checkpoint = e2e_workdir / "runs" / "preempted-trial-0" / "checkpoint.pt"
    deadline = time.time() + 400
    while not checkpoint.exists() and time.time() < deadline and process.poll() is None:
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 143, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith("error: terminated (SIGTERM)")
    # Optuna's line for the stopped trial stays, without its stack: a cluster's job log reads in lines.
    assert "Trial 0 failed" in stderr and "Preempted" in stderr
    assert "Traceback" not in stderr, stderr[-3000:]
    url = storage_url(e2e_workdir, None)
    study = optuna.load_study(study_name="preempted", storage=url)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.FAIL, optuna.trial.TrialState.WAITING]
    assert study.trials[0].user_attrs["fail_reason"].startswith("interrupted: Preempted")
    client = mlflow.MlflowClient(tracking.tracking_uri(e2e_workdir))
    experiment = client.get_experiment_by_name("dflash-lab/preempted").experiment_id
    (run,) = client.search_runs([experiment], "tags.`dflash_lab.role` = 'trial'")
    assert (
        run.data.tags[tracking.TAG_STATUS] == "interrupted" and "SIGTERM" in run.data.tags[tracking.TAG_STATUS_REASON]
    )
    (parent,) = client.search_runs([experiment], "tags.`dflash_lab.role` = 'study'")
    assert parent.info.status == "KILLED" and parent.data.tags[tracking.TAG_STATUS] == "interrupted"
    relaunched = launch_study(study_file, e2e_workdir, "--no-report", cwd=tmp_path)
    assert relaunched.returncode == 0, relaunched.stderr[-3000:]
    assert "resuming preempted-trial-0" in relaunched.stderr, "the interrupted trial resumes its checkpoint"
    again = launch_study(study_file, e2e_workdir, "--no-report", cwd=tmp_path)  # nothing left: nothing logged again
    assert again.returncode == 0 and "[trial" not in again.stdout
    study = optuna.load_study(study_name="preempted", storage=url)
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == 2 and complete[0].user_attrs["origin_trial"] == 0
    runs = client.search_runs([experiment], "tags.`dflash_lab.role` = 'trial'")
    assert sorted(r.info.run_name for r in runs) == ["preempted-trial-0", "preempted-trial-2"]
    assert next(r for r in runs if r.info.run_name == "preempted-trial-0").info.run_id == run.info.run_id
    reopened = client.get_run(parent.info.run_id)  # reopened by the relaunch, then finished by it
    assert reopened.info.status == "FINISHED" and reopened.data.tags[tracking.TAG_STATUS] == "finished"
    assert len(client.get_metric_history(parent.info.run_id, "best/realized_accepted_length")) == 1


def test_sigterm_in_a_studys_serving_step_stops_the_server_and_a_relaunch_serves_once(
    e2e_workspace, e2e_workdir, tmp_path, spawn
):
    """The study's serving step (evaluate.serve) stopped mid-request: the server stops, the parent and the served
    run read interrupted, nothing served is logged; a relaunch serves the run once, and a further one not again."""
    study_file = tiny_study_file(
        tmp_path,
        "served-stop",
        **{
            "conv_group_size: [16, 7]": "conv_group_size: [16]",
            "selector_rank: [8, 16]": "selector_rank: [8]",
            "baselines: [dflash, dflash2_defaults]": "baselines: []",
            "n_trials: 4": "n_trials: 1",
            "evaluate: {best_trials: 0, num_prompts: 2, max_new_tokens: 16": (
                "evaluate: {best_trials: 0, serve: llama.cpp, num_prompts: 1, max_new_tokens: 24"
            ),
        },
    )
    args = [*CLI, "study", "launch", str(study_file), "--workdir", str(e2e_workdir), "--no-report"]
    process = spawn(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log = e2e_workdir / "runs" / "served-stop-trial-0" / "served" / "server-draft.log"
    server = started_server(e2e_workdir, process, log=log)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 143 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith("error: terminated (SIGTERM)")
    assert gone(server["pid"])
    client = mlflow.MlflowClient(tracking.tracking_uri(e2e_workdir))
    experiment = client.get_experiment_by_name("dflash-lab/served-stop").experiment_id
    (parent,) = client.search_runs([experiment], "tags.`dflash_lab.role` = 'study'")
    assert parent.info.status == "KILLED" and parent.data.tags[tracking.TAG_STATUS] == "interrupted"
    (run,) = client.search_runs([experiment], "tags.`dflash_lab.role` = 'trial'")
    assert run.data.tags[tracking.TAG_SERVED_STATUS] == "interrupted"
    assert not [key for key in run.data.metrics if key.startswith(served_names.PREFIX)]

    relaunched = launch_study(study_file, e2e_workdir, "--no-report", cwd=tmp_path)
    assert relaunched.returncode == 0, relaunched.stderr[-3000:]
    assert "[serve] served-stop-trial-0" in relaunched.stdout and "[trial" not in relaunched.stdout
    metric = f"{served_names.PREFIX}agreement_cycle_fraction"
    assert len(client.get_metric_history(run.info.run_id, metric)) == 1
    assert client.get_run(run.info.run_id).data.tags[tracking.TAG_SERVED_STATUS] == "finished"
    assert client.get_run(parent.info.run_id).info.status == "FINISHED"
    again = launch_study(study_file, e2e_workdir, "--no-report", cwd=tmp_path)
    assert again.returncode == 0 and "[serve]" not in again.stdout
    assert len(client.get_metric_history(run.info.run_id, metric)) == 1


def test_a_design_served_for_its_objective_fits_effects_on_the_served_speed_up(e2e_workspace, e2e_workdir, tmp_path):
    """objective served_speedup on the tiny conv design (two seeds) with the real engine (conv off: DFlash + selector,
    served as DFlash2 with the identity conv): each run is served for
    its speed alone in two rounds of fresh launches (no harness decode, no cycle comparison), the trial's value is
    its runs' mean speed-up, and the report fits the conv effect on the served speed-up beside the offline one,
    with the pooled launch noise; each draft proposes from the 256 tokens its replies use most (`served_vocabulary`,
    a d2t map) and with llama.cpp's confidence cut at 0.5, drafting at most 3 of its 7 tokens; a relaunch serves
    nothing again."""
    text = DESIGN.read_text().replace("name: tiny-design", "name: served-design")
    text = text.replace("objective: realized_accepted_length", "objective: served_speedup")
    text += "evaluate: {serve: llama.cpp, num_prompts: 1, max_new_tokens: 16, temperatures: [0], served_rounds: 2, "
    text += "served_vocabulary: 256, served_confidence_cut: 0.5, served_draft_length: 3}\n"
    study_file = tmp_path / "served-design.yaml"
    study_file.write_text(text)
    done = launch_study(study_file, e2e_workdir, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("[serve] served-design-trial-") == 4
    study = optuna.load_study(study_name="served-design", storage=storage_url(e2e_workdir, None))
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == 2
    client = mlflow.MlflowClient(tracking.tracking_uri(e2e_workdir))
    experiment = client.get_experiment_by_name("dflash-lab/served-design").experiment_id
    runs = client.search_runs([experiment], "tags.`dflash_lab.role` = 'trial'")
    assert len(runs) == 4
    speedup = f"{served_names.PREFIX}{served_names.SPEEDUP}"
    for run in runs:
        metrics = run.data.metrics
        assert metrics[f"{served_names.PREFIX}{served_names.ROUNDS}"] == 2 and metrics[speedup] > 0
        assert f"{served_names.PREFIX}{served_names.LAUNCH_VARIANCE}" in metrics
        assert f"{served_names.PREFIX}{served_names.AGREEMENT_CYCLES}" not in metrics  # no cycle comparison
        assert metrics[f"{served_names.PREFIX}{served_names.VOCABULARY}"] == 256
        assert metrics[f"{served_names.PREFIX}{served_names.CONFIDENCE_CUT}"] == 0.5
        assert metrics[f"{served_names.PREFIX}{served_names.DRAFT_LENGTH}"] == 3  # of the block's 7
        assert (
            e2e_workdir / "runs" / run.info.run_name / SERVED_DIR / f"{Path(DRAFT_GGUF_FILE).stem}-vocab256.gguf"
        ).is_file()
        records = json.loads((e2e_workdir / "runs" / run.info.run_name / SERVED_RECORDS_FILE).read_text())
        assert [r["drafted_first"] for r in records] == [False, True]  # the rounds alternate which pass goes first
        assert statistics.fmean(r["speedup"] for r in records) == pytest.approx(metrics[speedup])
    by_name = {r.info.run_name: r.data.metrics[speedup] for r in runs}
    for trial in complete:
        seeds = [by_name[f"served-design-trial-{trial.number}-seed{seed}"] for seed in (0, 1)]
        assert trial.value == pytest.approx(statistics.fmean(seeds))
    report = (e2e_workdir / "reports" / "served-design" / "README.md").read_text()
    section = report.split("### Effects on `served_speedup`")[1].split("## ")[0]
    assert "launch-to-launch sd pooled over 4 runs (4 df)" in section and "| `conv` |" in section
    assert "`conv` on `served_speedup`" in report
    again = launch_study(study_file, e2e_workdir, "--no-report", cwd=tmp_path)
    assert again.returncode == 0 and "[serve]" not in again.stdout and "[trial" not in again.stdout


BUDGETS = Path(__file__).parent / "data" / "tiny_budgets.yaml"


def test_a_design_at_two_budgets_labels_how_each_verdict_carried(e2e_workspace, e2e_workdir, tmp_path):
    """The tiny design at 4 and 8 steps with DFlash at two seeds: every point and reference run trains once at
    each budget (its budget is its train.max_steps param), the report's sections read the first budget, its
    transfer table and the parent run's tags carry the same labels, and a relaunch trains nothing."""
    done = launch_study(BUDGETS, e2e_workdir, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    client = mlflow.MlflowClient(tracking.tracking_uri(e2e_workdir))
    experiment = client.get_experiment_by_name("dflash-lab/tiny-budgets").experiment_id
    runs = client.search_runs([experiment])
    children = [r for r in runs if r.data.tags[tracking.TAG_ROLE] in (tracking.ROLE_TRIAL, tracking.ROLE_BASELINE)]
    counts = {}
    for run in children:
        key = (run.data.tags[tracking.TAG_ROLE], run.data.params["train.max_steps"])
        counts[key] = counts.get(key, 0) + 1
    assert counts == {("trial", "4"): 4, ("trial", "8"): 4, ("baseline", "4"): 2, ("baseline", "8"): 2}
    baselines = sorted(r.info.run_name for r in children if r.data.tags[tracking.TAG_ROLE] == tracking.ROLE_BASELINE)
    assert baselines == [f"tiny-budgets-baseline-dflash-seed{s}{suffix}" for s in (0, 1) for suffix in ("", "-steps8")]
    parent = next(r for r in runs if r.data.tags[tracking.TAG_ROLE] == tracking.ROLE_STUDY)
    assert parent.data.params["study.budgets"] == "4,8" and parent.data.params["study.reference_seeds"] == "0,1"
    tags = {k: v for k, v in parent.data.tags.items() if k.startswith(tracking.TRANSFER_TAG_PREFIX)}
    assert set(tags) == {tracking.transfer_tag("8/arm"), tracking.transfer_tag("8/conv_kernel_size")}
    assert set(tags.values()) <= set(TRANSFER_MEANINGS)

    report = (e2e_workdir / "reports" / "tiny-budgets" / "README.md").read_text()
    assert "4 steps per run, and the design again at 8 steps" in report
    assert "**Regime.** `dflash` (the reference) at 4 steps (2 seeds): unary top-1 accuracy" in report
    leaderboard = report.split("## Leaderboard")[1].split("## ")[0]
    assert "| trial 0 |" in leaderboard and "| trial 2 |" not in leaderboard, "the leaderboard is the first budget's"
    assert "| `dflash` (reference) | 2 |" in report.split("**Training noise by arm.**")[1]
    transfer = report.split("## Budget transfer")[1].split("## Learning curves")[0]
    for key, value in tags.items():
        term = "`conv_kernel_size`" if key.endswith("conv_kernel_size") else "design runs (mean over its points)"
        row = next(line for line in transfer.splitlines() if line.startswith(f"| {term}"))
        assert row.endswith(f"| **{value}** |")
    assert transfer.count("- design runs (mean over its points): ") == 1 and "**Did 8 steps help over 4?**" in transfer
    ending = done.stdout.split("Verdicts of study tiny-budgets:")[1]
    assert ending.count("at 4 steps; at 8 steps") == 2

    again = launch_study(BUDGETS, e2e_workdir, cwd=tmp_path)
    assert again.returncode == 0 and "[trial" not in again.stdout and "[baseline" not in again.stdout

    # One analysis per report: each budget's design is fitted once (an `auto` fit tries the interactions first,
    # so twice a budget), for the markdown, the parent run's design metrics and its transfer tags alike.
    fits = []
    fit_design = reports.analysis.fit_design
    with mock.patch.object(reports.analysis, "fit_design", lambda *a, **k: fits.append(a[0]) or fit_design(*a, **k)):
        rebuilt, _ = build_report_with_summary("tiny-budgets", e2e_workdir, tmp_path / "rebuilt")
    assert len(fits) == 2 * 2
    strip = lambda text: [line for line in text.splitlines() if GENERATED_PREFIX not in line]  # noqa: E731
    assert strip(rebuilt.read_text()) == strip(report), "the same report but for its timestamp"


BRANCHES = Path(__file__).parent / "data" / "tiny_branches.yaml"


def test_budgets_as_branches_anneal_each_points_trunk(e2e_workspace, e2e_workdir, tmp_path):
    """`budgets_by: branches`: per point and seed the 8-step run trains first as a WSD trunk keeping its stable
    checkpoint at step 3, and the 4-step run is a branch of it (its curve starts at step 3); the reference arm
    likewise per seed; the report compares the budgets as before, and a relaunch trains nothing."""
    done = launch_study(BRANCHES, e2e_workdir, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    client = mlflow.MlflowClient(tracking.tracking_uri(e2e_workdir))
    experiment = client.get_experiment_by_name("dflash-lab/tiny-branches").experiment_id
    runs = {r.info.run_name: r for r in client.search_runs([experiment])}
    trunks_of = {
        "tiny-branches-trial-2": "tiny-branches-trial-0",
        "tiny-branches-trial-3": "tiny-branches-trial-1",
        **{f"tiny-branches-baseline-dflash-seed{s}": f"tiny-branches-baseline-dflash-seed{s}-steps8" for s in (0, 1)},
    }
    for branch, trunk in trunks_of.items():
        assert runs[trunk].data.params["train.max_steps"] == "8" and runs[trunk].data.params["train.branches"] == "[4]"
        assert (e2e_workdir / "runs" / trunk / "stable-step3.pt").exists()
        params = runs[branch].data.params
        assert (
            params["train.max_steps"] == "4" and params["train.branch_of"] == trunk and params["train.branches"] == "[]"
        )
        history = client.get_metric_history(runs[branch].info.run_id, "accept/realized")
        assert [m.step for m in history] == [3, 4], branch
    assert runs["tiny-branches-trial-0"].data.params["algo.conv_kernel_size"] == "1"
    assert runs["tiny-branches-trial-2"].data.params["algo.conv_kernel_size"] == "1"
    assert "deferred" not in done.stdout, "one launcher trains each trunk before its branches"
    report = (e2e_workdir / "reports" / "tiny-branches" / "README.md").read_text()
    assert "4 steps per run, and the design again at 8 steps" in report and "## Budget transfer" in report

    again = launch_study(BRANCHES, e2e_workdir, cwd=tmp_path)
    assert again.returncode == 0 and "[trial" not in again.stdout and "[baseline" not in again.stdout


KNOBS = Path(__file__).parent / "data" / "tiny_knobs.yaml"


def test_a_study_sweeps_its_data_mixture_each_on_its_own_workspace_validated_on_the_same_conversations(
    e2e_workspace, e2e_workdir, tmp_path
):
    """`dataset` in a search space: each trial trains on its own mixture's documents and features, and every one is
    validated on the same held-out chitchat conversations (`validation_data`), so the sweep compares like for
    like; the report names the mixture as a knob that differs."""
    recipes = e2e_workdir / "recipes.jsonl"  # one path whichever session reuses the work directory
    lines = [
        {
            "messages": [
                {"role": "user", "content": f"How long do I bake loaf {i}?"},
                {
                    "role": "assistant",
                    "content": f"Bake loaf {i} for {20 + i} minutes at 200 degrees, then let it cool.",
                },
            ]
        }
        for i in range(20)
    ]
    recipes.write_text("".join(json.dumps(line) + "\n" for line in lines))
    study = yaml.safe_load(KNOBS.read_text())
    study["name"] = "tiny-data"
    study["base"]["data"] = {
        **study["base"]["data"],
        "num_conversations": 24,
        "num_validation": 6,
        "regenerate": False,  # chitchat's and the file's own replies: no target decoding in this test
        "validation_data": "chitchat",
    }
    mixtures = ["chitchat", f"chitchat:1+{recipes}:1"]
    study["search_space"] = {"dataset": mixtures}
    study["budget"] = {"n_trials": 2, "steps_per_trial": 2}
    study["baselines"] = []
    study_file = tmp_path / "tiny_data.yaml"
    study_file.write_text(yaml.safe_dump(study))
    done = launch_study(study_file, e2e_workdir, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    client = mlflow.MlflowClient(tracking.tracking_uri(e2e_workdir))
    experiment = client.get_experiment_by_name("dflash-lab/tiny-data").experiment_id
    trials = [r for r in client.search_runs([experiment]) if r.data.tags[tracking.TAG_ROLE] == tracking.ROLE_TRIAL]
    assert sorted(r.data.params["data.dataset"] for r in trials) == sorted(mixtures)
    assert all(r.info.status == "FINISHED" for r in trials)
    assert len({r.data.params["dataset_hash"] for r in trials}) == 2, "each mixture trains on its own documents"
    anchors = {r.data.metrics[f"{tracking.VAL_PREFIX}num_anchors"] for r in trials}
    assert len(anchors) == 1, f"every mixture validated on the same conversations: {anchors}"
    report = (e2e_workdir / "reports" / "tiny-data" / "README.md").read_text()
    assert "Knobs that differ between runs (each a column below): `dataset`" in report


def test_a_study_sweeps_block_size_depth_and_learning_rate(e2e_workspace, e2e_workdir, tmp_path):
    """Shared and training knobs in a search space: each trial's runs train with the sampled block size, draft
    layers and learning rate (MLflow params), and the report names the knobs that differ, shows each as a
    leaderboard column and a knob effect, and no longer lists them as pinned."""
    done = launch_study(KNOBS, e2e_workdir, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    client = mlflow.MlflowClient(tracking.tracking_uri(e2e_workdir))
    experiment = client.get_experiment_by_name("dflash-lab/tiny-knobs").experiment_id
    trials = [r for r in client.search_runs([experiment]) if r.data.tags[tracking.TAG_ROLE] == tracking.ROLE_TRIAL]
    assert len(trials) == 3 and all(r.info.status == "FINISHED" for r in trials)
    for run in trials:
        params = run.data.params
        assert params["shared.block_size"] in {"4", "6"} and params["shared.num_draft_layers"] in {"1", "3"}
        assert params["train.learning_rate"] in {"0.001", "0.01"}
    sizes = {r.data.params["shared.num_draft_layers"]: int(r.data.params["draft_parameters"]) for r in trials}
    assert len(sizes) < 2 or sizes["3"] > sizes["1"], "the sampled depth is the trained draft's"
    report = (e2e_workdir / "reports" / "tiny-knobs" / "README.md").read_text()
    assert (
        "Knobs that differ between runs (each a column below): `block_size`, `num_draft_layers`, `learning_rate`"
        in (report)
    )
    pinned = report.split("Shared knobs pinned for every trial and baseline:")[1].split("\n\n")[1]
    assert "| block_size |" not in pinned and "| num_draft_layers |" not in pinned and "| max_anchors | 8 |" in pinned
    columns = next(line for line in report.split("## Leaderboard")[1].splitlines() if line.startswith("| run |"))
    assert "| block_size | num_draft_layers | learning_rate |" in columns
    for knob in ("block_size", "num_draft_layers", "learning_rate"):
        assert f"**{knob}**: effect" in report
