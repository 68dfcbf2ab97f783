#!/usr/bin/env bash
# The GPU validation in one pass: build for sm_90a, GPU tests, compute-sanitizer (memcheck, racecheck), decode
# benchmark, every check of the checklist and a short run of the ~100M-parameter training example.
# Logs go to $1 (default gpu_out/).
#   bash benchmarks/run_gpu_suite.sh OUTDIR
# flash-linear-attention is compared where importable (PYTHONPATH).
set -uo pipefail
OUTDIR=${1:-gpu_out}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 GATED_DELTA_CUDA_ARCHS=${GATED_DELTA_CUDA_ARCHS:-9.0a} MAX_JOBS=${MAX_JOBS:-16}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUTDIR/env.log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUTDIR/env.log"
start=$(date +%s)
if ! python3 -m pip install --no-build-isolation --no-deps -e . > "$OUTDIR/build.log" 2>&1; then
  tail -60 "$OUTDIR/build.log"; exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
python3 -m pytest -q tests/test_cuda.py tests/test_layer_cuda.py tests/test_fla_checkpoint.py tests/test_api.py 2>&1 | tee "$OUTDIR/tests.log" | tail -8
export PATH="$PATH:${CUDA_HOME:-/usr/local/cuda}/bin"
for tool in memcheck racecheck; do  # racecheck is slow: the small configuration only
  arg=""; [ "$tool" = racecheck ] && arg=small
  timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 1 python3 tests/gpu_helpers.py $arg \
    > "$OUTDIR/sanitizer_$tool.log" 2>&1
  echo "compute-sanitizer $tool: exit $? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUTDIR/sanitizer_$tool.log" | tail -1))"
done
python3 benchmarks/bench_decode.py --layer 2>&1 | tee "$OUTDIR/decode.log" | tail -14
timeout 300 python3 -m gated_delta.checklist --device cuda --soak-steps 600 \
  --out /tmp/checklist 2>&1 | tee "$OUTDIR/checklist.log" | tail -12
cp /tmp/checklist/*.md "$OUTDIR/" 2>/dev/null
timeout 120 python3 examples/train_lm.py --preset gpu-100m --steps 80 --eval-every 40 --out /tmp/train 2>&1 \
  | tr '\r' '\n' | tail -12 | tee "$OUTDIR/train.log"
echo "total: $(( $(date +%s) - start )) s"
