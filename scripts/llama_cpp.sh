#!/usr/bin/env bash
# Build llama.cpp's llama-server for the CPU from the source pinned below, once per commit, and install its GGUF
# converter's Python need (sentencepiece) into ./.venv. Called by scripts/setup.sh (and so by .ci/run).
#
# The source is the llama.cpp tree vendored in the llama-cpp-python 0.3.36 sdist on the package index (downloaded
# by version, or taken from LLAMA_CPP_SDIST on a machine without the index, and checked by hash). The build lands
# in ${DFLASH_LAB_CACHE:-~/.cache/dflash-lab}/llama.cpp/<commit>, stamped with a COMMIT file written only after the
# server linked: a second run finds a stamped build and builds nothing; a build cut short (Ctrl-C, a kill) has no
# stamp and is finished on the next run (its half-linked binary removed first). Nothing is downloaded at run time:
# the server's prebuilt web UI (fetched by llama.cpp's CMake from a hub by default) is switched off.
set -euo pipefail
cd "$(dirname "$0")/.."
SDIST_VERSION=0.3.36
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
COMMIT=0c1e57098bba43ac29e6e3b677cdceebdd22334f # llama.cpp, as vendored in that sdist
ROOT="${DFLASH_LAB_CACHE:-$HOME/.cache/dflash-lab}/llama.cpp/${COMMIT:0:9}"
PY=.venv/bin/python
PIP="$PY -m pip --disable-pip-version-check -q"
started=$(date +%s)

built() { [ "$(cat "$ROOT/COMMIT" 2>/dev/null)" = "$COMMIT" ] && [ -x "$ROOT/build/bin/llama-server" ]; }

if ! built; then
  if [ -d "$ROOT" ]; then
    echo "llama.cpp ${COMMIT:0:9}: an earlier build in $ROOT did not finish (no COMMIT stamp): building it again"
  fi
  rm -f "$ROOT/COMMIT" "$ROOT/build/bin/llama-server"
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
  command -v cmake >/dev/null && command -v ninja >/dev/null || $PIP install --no-warn-conflicts cmake ninja
  PATH="$PWD/.venv/bin:$PATH"
  cmake -S "$ROOT/src" -B "$ROOT/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF >"$ROOT/cmake.log"
  cmake --build "$ROOT/build" --target llama-server -j "$(nproc)" >"$ROOT/build.log"
  echo "$COMMIT" >"$ROOT/COMMIT"
  built="built"
else
  built="found (cached)"
fi

# The converter (convert_hf_to_gguf.py) needs sentencepiece; it runs with the tree's own gguf-py on its path, so
# the gguf package that loads the embedded target stays the one the project pins.
$PIP install --no-warn-conflicts sentencepiece
echo "llama.cpp ${COMMIT:0:9}: llama-server $built in $ROOT ($(($(date +%s) - started)) s, $(du -sh "$ROOT" | cut -f1))"
