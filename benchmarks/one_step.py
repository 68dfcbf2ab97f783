"""One forward+backward of the gated delta rule on the GPU (bf16, K = V = 128, the benchmark's inputs), for
wrapping in a profiler such as Nsight Compute:

    ncu --kernel-name regex:"state_fwd|state_rev|prep|grad_qk|grad_wy" --section SourceCounters \
        --section WarpStateStats -o rep python3 benchmarks/one_step.py 1 32768 16 64
    ncu -i rep.ncu-rep --page source --csv --print-source cuda,sass > source.csv   # stalls per source line

Arguments: B T H HV.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import make  # noqa: E402

from gated_delta import gated_delta_rule  # noqa: E402

if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    B, T, H, HV = (int(x) for x in sys.argv[1:5])
    xs, do = make(B, T, H, HV, seed=3, requires_grad=True)
    o = gated_delta_rule(*xs, scale=128 ** -0.5)[0]
    o.backward(do)
    torch.cuda.synchronize()
