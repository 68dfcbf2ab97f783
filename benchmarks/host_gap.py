"""Where a call's eager time goes beyond its device time (CUDA): host time of the forward (no_grad), of the forward
+ backward and of `backward()` alone, then a torch.profiler trace with CPU activity of three forward+backward calls.

    python benchmarks/host_gap.py [--rows 1x8192:4:8,8x4096:16:32] [--out DIR]

Prints, per row, the medians of 30 calls: the host time until the call returns (kernels still queued) and the wall
time until the GPU is done; then the profiler's table by self CPU time. Writes DIR/trace_<row>.json (Chrome trace
format) for the timeline: the host events beside the kernels, and the gaps between kernels.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import K, make, parse_rows  # noqa: E402


def host_and_wall(fn, calls=30):
    for _ in range(5):
        fn()
    host, wall = [], []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1e6)
        wall.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(host), statistics.median(wall)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1x8192:4:8,8x4096:16:32")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("host_gap.py measures CUDA calls: no GPU here")
    from gated_delta import gated_delta_rule

    os.makedirs(args.out, exist_ok=True)
    f = lambda q, k, v, g, b: gated_delta_rule(q, k, v, g, b, scale=K ** -0.5)[0]  # noqa: E731
    for row in parse_rows(args.rows):
        xs, do = make(*row, seed=1, requires_grad=True)
        name = "{}x{}_{}_{}".format(*row)

        def fwd():
            with torch.no_grad():
                f(*xs)

        def fwd_bwd():
            for x in xs:
                x.grad = None
            f(*xs).backward(do)

        for label, fn in (("forward (no_grad)", fwd), ("forward+backward", fwd_bwd)):
            h, w = host_and_wall(fn)
            print(f"{name} {label}: host {h:.1f} us, wall {w:.1f} us", flush=True)
        bwd_host = []
        for _ in range(30):
            for x in xs:
                x.grad = None
            o = f(*xs)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            o.backward(do)
            bwd_host.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
        print(f"{name} backward() alone: host {statistics.median(bwd_host):.1f} us", flush=True)
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(3):
                fwd_bwd()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), flush=True)
        prof.export_chrome_trace(os.path.join(args.out, f"trace_{name}.json"))


if __name__ == "__main__":
    main()
