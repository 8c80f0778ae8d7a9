"""Atomic writes leave nothing behind, and an export never destroys what it did not write."""

import pytest

from harness.export import ExportDestinationError, check_destination
from harness.files import atomic_write


def test_atomic_write_replaces_a_directory_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    atomic_write(target, lambda tmp: (tmp.mkdir(), (tmp / "new.txt").write_text("new")))
    assert [p.name for p in target.iterdir()] == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_failed_atomic_write_keeps_the_old_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("keep")

    def disk_full(tmp):
        tmp.mkdir()
        (tmp / "half.bin").write_bytes(b"x")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(target, disk_full)
    assert (target / "keep.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.fixture
def workdir(tmp_path):
    work = tmp_path / "work"
    (work / "runs" / "my-run").mkdir(parents=True)
    (work / "runs" / "my-run" / "checkpoint.pt").write_bytes(b"ckpt")
    (work / "features" / "abc").mkdir(parents=True)
    (work / "mlflow.db").write_bytes(b"db")
    return work


@pytest.mark.parametrize(
    "relative",
    ["work", ".", "work/runs", "work/runs/my-run", "work/features", "work/features/abc/x", "work/mlflow.db"],
)
def test_export_never_replaces_the_workdir_its_stores_or_runs(tmp_path, workdir, relative):
    with pytest.raises(ExportDestinationError, match=r"invalid --out=.*allowed a directory outside"):
        check_destination(tmp_path / relative, workdir, force=True)


def test_export_refuses_a_non_empty_directory_unless_forced(tmp_path, workdir):
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("keep")
    with pytest.raises(ExportDestinationError, match=r"holds \['notes.txt', 'sub'\]; pass --force"):
        check_destination(out, workdir, force=False)
    check_destination(out, workdir, force=True)


def test_export_replaces_a_previous_export_and_writes_the_default_place(tmp_path, workdir):
    previous = tmp_path / "previous"
    previous.mkdir()
    (previous / "config.json").write_text("{}")
    (previous / "model.safetensors").write_bytes(b"")
    check_destination(previous, workdir, force=False)
    check_destination(workdir / "runs" / "my-run" / "export", workdir, force=False)
    check_destination(tmp_path / "fresh", workdir, force=False)


def test_stale_temporaries_of_dead_processes_are_removed_and_live_ones_kept(tmp_path):
    import os
    import subprocess
    import sys

    from harness.files import remove_stale_temporaries

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    (tmp_path / f"abc.tmp{dead_pid}").mkdir()
    (tmp_path / f"abc.tmp{dead_pid}" / "shard.safetensors").write_bytes(b"x" * 10)
    (tmp_path / f"doc.json.tmp{dead_pid}").write_text("{}")
    (tmp_path / f"mine.tmp{os.getpid()}").mkdir()
    (tmp_path / "abc").mkdir()
    removed = remove_stale_temporaries(tmp_path)
    assert sorted(p.name for p in removed) == sorted([f"abc.tmp{dead_pid}", f"doc.json.tmp{dead_pid}"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["abc", f"mine.tmp{os.getpid()}"])
