"""Host cost of one call of gated_delta_rule and its parts, on the GPU (bf16, K = V = 128).

    python3 benchmarks/host_cost.py        (from the repository root; writes the profiler trace to $OUT or /tmp)

Per row (1x64 4/8, where the GPU work is negligible, then 1x8192 4/8 and 1x32768 2/8), the median host time of one
call (perf_counter around the call, no synchronisation inside; 200 calls, a synchronisation every 20 outside the
timed part) of: the Python function (forward under no_grad), the registered op called directly, one torch.empty and
one in-place add for scale, the registered backward op called directly, the forward with autograd recording, and a
whole forward+backward (`o.backward(do)`, gradients cleared first); then bench_gpu's eager and device times of the
forward and of the forward+backward. Last, the CPU-side operators of five forward+backward calls at T = 64 under
torch.profiler (self time per operator) and their Chrome trace (fb64_trace.json).
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu as bg  # noqa: E402
from gated_delta import gated_delta_rule  # noqa: E402

K = bg.K


def host_us(fn, n=200):
    """Median host time of one call, microseconds."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    ts = []
    for i in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
        if i % 20 == 19:
            torch.cuda.synchronize()
    return statistics.median(ts) * 1e6


# The ops' arguments in schema order with gated_delta_rule's defaults: the inputs (q, k, v, g, beta, scale,
# initial_state), then, after the forward's output_final_state, the options both ops take
OPTIONS = (None, None, False, False, False, False, None, None, "auto", 64, None, None, False)


def op_inputs(q, k, v, g, b):
    return (q, k, v, g, b, K ** -0.5, None)


def fwd_bwd(xs, do):
    """One forward+backward of leaves xs with output gradient do (the gradients cleared first), as a callable."""
    def fb():
        for x in xs:
            x.grad = None
        gated_delta_rule(*xs, scale=K ** -0.5)[0].backward(do)
    return fb


for (B, T, H, HV) in [(1, 64, 4, 8), (1, 8192, 4, 8), (1, 32768, 2, 8)]:
    xs, do = bg.make(B, T, H, HV, seed=1)
    xg, dog = bg.make(B, T, H, HV, seed=2, requires_grad=True)
    q, k, v, g, b = xs
    res = {}
    with torch.no_grad():
        res["py fwd"] = host_us(lambda: gated_delta_rule(q, k, v, g, b, scale=K ** -0.5))
        res["op fwd"] = host_us(lambda: torch.ops.gated_delta.fwd(*op_inputs(q, k, v, g, b), False, *OPTIONS))
        res["torch.empty x1"] = host_us(lambda: torch.empty(64, device="cuda"))
        res["add_ x1 (launch)"] = host_us(lambda: g.add_(0.0))
        res["op bwd"] = host_us(lambda: torch.ops.gated_delta.bwd(do, None, *op_inputs(q, k, v, g, b), *OPTIONS))
    res["fwd autograd"] = host_us(lambda: gated_delta_rule(*xg, scale=K ** -0.5))
    fb = fwd_bwd(xg, dog)
    res["fwd+bwd"] = host_us(fb)

    def ng(*x):
        return gated_delta_rule(*x, scale=K ** -0.5)[0]

    with torch.no_grad():
        res["eager fwd ms"] = bg.time_fn(ng, [xs], 20)
        res["device fwd ms"] = bg.device_time(ng, [xs])
    res["eager fb ms"] = bg.time_fn(lambda xs_, d_: fb(), [(xg, dog)], 20)
    res["device fb ms"] = bg.device_time(lambda xs_, d_: fb(), [(xg, dog)])
    print(f"row {B}x{T} {H}/{HV}: " + ", ".join(
        f"{k_} {v_:.3f}" if "ms" in k_ else f"{k_} {v_:.1f} us" for k_, v_ in res.items()), flush=True)

# one T = 64 forward+backward under the profiler: CPU operators with their self times
fb1 = fwd_bwd(*bg.make(1, 64, 4, 8, seed=3, requires_grad=True))
for _ in range(5):
    fb1()
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        fb1()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
out = os.environ.get("OUT", "/tmp")
prof.export_chrome_trace(os.path.join(out, "fb64_trace.json"))
