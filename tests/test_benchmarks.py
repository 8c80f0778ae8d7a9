"""CI runs the benchmarks only as a smoke test: they still run, and parity with speculators still holds."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("speculators", reason="speculators==0.9.0 is not installed (.ci/run installs it with --no-deps)")
pytestmark = pytest.mark.peer


def test_train_step_benchmark_smoke():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.train_step", "--smoke"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).parent.parent,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert {r["algorithm"] for r in records} == {"dflash", "dflash2"}
    for record in records:
        assert record["loss_relative_difference"] < 1e-3
        assert record["ours_median_ms"] > 0 and record["theirs_median_ms"] > 0 and record["ours_peak_mib"] > 0
        assert record["theirs_configuration"].startswith("sdpa, eager losses, eager") and not record["theirs_failures"]
