#!/usr/bin/env bash
# Time `.ci/run` on a clean clone as it would run on the other CPU kind, without one: a CPU with no native bf16.
#   - /proc/cpuinfo loses its avx512_bf16/amx_bf16 flags (a bind mount in a private mount namespace), so
#     `auto` computes in fp32 exactly as it would there; nothing in the code is patched;
#   - torch's and oneDNN's kernels are capped at AVX2 (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA), the ISA of the
#     AVX2-only AMD EPYC that CI has drawn;
#   - with --cpus N, the run gets N CPUs' worth of time (a cgroup v1 or v2 CPU quota): that machine was also
#     slower per core, and a quota stands in for it. Compare the result's pytest time with a native run's.
#   - with --fresh-engine, llama.cpp is built again into an empty cache, as on a fresh CI machine.
# Needs root (mount namespace, cgroups). Usage: bash benchmarks/project/ci_time_fp32.sh [--cpus 0.98] [--fresh-engine]
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
CPUS=""
CPUS_GIVEN=0
QUOTA=""
FRESH=0
while [ $# -gt 0 ]; do
  case "$1" in
    --cpus) CPUS="${2:-}"; CPUS_GIVEN=1; shift $(($# > 1 ? 2 : 1)) ;;
    --fresh-engine) FRESH=1; shift ;;
    -h | --help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "error: unknown argument $1: allowed --cpus N, --fresh-engine" >&2; exit 2 ;;
  esac
done
if [ "$CPUS_GIVEN" = 1 ]; then
  QUOTA=$(awk -v cpus="$CPUS" 'BEGIN { if (cpus ~ /^[0-9]*\.?[0-9]+$/ && cpus > 0) printf "%d", cpus * 100000 }')
  [ -n "$QUOTA" ] || { echo "error: invalid --cpus=${CPUS@Q}: allowed a number of CPUs above 0, like 0.98" >&2; exit 2; }
fi
[ "$(id -u)" = 0 ] || { echo "error: needs root (a mount namespace and a cgroup)" >&2; exit 2; }
WORK=$(mktemp -d /tmp/ci-fp32.XXXX)
git clone -q "$REPO" "$WORK/clone"
sed -E 's/ (avx512_bf16|amx_bf16)//g' /proc/cpuinfo > "$WORK/cpuinfo"

if [ -n "$QUOTA" ]; then
  if [ -d /sys/fs/cgroup/cpu ]; then # cgroup v1
    GROUP=/sys/fs/cgroup/cpu/ci-fp32-$$ && mkdir "$GROUP" && echo "$QUOTA" > "$GROUP/cpu.cfs_quota_us"
  else # cgroup v2
    GROUP=/sys/fs/cgroup/ci-fp32-$$ && mkdir "$GROUP" && echo "$QUOTA 100000" > "$GROUP/cpu.max"
  fi
  echo $$ > "$GROUP/cgroup.procs" # this shell and everything it starts from here on
  trap 'echo $$ > "$(dirname "$GROUP")/cgroup.procs"; rmdir "$GROUP"' EXIT # leave the group, then remove it
fi
export CI=true ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
[ "$FRESH" = 1 ] && export DFLASH_LAB_CACHE="$WORK/cache"
echo "clone of $(git -C "$WORK/clone" rev-parse --short HEAD) in $WORK; cpus ${CPUS:-all}; fresh engine: $FRESH"
unshare -m bash -c "mount --bind '$WORK/cpuinfo' /proc/cpuinfo && cd '$WORK/clone' && /usr/bin/time -v bash .ci/run" \
  2>&1 | tee "$WORK/ci.log" | grep -E "built in|passed|failed|Elapsed|Maximum resident" || true
echo "log: $WORK/ci.log"
