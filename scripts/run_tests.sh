#!/usr/bin/env bash
# Runs the test suite: pytest (GPU tests skip without CUDA) and the LibTorch C++ program under ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest -q tests "$@"
PREFIX=$(.venv/bin/python -c 'import torch; print(torch.utils.cmake_prefix_path)')
.venv/bin/cmake -S . -B cmake-build -DCMAKE_PREFIX_PATH="$PREFIX" -DPython_EXECUTABLE=.venv/bin/python >/dev/null
.venv/bin/cmake --build cmake-build -j "${MAX_JOBS:-$(nproc)}" >/dev/null
.venv/bin/ctest --test-dir cmake-build --output-on-failure
