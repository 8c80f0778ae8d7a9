"""Refuse before working: a read-only work directory or store, duplicate YAML keys, unknown names that must
create nothing, Optuna's stack on a stopped trial, and a zero-width difference that is not noise."""

import io
import logging
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from harness.uncertainty import Estimate

from conftest import one_line


def writable(path: Path) -> bool:
    try:
        if path.is_dir():
            tempfile.TemporaryFile(dir=path).close()
        else:
            open(path, "r+b").close()
    except OSError:
        return False
    return True


@pytest.fixture
def read_only():
    """Make a folder or file read-only for this test: by its mode, or where the tests run as root (whom modes do
    not stop) by the immutable attribute; skipped where neither holds."""
    made: list[Path] = []

    def make(path: Path) -> Path:
        path.chmod(0o555 if path.is_dir() else 0o444)
        made.append(path)
        if writable(path):
            subprocess.run(["chattr", "+i", str(path)], capture_output=True)
        if writable(path):
            pytest.skip("cannot make a path read-only here (root without chattr)")
        return path

    yield make
    for path in reversed(made):
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)
        path.chmod(0o755 if path.is_dir() else 0o644)


@pytest.fixture
def made(tmp_path):
    (tmp_path / "work").mkdir()
    return tmp_path / "work"


def test_train_on_a_read_only_workdir_ends_in_one_line_at_once_with_no_target_loaded(cli, read_only, made, monkeypatch):
    import harness.train

    def never(*args, **kwargs):
        raise AssertionError("the target was loaded or the data regenerated before the check")

    monkeypatch.setattr(harness.train, "_target_and_data", never)
    workdir = read_only(made)
    started = time.perf_counter()
    line = one_line(cli(["train", "--workdir", str(workdir)]))
    assert time.perf_counter() - started < 2
    assert line.startswith(f"error: invalid --workdir='{workdir}': the work directory is not writable")
    assert "pass another --workdir" in line


@pytest.mark.parametrize("command", [["evaluate", "some-run", "--engine", "llama.cpp"], ["serve", "some-run"]])
def test_serving_on_a_read_only_workdir_is_refused_before_any_conversion(cli, read_only, made, command):
    """Nothing is converted, and no partial GGUF written, into a work directory that cannot be written."""
    line = one_line(cli([*command, "--workdir", str(read_only(made))]))
    assert line.startswith(f"error: invalid --workdir='{made}': the work directory is not writable")


@pytest.mark.parametrize("command", [["evaluate", "r", "--engine", "llama.cpp"], ["serve", "r"]])
def test_serving_a_run_whose_served_folder_is_read_only_is_refused_up_front(
    cli, read_only, made, tmp_path, monkeypatch, command
):
    """The run's served folder is tried like the work directory: one line naming it, before the checkpoint loads
    (this one is not a checkpoint) and before any lock is waited for."""
    engine = tmp_path / "cache" / "llama.cpp" / "0c1e57098"
    (engine / "build" / "bin").mkdir(parents=True)
    (engine / "build" / "bin" / "llama-server").write_text("#!/bin/sh\nexit 1\n")
    (engine / "build" / "bin" / "llama-server").chmod(0o755)
    (engine / "COMMIT").write_text("0c1e57098bba43ac29e6e3b677cdceebdd22334f\n")
    monkeypatch.setenv("DFLASH_LAB_CACHE", str(tmp_path / "cache"))
    served = made / "runs" / "r" / "served"
    served.mkdir(parents=True)
    (served.parent / "checkpoint.pt").write_bytes(b"never loaded")
    read_only(served)
    started = time.perf_counter()
    line = one_line(cli([*command, "--workdir", str(made)]))
    assert time.perf_counter() - started < 2
    assert line.startswith(f"error: invalid served folder='{served}': run r's served folder is not writable")
    assert "serve from a copy of the work directory" in line


def test_study_launch_on_an_empty_read_only_workdir_names_the_workdir_not_the_storage(cli, read_only, made):
    line = one_line(cli(["study", "launch", "studies/default.yaml", "--workdir", str(read_only(made))]))
    assert "invalid --workdir=" in line and "not writable" in line and "--storage" not in line


def test_reading_commands_on_a_read_only_workdir_answer_without_a_store(cli, read_only, made):
    workdir = str(read_only(made))
    listing = cli(["study", "list", "--workdir", workdir])
    assert listing.returncode == 0 and listing.stdout.startswith("no studies in"), listing.stderr
    assert one_line(cli(["study", "status", "nope", "--workdir", workdir])).startswith("error: no study named 'nope'")
    # The report writes its files and logs them to the study's parent run: it says where it needs to write.
    assert "invalid --workdir=" in one_line(cli(["report", "nope", "--workdir", workdir]))


def test_a_read_only_store_in_a_writable_workdir_is_named(cli, read_only, made):
    store = made / "mlflow.db"
    store.write_bytes(b"")
    read_only(store)
    line = one_line(cli(["train", "--workdir", str(made)]))
    assert "the work directory is not writable" in line and str(store) in line


def test_unknown_names_create_no_stores(cli, made, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert "no study named 'nope'" in one_line(cli(["report", "nope", "--workdir", str(made)]))
    assert "no study named 'nope'" in one_line(cli(["study", "status", "nope", "--workdir", str(made)]))
    assert cli(["study", "list", "--workdir", str(made)]).returncode == 0
    assert list(made.iterdir()) == []


def test_a_duplicate_key_in_a_run_config_is_refused_with_both_lines(cli, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("train:\n  max_steps: 4\n  learning_rate: 0.001\n  max_steps: 8\n")
    line = one_line(cli(["train", "--config", str(config), "--dry-run"]))
    assert line == f"error: {config}: not valid YAML: duplicate key 'max_steps' on lines 2 and 4"
    config.write_text("train: {max_steps: 4, max_steps: 8}\n")
    assert "duplicate key 'max_steps' twice on line 1" in one_line(cli(["train", "--config", str(config), "--dry-run"]))


def test_a_duplicate_key_in_a_study_file_is_refused(cli, made):
    study = made.parent / "copied.yaml"
    text = Path("studies/default.yaml").read_text()
    study.write_text(text + "seeds: [7]\n")
    first = 1 + text.splitlines().index(next(line for line in text.splitlines() if line.startswith("seeds:")))
    last = len(text.splitlines()) + 1
    line = one_line(cli(["study", "launch", str(study), "--workdir", str(made)]))
    assert line == f"error: {study}: not valid YAML: duplicate key 'seeds' on lines {first} and {last}"


def test_yaml_merge_keys_may_still_be_overridden():
    from harness.config import parse_yaml

    assert parse_yaml("base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  x: 3\n", "f.yaml")["other"] == {"x": 3, "y": 2}


def optuna_log_of_a_stopped_trial(quiet: bool) -> str:
    """Optuna's own log of a trial that a SIGTERM stops (our Preempted), as its handler would print it."""
    import optuna

    from harness.preemption import Preempted
    from studies import runner

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("optuna")
    logger.addHandler(handler)
    trial_logger = logging.getLogger(runner.OPTUNA_TRIAL_LOGGER)
    filters = list(trial_logger.filters)
    # An earlier in-process launch in this worker leaves our filter installed: start from Optuna's own logger.
    trial_logger.filters[:] = [f for f in filters if not isinstance(f, runner.StackFreeStop)]
    try:
        if quiet:
            runner.quiet_stops_in_optuna_log()

        def objective(trial):
            raise Preempted("terminated (SIGTERM)")

        with pytest.raises(Preempted):
            optuna.create_study().optimize(objective, catch=(Exception,))
    finally:
        logger.removeHandler(handler)
        trial_logger.filters[:] = filters
    return stream.getvalue()


def test_optunas_line_for_a_stopped_trial_keeps_no_stack():
    assert "Traceback" in optuna_log_of_a_stopped_trial(quiet=False)  # what a job log showed: the whole stack
    quiet = optuna_log_of_a_stopped_trial(quiet=True)
    assert "Trial 0 failed" in quiet and "Preempted" in quiet and "Traceback" not in quiet


def test_a_zero_width_difference_is_identical_runs_not_noise():
    from reports.markdown import IDENTICAL, NOISE, verdict

    identical = verdict(Estimate(0.0, 0.0, 0.0, 0.0, 8))
    assert identical.endswith(IDENTICAL) and NOISE not in identical
    assert verdict(Estimate(0.0, 0.01, -0.02, 0.02, 8)).endswith(NOISE)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--max-steps", "60", "--lr", "0.01"], "with train.learning_rate: a branch takes every knob from the run"),
        (["--max-steps", "60", "--algorithm", "dflash"], "with --algorithm: a branch takes every knob"),
        ([], "allowed with --max-steps, the branch's budget"),
        (["--max-steps", "60"], "no run of that name in"),
    ],
)
def test_a_branch_takes_its_knobs_from_its_parent_and_refuses_others_in_one_line(cli, tmp_path, extra, message):
    line = one_line(cli(["train", "--branch-of", "trunk", *extra, "--workdir", str(tmp_path / "work")]))
    assert line.startswith("error: invalid --branch-of='trunk'") and message in line
