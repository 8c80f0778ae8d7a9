"""Data-parallel training under torchrun (gloo, 2 CPU ranks) on the embedded target and real data."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from harness import features, tracking
from harness.config import RunConfig
from harness.run import RUN_FILE, Run, runs_root
from harness.train import prepare_workspace, train

from conftest import e2e_run_config, link_caches

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parent.parent
HELPER = ROOT / "tests" / "helpers" / "patched_cli.py"
EQUAL = 1e-5  # relative: float32 sums in another order, over 10 optimizer steps
STEPS = 10
FINAL_METRICS = (
    tracking.VAL_PREFIX,
    tracking.ACCEPT_PREFIX,
    tracking.SE_PREFIX,
)  # val/*_s and val/draft_step_ms are timings
TIMINGS = ("val/final_validation_s", "val/draft_step_ms")


def dflash_lab(workdir: Path, *args: str, ranks: int = 1, timeout: float = 420, **env: str):
    """`dflash-lab <args>` in `workdir` as `ranks` torchrun ranks (one plain process for 1), with a test fault."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    command = [*(launcher if ranks > 1 else [sys.executable]), str(HELPER), *args, "--workdir", str(workdir)]
    environment = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks)), **env}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=environment)


def train_args(config: Path, name: str, *more: str) -> list[str]:
    return ["train", "--config", str(config), "--run-name", name, *more]


@pytest.fixture(scope="module")
def shared(e2e_workspace, e2e_workdir, tmp_path_factory):
    """A work directory reusing the session's target, data and feature cache, and the fp32 DFlash2 config."""
    workdir = tmp_path_factory.mktemp("distributed")
    link_caches(workdir, e2e_workdir)
    config = workdir / "config.yaml"
    # 16 anchors per row: with 8, the 1- and 2-rank losses differ by 4e-5 (fewer terms in each float32 mean)
    run_config = e2e_run_config(
        "dflash2", max_anchors=16, max_steps=STEPS, eval_every=5, checkpoint_every=3, precision="fp32"
    )
    config.write_text(yaml.safe_dump(run_config.to_dict()))
    return workdir, config


def history(workdir: Path, name: str) -> dict[str, dict[int, list[float]]]:
    """Every metric's values per step of run `name` (a list, so a duplicated step shows)."""
    client = tracking.client(workdir)
    run = client.get_run(Run(workdir, name).recorded_run_id())
    series: dict[str, dict[int, list[float]]] = {}
    for key in run.data.metrics:
        for point in client.get_metric_history(run.info.run_id, key):
            series.setdefault(key, {}).setdefault(point.step, []).append(point.value)
    return series


def relative_gap(a: dict[int, list[float]], b: dict[int, list[float]]) -> float:
    assert a.keys() == b.keys()
    return max(abs(a[s][-1] - b[s][-1]) / max(abs(a[s][-1]), 1e-12) for s in a)


@pytest.fixture(scope="module")
def one_rank(shared, e2e_workspace):
    """The reference: the same config trained by one plain process (this one)."""
    workdir, config = shared
    run_config = RunConfig.from_dict(yaml.safe_load(config.read_text()))
    train(run_config, dataclasses.replace(e2e_workspace, workdir=workdir), run_name="one-rank")
    return history(workdir, "one-rank")


def test_two_ranks_train_like_one_in_one_run(shared, one_rank, tmp_path):
    workdir, config = shared
    link_caches(tmp_path, workdir)
    command = [sys.executable, "-m", "harness.cli", *train_args(config, "two-ranks"), "--workdir", str(tmp_path)]
    done = subprocess.run([*command, "--nproc-per-node", "2"], capture_output=True, text=True, timeout=420, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]  # the CLI relaunched itself under torchrun
    two = history(tmp_path, "two-ranks")
    assert sorted(two["train/loss"]) == list(range(1, STEPS + 1))
    assert relative_gap(one_rank["train/loss"], two["train/loss"]) < EQUAL
    final = [k for k, series in two.items() if k.startswith(FINAL_METRICS) and STEPS in series and k not in TIMINGS]
    assert len(final) > 30 and "accept/realized" in final and "se/accept/realized" in final
    for key in final:
        assert relative_gap({STEPS: one_rank[key][STEPS]}, {STEPS: two[key][STEPS]}) < EQUAL, key
    assert two["val/num_anchors"][STEPS] == one_rank["val/num_anchors"][STEPS]
    # before any step both measure the same weights: the 2-rank validation is the 1-rank one, to rounding
    untrained = [k for k, series in two.items() if k.startswith(FINAL_METRICS) and 0 in series and k not in TIMINGS]
    assert len(untrained) > 30
    for key in untrained:
        assert relative_gap({0: one_rank[key][0]}, {0: two[key][0]}) < 1e-12, key
    # one run: one run directory, one MLflow run, made by rank 0
    assert [path.name for path in runs_root(tmp_path).iterdir()] == ["two-ranks"]
    client = tracking.client(tmp_path)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.run_name for r in runs] == ["two-ranks"]
    assert runs[0].data.tags[tracking.TAG_WORLD_SIZE] == "2" and runs[0].info.status == "FINISHED"
    assert runs[0].data.tags[tracking.TAG_COMPUTES_IN] == "fp32"  # train.precision fp32


def test_resume_across_world_sizes_continues_the_same_run(shared, one_rank):
    """2 ranks killed after the step-3 checkpoint, resumed by 1 rank, killed after step 6, resumed by 2."""
    workdir, config = shared
    name = "changes-world-size"
    legs = [(2, "5"), (1, "8"), (2, None)]
    run_ids = []
    for ranks, kill_at in legs:
        fault = {"FAULT_RANK": "0", "FAULT_STEP": kill_at, "FAULT_KIND": "kill"} if kill_at else {}
        resume = ["--resume"] if run_ids else []
        done = dflash_lab(workdir, *train_args(config, name, *resume), ranks=ranks, **fault)
        assert (done.returncode == 0) == (kill_at is None), done.stderr[-3000:]
        run_ids.append(json.loads((runs_root(workdir) / name / RUN_FILE).read_text())["run_id"])
    assert len(set(run_ids)) == 1
    resumed = history(workdir, name)
    assert all(len(values) == 1 for series in resumed.values() for values in series.values())  # no step twice
    assert sorted(resumed["train/loss"]) == list(range(1, STEPS + 1))
    assert relative_gap(one_rank["train/loss"], resumed["train/loss"]) < EQUAL
    run = tracking.client(workdir).get_run(run_ids[0])
    assert run.info.status == "FINISHED" and run.data.tags[tracking.TAG_WORLD_SIZE] == "2"


@pytest.mark.parametrize("kind", ["raise", "hang"])
def test_a_lost_rank_fails_the_run_with_a_recorded_reason(shared, tmp_path, kind):
    """A rank that raises, or one that stops answering (the collective timeout, 20 s here, ends the wait)."""
    workdir, config = shared
    link_caches(tmp_path, workdir)
    started = time.monotonic()
    done = dflash_lab(
        tmp_path,
        *train_args(config, "lost-rank", "--collective-timeout", "20"),
        ranks=2,
        FAULT_RANK="1",
        FAULT_STEP="2",
        FAULT_KIND=kind,
        timeout=300,
    )
    elapsed = time.monotonic() - started
    assert done.returncode != 0
    assert kind != "raise" or "injected fault on rank 1 at step 2" in done.stderr
    assert elapsed < 180  # ends, not hangs
    run = tracking.client(tmp_path).get_run(Run(tmp_path, "lost-rank").recorded_run_id())
    assert run.info.status == "FAILED"
    assert run.data.tags[tracking.TAG_STATUS] == "failed"
    reason = run.data.tags[tracking.TAG_STATUS_REASON]
    assert kind != "hang" or "timed out" in reason.lower() or "timeout" in reason.lower(), reason


def test_parallel_extraction_writes_the_same_cache(shared, tmp_path, monkeypatch):
    """`prepare` on 2 ranks against one process (this one), with 8 documents per shard so each rank writes some."""
    workdir, config = shared
    caches = {}
    for ranks in (1, 2):
        place = tmp_path / f"ranks{ranks}"
        place.mkdir()
        for cache in ("targets", "data"):
            (place / cache).symlink_to(workdir / cache)
        if ranks == 1:
            monkeypatch.setattr(features, "DOCS_PER_SHARD", 8)
            prepare_workspace(RunConfig.from_dict(yaml.safe_load(config.read_text())), place)
        else:
            done = dflash_lab(place, "prepare", "--config", str(config), ranks=ranks, DOCS_PER_SHARD="8")
            assert done.returncode == 0, done.stderr[-3000:]
        (cache,) = (place / "features").iterdir()
        caches[ranks] = (cache.name, json.loads((cache / "manifest.json").read_text()))
    (key_one, one), (key_two, two) = caches[1], caches[2]
    assert key_one == key_two  # the cache key does not depend on the world size
    assert len(one["shards"]) > 2 and one == two  # every shard's bytes and sha256 equal


def test_a_study_runs_each_trial_as_a_torchrun_job(e2e_workspace, e2e_workdir, tmp_path):
    """`train.nproc_per_node: 2`: the trial runs on 2 ranks; rank 0 reports to the Optuna trial."""
    import optuna

    from studies.storage import ATTR_RUN_ID, storage_url

    text = (ROOT / "tests" / "data" / "tiny_study.yaml").read_text()
    for old, new in {
        "name: tiny": "name: ranked",
        "train: {": "train: {nproc_per_node: 2, ",
        "conv_group_size: [16, 7]": "conv_group_size: [16]",
        "selector_rank: [8, 16]": "selector_rank: [8]",
        "n_trials: 4": "n_trials: 1",
        "baselines: [dflash, dflash2_defaults]": "baselines: []",
        "best_trials: 1": "best_trials: 0",
    }.items():
        assert old in text
        text = text.replace(old, new)
    study_file = tmp_path / "ranked.yaml"
    study_file.write_text(text)
    done = subprocess.run(
        [sys.executable, "-m", "harness.cli", "study", "launch", str(study_file), "--workdir", str(e2e_workdir)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (trial,) = optuna.load_study(study_name="ranked", storage=storage_url(e2e_workdir, None)).trials
    assert trial.state == optuna.trial.TrialState.COMPLETE
    assert sorted(trial.intermediate_values) == [2, 4]  # reported by rank 0 of the torchrun job
    client = tracking.client(e2e_workdir)
    run = client.get_run(trial.user_attrs[ATTR_RUN_ID])
    assert run.data.tags[tracking.TAG_WORLD_SIZE] == "2" and run.info.status == "FINISHED"
    assert trial.value == run.data.metrics["accept/realized"]
    children = client.search_runs(
        [run.info.experiment_id], filter_string=f"tags.{tracking.TAG_ROLE} != '{tracking.ROLE_STUDY}'"
    )
    assert [r.info.run_id for r in children] == [run.info.run_id]  # one MLflow run for the 2-rank trial
    assert not list(e2e_workdir.glob(".torchrun-job-*")), "job files are removed"


def test_the_launcher_records_a_preempted_job_interrupted_and_a_killed_rank_0_failed(shared, tmp_path):
    """`train --nproc-per-node 2` as real processes with real signals, in one run: SIGTERM to the launcher stops
    the job (exit 143, one line, the run `interrupted`); the resumed job loses rank 0 to SIGKILL, which rank 0
    cannot record, so the launcher records `failed: rank 0 lost` in one line; the second resume finishes the
    same MLflow run with every step logged once."""
    import signal

    import psutil

    workdir, config = shared
    link_caches(tmp_path, workdir)
    args = [
        str(Path(sys.executable).parent / "dflash-lab"),
        *train_args(config, "rank0-lost", "--nproc-per-node", "2", "--workdir", str(tmp_path)),
    ]
    checkpoint = runs_root(tmp_path) / "rank0-lost" / "checkpoint.pt"

    def launch_then(signal_target, *more: str) -> tuple[int, str, int]:
        """Launch, wait for a checkpoint newer than the last one, signal; (exit status, stderr, its step)."""
        seen = checkpoint.stat().st_mtime if checkpoint.exists() else 0.0
        launcher = subprocess.Popen([*args, *more], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 300
        while time.time() < deadline and launcher.poll() is None:
            if checkpoint.exists() and checkpoint.stat().st_mtime > seen:
                break
            time.sleep(0.1)
        signal_target(launcher)
        _, stderr = launcher.communicate(timeout=180)
        assert "Traceback" not in stderr and "ChildFailedError" not in stderr, stderr[-3000:]
        return launcher.returncode, stderr, json.loads((runs_root(tmp_path) / "rank0-lost" / RUN_FILE).read_text())

    def rank0(launcher):
        ranks = [
            child
            for child in psutil.Process(launcher.pid).children(recursive=True)
            if child.environ().get("RANK") == "0" and "harness.cli" in child.cmdline()
        ]
        assert len(ranks) == 1, "rank 0 must be running when it is killed"
        ranks[0].send_signal(signal.SIGKILL)

    status, stderr, record = launch_then(lambda launcher: launcher.send_signal(signal.SIGTERM))
    # A dead rank's progress bar may end without a newline, so each error is read from where it starts.
    assert status == 143 and re.findall(r"error:.*", stderr)[-1].startswith("error: terminated (SIGTERM)"), stderr
    run = tracking.client(tmp_path).get_run(record["run_id"])
    assert (
        run.data.tags[tracking.TAG_STATUS] == "interrupted" and "SIGTERM" in run.data.tags[tracking.TAG_STATUS_REASON]
    )

    status, stderr, record = launch_then(rank0, "--resume")
    assert status == 2 and re.findall(r"error:.*", stderr) == [
        "error: rank 0 lost (killed by SIGKILL); its run 'rank0-lost' is recorded failed "
        "(`--resume` continues it from its last checkpoint)"
    ], stderr[-3000:]
    run = tracking.client(tmp_path).get_run(record["run_id"])
    assert run.info.status == "FAILED" and run.data.tags[tracking.TAG_STATUS] == "failed"
    assert run.data.tags[tracking.TAG_STATUS_REASON] == "rank 0 lost (killed by SIGKILL)"
    assert not list(tmp_path.glob(".rank-failure-*")) and not list(tmp_path.glob(".launched-run-*"))

    resumed = subprocess.run([*args, "--resume"], capture_output=True, text=True, timeout=420, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run = tracking.client(tmp_path).get_run(record["run_id"])
    assert run.info.status == "FINISHED" and tracking.TAG_STATUS_REASON not in run.data.tags
    assert sorted(history(tmp_path, "rank0-lost")["train/loss"]) == list(range(1, STEPS + 1))
