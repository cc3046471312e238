#!/usr/bin/env bash
# Build llama.cpp's CPU backend (libggml-cpu) in the two kernel sets the runtime chooses
# from at start-up (model-runtime --kernels, README "Kernels"):
#
#   bash tools/build_kernels.sh        # idempotent; tools/setup.sh runs it
#
#   deterministic  llamafile's tinyBLAS for every float product, single tokens included
#                  (tools/patches/ggml-llamafile-batch-invariant.patch; a single token's
#                  products dealt to the threads without a shared counter or barriers:
#                  tools/patches/ggml-llamafile-single-column.patch), flash attention
#                  by its vec-only path alone (tools/patches/ggml-flash-attn-batch-invariant.patch),
#                  no weight repacking: a token is computed alike alone or anywhere in a
#                  batch, so warm equals cold; the default.
#   fast           llama.cpp's own defaults (llamafile as shipped, weight repacking): what
#                  llama-server runs; a reused state may continue otherwise than a cold run.
#
# Only ggml (its base and CPU libraries) is compiled, from the llama.cpp sources in the
# llama-cpp-python sdist of the installed version (about 40 s a set on 2 cores); each set
# is a folder of the installed llama-cpp-python's libraries with its own libggml-cpu, in
# $VENV/kvcache-kernels/<set>, which the runtime loads through LLAMA_CPP_LIB_PATH.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON="$VENV/bin/python"
JOBS=${JOBS:-2}
PATCHES=("$PWD/tools/patches/ggml-llamafile-batch-invariant.patch"
         "$PWD/tools/patches/ggml-flash-attn-batch-invariant.patch"
         "$PWD/tools/patches/ggml-llamafile-single-column.patch")
DEST="$VENV/kvcache-kernels"

VERSION=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))')
LIB=$("$PYTHON" -c 'import importlib.util, pathlib
print(pathlib.Path(importlib.util.find_spec("llama_cpp").origin).parent / "lib")')
# Built again when the library, a patch or this script changes.
STAMP="$VERSION $(cat "${PATCHES[@]}" "$0" "$LIB/libllama.so" | sha256sum | cut -c1-16)"
if [ -f "$DEST/stamp" ] && [ "$(cat "$DEST/stamp")" = "$STAMP" ]; then
  exit 0
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
  "llama-cpp-python==$VERSION" --dest "$WORK" 2>/dev/null ||
  "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" --dest "$WORK"
tar -xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK" \
  "llama_cpp_python-$VERSION/vendor/llama.cpp/ggml"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
touch "$SRC/ggml/ggml.pc.in"  # (left out of the sdist; only ggml's install reads it)

build() {  # build <set> <cmake options...>: libggml-cpu of one set into $WORK/<set>
  local set=$1
  shift
  local log="$WORK/build-$set.log"
  if ! { cmake -S "$SRC/ggml" -B "$WORK/build-$set" -DCMAKE_BUILD_TYPE=Release \
           -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON -DGGML_BUILD_TESTS=OFF \
           -DGGML_BUILD_EXAMPLES=OFF "$@" &&
         cmake --build "$WORK/build-$set" --target ggml-cpu -j "$JOBS"; } >"$log" 2>&1; then
    tail -40 "$log" >&2
    echo "build_kernels: building the $set kernels failed (log above)" >&2
    exit 1
  fi
  mkdir -p "$WORK/$set"
  for name in libllama.so libggml.so libggml-base.so; do
    # Copies, not links: each library finds the others next to itself ($ORIGIN).
    cp -L "$LIB/$name" "$WORK/$set/$name"
    cp -L "$LIB/$name" "$WORK/$set/$name.0"
  done
  cp -L "$WORK/build-$set/src/libggml-cpu.so" "$WORK/$set/libggml-cpu.so"
  cp -L "$WORK/build-$set/src/libggml-cpu.so" "$WORK/$set/libggml-cpu.so.0"
}

build fast -DGGML_LLAMAFILE=ON -DGGML_CPU_REPACK=ON
for patch_file in "${PATCHES[@]}"; do
  patch --quiet -d "$SRC" -p1 < "$patch_file"
done
build deterministic -DGGML_LLAMAFILE=ON -DGGML_CPU_REPACK=OFF

rm -rf "$DEST"
mkdir -p "$DEST"
mv "$WORK/deterministic" "$WORK/fast" "$DEST/"
echo "$STAMP" > "$DEST/stamp"
echo "kernels built: $DEST/{deterministic,fast}"
