#!/usr/bin/env bash
# Build llama.cpp's llama-server for the CPU from the source pinned below, prove that it serves a quantized model
# on this machine, and install its GGUF converter's Python need (sentencepiece) into ./.venv. Called by
# scripts/setup.sh (and so by .ci/run).
#
# The source is the llama.cpp tree vendored in the llama-cpp-python 0.3.36 sdist on the package index (downloaded
# by version, or taken from LLAMA_CPP_SDIST on a machine without the index, and checked by hash). The build lands
# in ${DFLASH_LAB_CACHE:-~/.cache/dflash-lab}/llama.cpp/<commit>, stamped with a COMMIT file written only after the
# server linked and served: a second run finds a stamped build and builds nothing; a build cut short (Ctrl-C, a
# kill) has no stamp and is finished on the next run (its half-linked binary removed first). Nothing is downloaded
# at run time: the server's prebuilt web UI (fetched by llama.cpp's CMake from a hub by default) is switched off.
#
# The proof (python -m harness.serving.proof): the server loads the shipped Q4_1 target and decodes a few tokens. A
# native build can die there by a signal (SIGILL: a CPU that advertises AMX whose tile instructions then fault):
# the build is then redone without AMX, then also without AVX-512, and the instruction sets left out are recorded
# in CPU_FLAGS beside COMMIT. A cached build is proven again on every run, and rebuilt if it fails.
set -euo pipefail
cd "$(dirname "$0")/.."
SDIST_VERSION=0.3.36
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
COMMIT=0c1e57098bba43ac29e6e3b677cdceebdd22334f # llama.cpp, as vendored in that sdist
ROOT="${DFLASH_LAB_CACHE:-$HOME/.cache/dflash-lab}/llama.cpp/${COMMIT:0:9}"
PY=.venv/bin/python
PIP="$PY -m pip --disable-pip-version-check -q"
# The compiler flags of each build to try, in order, and what each leaves out of the native instruction sets.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
FLAG_SETS=("" "$NO_AMX" "$NO_AMX -mno-avx512f")
LEFT_OUT=("nothing" "AMX" "AMX and AVX-512")
started=$(date +%s)

built() { [ "$(cat "$ROOT/COMMIT" 2>/dev/null)" = "$COMMIT" ] && [ -x "$ROOT/build/bin/llama-server" ]; }

# The sdist's llama.cpp tree in $ROOT/src, once: a rebuild with other flags reuses it.
fetch_source() {
  [ "$(cat "$ROOT/src/.sdist-sha256" 2>/dev/null)" = "$SDIST_SHA256" ] && return
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  archive="${LLAMA_CPP_SDIST:-$work/llama_cpp_python-$SDIST_VERSION.tar.gz}"
  [ -n "${LLAMA_CPP_SDIST:-}" ] || $PIP download --no-deps --no-binary :all: "llama-cpp-python==$SDIST_VERSION" -d "$work"
  if ! echo "$SDIST_SHA256  $archive" | sha256sum --check --quiet >/dev/null 2>&1; then
    echo "error: $archive is not the llama-cpp-python $SDIST_VERSION sdist (SHA-256 differs)" >&2
    exit 1
  fi
  tar -xzf "$archive" -C "$work"
  mkdir -p "$ROOT"
  rm -rf "$ROOT/src"
  mv "$work/llama_cpp_python-$SDIST_VERSION/vendor/llama.cpp" "$ROOT/src"
  rm -f "$ROOT/src/.git" # a submodule pointer into the sdist's own repository, which the sdist does not ship
  echo "$SDIST_SHA256" >"$ROOT/src/.sdist-sha256"
}

# build N: the server with FLAG_SETS[N] on top of the native instruction sets.
build() {
  rm -f "$ROOT/COMMIT" "$ROOT/CPU_FLAGS" "$ROOT/build/bin/llama-server"
  fetch_source
  command -v cmake >/dev/null && command -v ninja >/dev/null || $PIP install --no-warn-conflicts cmake ninja
  local flags="${FLAG_SETS[$1]}"
  PATH="$PATH:$PWD/.venv/bin" cmake -S "$ROOT/src" -B "$ROOT/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF >"$ROOT/cmake.log"
  PATH="$PATH:$PWD/.venv/bin" cmake --build "$ROOT/build" --target llama-server -j "$(nproc)" >"$ROOT/build.log"
}

# The converter (convert_hf_to_gguf.py) needs sentencepiece; it runs with the tree's own gguf-py on its path, so
# the gguf package that loads the embedded target stays the one the project pins. (Installed first: the proof
# needs nothing of it, but a failed proof should not leave the setup without it.)
$PIP install --no-warn-conflicts sentencepiece

attempt=0
how="found (cached)"
if built; then
  recorded=$(head -n 1 "$ROOT/CPU_FLAGS" 2>/dev/null || true)
  for i in "${!FLAG_SETS[@]}"; do [ "${FLAG_SETS[$i]}" = "$recorded" ] && attempt=$i; done
else
  if [ -d "$ROOT/build" ]; then
    echo "llama.cpp ${COMMIT:0:9}: an earlier build in $ROOT did not finish (no COMMIT stamp): building it again"
  fi
  build 0
  how="built"
fi
while true; do
  status=0
  proof=$($PY -m harness.serving.proof "$ROOT") || status=$?
  [ "$status" -eq 0 ] && break
  if [ "$status" -ne 3 ]; then
    echo "error: llama.cpp ${COMMIT:0:9} in $ROOT does not serve the shipped Q4_1 target: $proof" >&2
    exit 1
  fi
  if [ $((attempt + 1)) -ge "${#FLAG_SETS[@]}" ]; then
    echo "error: llama-server dies by $proof on this CPU even without ${LEFT_OUT[$attempt]} (log: $ROOT/proof/server.log)" >&2
    exit 1
  fi
  attempt=$((attempt + 1))
  echo "llama.cpp ${COMMIT:0:9}: llama-server died by $proof serving a quantized model; rebuilding without ${LEFT_OUT[$attempt]}"
  build "$attempt"
  how="built without ${LEFT_OUT[$attempt]}"
done
printf '%s\n%s\n' "${FLAG_SETS[$attempt]}" "left out: ${LEFT_OUT[$attempt]}" >"$ROOT/CPU_FLAGS"
echo "$COMMIT" >"$ROOT/COMMIT"
echo "llama.cpp ${COMMIT:0:9}: llama-server $how in $ROOT, serves a quantized model ($(($(date +%s) - started)) s, $(du -sh "$ROOT" | cut -f1))"
