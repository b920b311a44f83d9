#!/usr/bin/env bash
# Configure, build (-j2) and test the standalone CMake build of the cat_fast ops (library
# build-cmake/libcat_fast_ops.so + C++ test), then check that Python can load the library.
# Env: PYTHON (default python), BUILD_DIR (default build-cmake), CAT_FAST_WITH_CUDA (default OFF),
#      JOBS (default 2), CAT_FAST_SKIP_PYTEST=1 to skip the Python load test.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python}"
BUILD_DIR="${BUILD_DIR:-build-cmake}"
JOBS="${JOBS:-2}"
TORCH_PREFIX="$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')"

GEN=()
if command -v ninja >/dev/null 2>&1; then GEN=(-G Ninja); fi
if [ -f "$BUILD_DIR/CMakeCache.txt" ]; then GEN=(); fi  # keep the generator of an existing build dir

cmake -S . -B "$BUILD_DIR" "${GEN[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" \
  -DCAT_FAST_WITH_CUDA="${CAT_FAST_WITH_CUDA:-OFF}"
cmake --build "$BUILD_DIR" -j "$JOBS"
(cd "$BUILD_DIR" && ctest --output-on-failure)

if [ "${CAT_FAST_SKIP_PYTEST:-0}" != "1" ] && "$PYTHON" -c 'import pytest' >/dev/null 2>&1; then
  LIB="$(ls "$PWD/$BUILD_DIR"/libcat_fast_ops.* | head -n 1)"
  CAT_FAST_CMAKE_LIB="$LIB" "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cmake_library.py
fi
