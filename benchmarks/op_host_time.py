"""Host time of one call of the fwd and bwd ops with the GPU idle: the time the call takes to return (checks, workspace,
launches), not its kernels. Each measurement synchronizes first, then times the op call alone (median of 12), for
bwd with and without the forward's residual. Inputs as bench_gpu.py (bf16, K = V = 128).

    python3 benchmarks/op_host_time.py
"""
import sys
import time

import torch

import gated_delta  # noqa: F401  (registers the ops)

sys.path.insert(0, "benchmarks")
from bench_gpu import make  # noqa: E402

ops = torch.ops.gated_delta
for (B, T, H, HV) in ((1, 64, 4, 8), (1, 8192, 4, 8), (1, 32768, 4, 8), (8, 4096, 16, 32)):
    xs, do = make(B, T, H, HV, seed=0)
    q, k, v, g, beta = xs
    args = (q, k, v, g, beta, 128 ** -0.5, None, False, None, None, False, False, False, False, None, None, "auto", 64)
    o, ht, res = ops.fwd_with_residual(*args)
    bargs = (do, None) + args[:7] + args[8:]
    for resid in (None, res):
        ts, tf = [], []
        for i in range(12):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ops.bwd(*bargs, residual=resid)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            ops.fwd(*args)
            t3 = time.perf_counter()
            ts.append(t1 - t0)
            tf.append(t3 - t2)
        ts.sort()
        tf.sort()
        print(f"{B}x{T} {H}/{HV} residual={resid is not None}: bwd host {ts[6]*1e6:.1f} us, fwd host {tf[6]*1e6:.1f} us")
