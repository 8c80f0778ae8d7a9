"""The trained run a benchmark's `--run` names."""

from __future__ import annotations

from pathlib import Path

from harness.run import Run
from harness.train import TrainedRun


def load_run(name: str, workdir: Path) -> TrainedRun:
    """A benchmark's `--run`, refused in one line when it names no trained run."""
    try:
        return TrainedRun.load(Run.locate(name, workdir))
    except FileNotFoundError as error:
        raise SystemExit(f"error: invalid --run={name!r}: {error}") from None
