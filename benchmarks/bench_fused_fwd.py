"""The forward alone, in one process: gated_delta's two-kernel forward (prep + state_fwd), its one-kernel forward
(fwd_fused.cu, GATED_DELTA_FUSED_FWD=1) and FlashQLA when importable. bf16, K = V = 128, inputs as bench_gpu.py.

    python benchmarks/bench_fused_fwd.py [--rows 8x4096:16:32,4x8192:16:64] [--sets 3] [--reps 20]

Prints per row and implementation the device time (summed kernel durations of one call from torch.profiler, median
of 5 calls) and the eager time (median of CUDA-event timings over the input sets, after warm-up), in ms.
"""
import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_gpu import K, device_time, load_qla, make, parse_rows, time_fn  # noqa: E402
from gated_delta import gated_delta_rule  # noqa: E402


def ours(fused):
    def fn(q, k, v, g, b):
        os.environ["GATED_DELTA_FUSED_FWD"] = "1" if fused else "0"  # read by the op on every call
        with torch.no_grad():
            return gated_delta_rule(q, k, v, g, b, scale=K ** -0.5)[0]
    return fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8x4096:16:32,4x8192:16:64")
    ap.add_argument("--sets", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    fns = {"two-kernel": ours(False), "one-kernel": ours(True)}
    qla = load_qla()
    if qla is not None:
        def qla_fwd(q, k, v, g, b):
            with torch.no_grad():
                return qla(q, k, v, g, b, scale=K ** -0.5)[0]
        fns["FlashQLA"] = qla_fwd
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| B x T, H / HV | " + " | ".join(f"{n} device / eager" for n in fns) + " | one-kernel / two-kernel"
          + (" | one-kernel / FlashQLA" if qla is not None else "") + " |")
    for row in parse_rows(a.rows):
        sets = [make(*row, seed=s) for s in range(a.sets)]
        sets = [x for x, _ in sets]
        dev, eager = {}, {}
        for name, fn in fns.items():
            dev[name] = device_time(fn, sets)
            eager[name] = time_fn(fn, sets, a.reps)
        B, T, H, HV = row
        cells = " | ".join(f"{dev[n]:.3f} / {eager[n]:.3f}" for n in fns)
        ratio = f" | {dev['one-kernel'] / dev['two-kernel']:.2f}"
        if qla is not None:
            ratio += f" | {dev['one-kernel'] / dev['FlashQLA']:.2f}"
        print(f"| {B}x{T}, {H}/{HV} | {cells}{ratio} |", flush=True)
    os.environ.pop("GATED_DELTA_FUSED_FWD", None)


if __name__ == "__main__":
    main()
