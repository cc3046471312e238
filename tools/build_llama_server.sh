#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` for the side-by-side benchmark (tools/bench_compare.py).
#
#   bash tools/build_llama_server.sh     # prints the binary's path; idempotent
#
# The llama.cpp sources come from the llama-cpp-python 0.3.36 sdist, so the server runs
# the same kernels as model_runtime and nothing else is downloaded. The build takes about
# 6 minutes on 2 cores; when the binary exists the script only prints its path.
# Not part of setup or CI: only the benchmark's llama-server arm needs it.
#
# Environment:
#   LLAMA_SERVER_DIR  work folder (default ~/.cache/kvcache-bench/llama-server)
#   JOBS              parallel compile jobs (default 2)
#   EXTRA_CMAKE_ARGS  more cmake options, e.g. "-DGGML_LLAMAFILE=OFF -DGGML_CPU_REPACK=OFF"
#                     for the kernels model_runtime is built with (tools/setup.sh); give
#                     such a build its own LLAMA_SERVER_DIR
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.3.36
WORK=${LLAMA_SERVER_DIR:-$HOME/.cache/kvcache-bench/llama-server}
JOBS=${JOBS:-2}
PYTHON=${PYTHON:-.venv/bin/python}
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
BINARY="$SRC/build/bin/llama-server"

if [ -x "$BINARY" ]; then
  echo "$BINARY"
  exit 0
fi

# cmake is the one system tool the build needs beyond a C++ compiler.
if ! command -v cmake >/dev/null 2>&1; then
  apt-get update >&2
  apt-get install -y cmake >&2
fi

mkdir -p "$WORK"
SDIST="$WORK/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" --dest "$WORK" >&2
fi
if [ ! -d "$SRC" ]; then
  tar -xzf "$SDIST" -C "$WORK"
fi

# No CURL/OpenSSL: the server loads a local file and listens on loopback only.
cmake -S "$SRC" -B "$SRC/build" \
  -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DGGML_NATIVE=ON ${EXTRA_CMAKE_ARGS:-} >&2
cmake --build "$SRC/build" --target llama-server -j "$JOBS" >&2

if [ ! -x "$BINARY" ]; then
  echo "build finished but $BINARY is missing" >&2
  exit 1
fi
echo "$BINARY"
