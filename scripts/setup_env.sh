#!/usr/bin/env bash
# Creates .venv (once), installs the Python dependencies and builds gated_delta into it (editable).
#   TORCH_SPEC   the torch requirement to install (default torch==2.13.0, a CPU build; use your CUDA build on a GPU box)
#   MAX_JOBS     parallel compile jobs (default: number of cores)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel >/dev/null
.venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}" numpy pytest hypothesis matplotlib tqdm ninja expecttest cmake
MAX_JOBS=${MAX_JOBS:-$(nproc)} .venv/bin/python -m pip install -q --no-build-isolation --no-deps -e .
.venv/bin/python -c "import gated_delta, torch; print('gated_delta', gated_delta.__version__, '| torch', torch.__version__, '| cuda', torch.cuda.is_available())"
