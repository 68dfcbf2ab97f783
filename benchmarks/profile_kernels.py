"""One forward+backward of gated_delta_rule per row, for Nsight Compute (bf16, K = V = 128, inputs as bench_gpu.py).

    ncu --clock-control none --set full -k regex:'prep|state|grad|combine' -o REPORT \
        python3 benchmarks/profile_kernels.py --rows 1x32768:2:8 [--calls 2] [--fwd-only]

The first call of each row is a warm-up (module load, allocator); profile the last one with ncu's --launch-skip, or
profile all and read the last. Prints each row's device time per kernel name from torch.profiler when --table is
given (no ncu needed), with the call's span (first kernel start to last kernel end) and its eager time.
"""
import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_gpu import make, parse_rows, K  # noqa: E402
from gated_delta import gated_delta_rule  # noqa: E402


def call(xs, do, fwd_only):
    if fwd_only:
        with torch.no_grad():
            gated_delta_rule(*xs, scale=K ** -0.5)
        return
    for x in xs:
        x.grad = None
    o = gated_delta_rule(*xs, scale=K ** -0.5)[0]
    o.backward(do)


def table(row, xs, do, fwd_only):
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        call(xs, do, fwd_only)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call(xs, do, fwd_only)
        torch.cuda.synchronize()
    per = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            name = e.name.split("<")[0].split("(")[0]
            per[name] = per.get(name, 0.0) + e.device_time_total / 1e3
    print(f"row {row} {'fwd' if fwd_only else 'fwd+bwd'}: total {sum(per.values()):.3f} ms")
    for name, ms in sorted(per.items(), key=lambda kv: -kv[1]):
        print(f"  {ms:8.3f} ms  {name}")
    # the same call from its first kernel's start to its last kernel's end (gaps between kernels included, overlap
    # counted once), and its eager time (CUDA events around the call, median of 20)
    ranges = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA"]
    span = (max(b for _, b in ranges) - min(a for a, _ in ranges)) / 1e3 if ranges else float("nan")
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call(xs, do, fwd_only)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    print(f"  span {span:.3f} ms, eager {times[len(times) // 2]:.3f} ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1x32768:2:8")
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--fwd-only", action="store_true")
    ap.add_argument("--table", action="store_true")
    a = ap.parse_args()
    for row in parse_rows(a.rows):
        xs, do = make(*row, seed=0, requires_grad=not a.fwd_only)
        if a.table:
            table(row, xs, do, a.fwd_only)
            continue
        for _ in range(a.calls):
            call(xs, do, a.fwd_only)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
