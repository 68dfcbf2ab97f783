#!/usr/bin/env bash
# Compile check of the CUDA backend without a GPU: builds the whole extension (C++ and every csrc/cuda source) for
# sm_90a against a CUDA build of PyTorch in its own virtual environment, out of tree (the package's _C*.so in
# python/ is left alone). Fails non-zero on any compile or link error.
#
#   tools/check_cuda_build.sh            # venv at $GD_CUDA_VENV (default .venv-cuda, created if missing)
#
# Needs nvcc (CUDA 13.x) on PATH or in CUDA_HOME. The torch wheel must match nvcc's CUDA major version; torch
# 2.14.1 is built with CUDA 13.0.
#
# The same build serves a GPU machine whose torch differs from this one's: with GD_CUDA_TORCH set to that machine's
# exact torch (e.g. torch==2.11.0, a CUDA 13.0 build) and GD_CUDA_SO_OUT=FILE, the extension (Python's stable ABI,
# so any Python >= 3.9 loads it) is also written to FILE without its host debug sections (about 40 MB instead of
# 68). Put it at python/gated_delta/_C.abi3.so of the same source tree there and run with PYTHONPATH=python: no
# compile on that machine.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GD_CUDA_VENV:-$ROOT/.venv-cuda}"
TORCH_SPEC="${GD_CUDA_TORCH:-torch==2.14.1}"
WORK="${GD_CUDA_WORK:-/tmp/gated_delta_cuda_check}"
JOBS="${MAX_JOBS:-2}"

if ! command -v nvcc >/dev/null 2>&1; then
  if [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then
    export PATH="$CUDA_HOME/bin:$PATH"
  else
    echo "check_cuda_build: nvcc not found (PATH or CUDA_HOME)" >&2
    exit 2
  fi
fi
echo "nvcc: $(nvcc --version | tail -1)"
# the toolkit root (the host compiler needs its headers); nvcc on PATH may be a wrapper script
if [ -z "${CUDA_HOME:-}" ]; then
  for d in /usr/local/cuda "$(dirname "$(dirname "$(command -v nvcc)")")"; do
    if [ -f "$d/include/cuda_runtime_api.h" ]; then export CUDA_HOME="$d"; break; fi
  done
fi
echo "CUDA_HOME: ${CUDA_HOME:-unset}"

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torch, ninja; assert torch.version.cuda" 2>/dev/null; then
  echo "creating $VENV with $TORCH_SPEC (CUDA build)"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "$TORCH_SPEC" numpy ninja setuptools wheel
fi
"$VENV/bin/python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
# headers a toolkit without the math libraries lacks (cusparse.h, ...) come with torch's nvidia wheels
NVINC=$("$VENV/bin/python" -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'include'))" 2>/dev/null || true)
if [ -n "$NVINC" ] && [ -d "$NVINC" ]; then export CPATH="$NVINC${CPATH:+:$CPATH}"; fi

rm -rf "$WORK/src"
mkdir -p "$WORK/src"
cp -r "$ROOT/csrc" "$ROOT/python" "$ROOT/setup.py" "$WORK/src/"
[ -f "$ROOT/pyproject.toml" ] && cp "$ROOT/pyproject.toml" "$WORK/src/"
rm -f "$WORK/src/python/gated_delta/"_C*.so
cd "$WORK/src"
start=$(date +%s)
GATED_DELTA_FORCE_CUDA=1 GATED_DELTA_CUDA_ARCHS="${GATED_DELTA_CUDA_ARCHS:-9.0a}" MAX_JOBS="$JOBS" \
  "$VENV/bin/python" setup.py build_ext --build-temp "$WORK/build" --build-lib "$WORK/lib" >"$WORK/build.log" 2>&1 || {
  grep -E "error|Error" "$WORK/build.log" | head -40 >&2
  echo "check_cuda_build: FAILED (full log: $WORK/build.log)" >&2
  exit 1
}
so=$(find "$WORK/lib" -name "_C*.so" | head -1)
[ -n "$so" ] || { echo "check_cuda_build: no extension was produced" >&2; exit 1; }
# (nm's output goes to a file first: `nm | grep -q` can kill nm with SIGPIPE, which pipefail reports as a failure)
nm -C "$so" > "$WORK/symbols.txt"
grep -q "core_forward_cuda" "$WORK/symbols.txt" || { echo "check_cuda_build: CUDA core missing from $so" >&2; exit 1; }
grep -q "state_fwd_kernel" "$WORK/symbols.txt" || { echo "check_cuda_build: CUDA kernels missing from $so" >&2; exit 1; }
echo "check_cuda_build: OK ($so, $(( $(date +%s) - start )) s)"
if [ -n "${GD_CUDA_SO_OUT:-}" ]; then
  cp "$so" "$GD_CUDA_SO_OUT"
  strip --strip-debug "$GD_CUDA_SO_OUT"
  echo "check_cuda_build: $GD_CUDA_SO_OUT ($(du -h "$GD_CUDA_SO_OUT" | cut -f1))"
fi
