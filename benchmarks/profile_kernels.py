"""One forward+backward of gated_delta_rule per row, for Nsight Compute (bf16, K = V = 128 unless --head-dims K:V says
otherwise, inputs as bench_gpu.py; --l2norm as there).

    ncu --clock-control none --set full -k regex:'prep|state|grad|combine' -o REPORT \
        python3 benchmarks/profile_kernels.py --rows 1x32768:2:8 [--calls 2] [--fwd-only]

The first call of each row is a warm-up (module load, allocator); profile the last one with ncu's --launch-skip, or
profile all and read the last. Prints each row's device time per kernel name from torch.profiler when --table is
given (no ncu needed), with the call's span (first kernel start to last kernel end) and its eager time. --host
prints where the eager time goes: the host's work per call (self CPU time of ops and CUDA runtime calls), the time
from the op's start to its first kernel, and the gaps between its kernels (--trace FILE also writes a Chrome trace).
--timeline lists one call's kernels in the order they start, with the call's busy time (bench_gpu.py's device time).
"""
import argparse
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_gpu  # noqa: E402
from bench_gpu import busy_us, make, parse_rows, time_fn  # noqa: E402
from gated_delta import gated_delta_rule  # noqa: E402


def call(xs, do, fwd_only):
    if fwd_only:
        with torch.no_grad():
            gated_delta_rule(*xs, scale=bench_gpu.K ** -0.5, use_qk_l2norm_in_kernel=bench_gpu.L2NORM)
        return
    for x in xs:
        x.grad = None
    o = gated_delta_rule(*xs, scale=bench_gpu.K ** -0.5, use_qk_l2norm_in_kernel=bench_gpu.L2NORM)[0]
    o.backward(do)


def one_call_kernels(xs, do, fwd_only):
    """The CUDA events (kernels, copies, memsets) of one call after three warm-up calls, in the order they start."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        call(xs, do, fwd_only)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call(xs, do, fwd_only)
        torch.cuda.synchronize()
    return sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)


def table(row, xs, do, fwd_only):
    ev = one_call_kernels(xs, do, fwd_only)
    per = {}
    for e in ev:
        name = e.name.split("<")[0].split("(")[0]
        per[name] = per.get(name, 0.0) + e.device_time_total / 1e3
    print(f"row {row} {'fwd' if fwd_only else 'fwd+bwd'}: total {sum(per.values()):.3f} ms")
    for name, ms in sorted(per.items(), key=lambda kv: -kv[1]):
        print(f"  {ms:8.3f} ms  {name}")
    # the same call from its first kernel's start to its last kernel's end (gaps between kernels included, overlap
    # counted once), and its eager time (CUDA events around the call, median of 20)
    ranges = [(e.time_range.start, e.time_range.end) for e in ev]
    span = (max(b for _, b in ranges) - min(a for a, _ in ranges)) / 1e3 if ranges else float("nan")
    eager = time_fn(lambda: call(xs, do, fwd_only), [()], 20)
    print(f"  span {span:.3f} ms, eager {eager:.3f} ms")


def timeline(row, xs, do, fwd_only):
    """One call's kernels in the order they start: start (from the first kernel's) and duration in us, and the
    call's busy time (the union of the kernels' intervals, bench_gpu's device time: kernels of two streams that
    overlap count once)."""
    ev = one_call_kernels(xs, do, fwd_only)
    busy = busy_us([(e.time_range.start, e.time_range.end) for e in ev]) / 1e3
    print(f"row {row} K={bench_gpu.K} V={bench_gpu.V} {'fwd' if fwd_only else 'fwd+bwd'}: busy {busy:.3f} ms")
    t0 = ev[0].time_range.start if ev else 0
    for e in ev:
        name = e.name.split("(")[0][:100]
        print(f"  {e.time_range.start - t0:9.1f} {e.time_range.end - e.time_range.start:8.1f}  {name}")


def host(row, xs, do, fwd_only, trace=None):
    """Where a call's eager time goes: the host's work (CPU-side ops and CUDA runtime calls, self time per call)
    and, on the device, the time before the first kernel and the gaps between kernels."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        call(xs, do, fwd_only)
    torch.cuda.synchronize()
    n = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            call(xs, do, fwd_only)
            torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    print(f"row {row} {'fwd' if fwd_only else 'fwd+bwd'}: host work per call (self CPU time, us; {n} calls)")
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    for e in rows[:20]:
        if e.self_cpu_time_total <= 0:
            break
        print(f"  {e.self_cpu_time_total / n:9.1f} us  {e.count // n:4d} x  {e.key}")
    kern = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA")
    # from the op's start on the host to its first kernel's start on the device
    starts = sorted(e.time_range.start for e in prof.events() if e.name == "gated_delta::fwd")
    first = [next((k[0] - t for k in kern if k[0] >= t), None) for t in starts]
    first = [f for f in first if f is not None]
    if first:
        print(f"  op start (host) to first kernel start (device): median {statistics.median(first):.1f} us")
    gaps = [b[0] - a[1] for a, b in zip(kern, kern[1:])]
    inner = [g for g in gaps if 0 <= g < 1000]  # between kernels of one call (calls are 1 ms+ apart)
    if inner:
        print(f"  device gaps between kernels of a call: {len(inner) / n:.1f} per call, median "
              f"{statistics.median(inner):.1f} us, sum {sum(inner) / n:.1f} us per call")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1x32768:2:8")
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--fwd-only", action="store_true")
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--host", action="store_true", help="where the eager time goes: host work and kernel gaps")
    ap.add_argument("--trace", default=None, help="with --host: write the profile as a Chrome trace to this file")
    ap.add_argument("--timeline", action="store_true", help="one call's kernels in start order, and its busy time")
    ap.add_argument("--head-dims", default="128:128", metavar="K:V", help="head dims of q/k and of v")
    ap.add_argument("--l2norm", action="store_true", help="q and k unnormalised, use_qk_l2norm_in_kernel=True")
    a = ap.parse_args()
    bench_gpu.K, bench_gpu.V = (int(x) for x in a.head_dims.split(":"))
    bench_gpu.L2NORM = a.l2norm
    for row in parse_rows(a.rows):
        xs, do = make(*row, seed=0, requires_grad=not a.fwd_only)
        if a.table:
            table(row, xs, do, a.fwd_only)
            continue
        if a.timeline:
            timeline(row, xs, do, a.fwd_only)
            continue
        if a.host:
            host(row, xs, do, a.fwd_only, a.trace)
            continue
        for _ in range(a.calls):
            call(xs, do, a.fwd_only)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
