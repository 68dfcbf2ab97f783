"""The CUDA algorithms side by side in one process: auto (segments with a proven warm-up on few-unit shapes), scan
and chunk, forward and forward+backward, on the shapes of DESIGN.md section 5 (bf16, K = V = 128, unit-norm k,
g = logsigmoid(N(0, 1) + 3), beta = sigmoid(N(0, 1))).

    python benchmarks/bench_algorithms.py [--rows 1x32768:2:8,1x8192:4:8] [--reps 30]

Per row and algorithm: the median of CUDA-event timings (after warm-up, rotating input sets), the device time (the
sum of kernel durations of one call under torch.profiler), and the relative difference of o and of every gradient
against the chunk algorithm (both exact: the difference is rounding).
"""
import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from bench_gpu import K, make, parse_rows, time_fn  # noqa: E402
from gpu_helpers import rel_err  # noqa: E402

ALGOS = ("chunk", "scan", "auto")


def device_ms(fn, by_kernel=None):
    """The summed kernel time of one call (ms); by_kernel, when given, receives the time per kernel name."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    tot = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name.split("<")[0].replace("void ", "").replace("gated_delta::cuda::", "")
            tot[name] = tot.get(name, 0.0) + e.device_time_total / 1000.0
    if by_kernel is not None:
        by_kernel.update(tot)
    return sum(tot.values())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1x32768:2:8,1x8192:4:8,1x8192:16:32,1x32768:16:32")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sets", type=int, default=2)
    args = ap.parse_args()
    from gated_delta import gated_delta_rule

    def fwd(algo):
        return lambda q, k, v, g, b: gated_delta_rule(q, k, v, g, b, scale=K ** -0.5, algorithm=algo)[0]

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| B x T, H / HV | algorithm | fwd ms (events) | fwd ms (device) | fwd+bwd ms (events) | fwd+bwd ms (device) "
          "| max rel. diff vs chunk |")
    print("|---|---|---|---|---|---|---|")
    for (B, T, H, HV) in parse_rows(args.rows):
        fsets = [make(B, T, H, HV, seed=s)[0] for s in range(args.sets)]
        bsets = [make(B, T, H, HV, seed=100 + s, requires_grad=True) for s in range(args.sets)]
        outs = {}
        for algo in ALGOS:
            f = fwd(algo)

            def fb(xs, do, f=f):
                for x in xs:
                    x.grad = None
                f(*xs).backward(do)

            kf, kfb = {}, {}
            with torch.no_grad():
                t_f = time_fn(f, fsets, args.reps)
                d_f = device_ms(lambda: f(*fsets[0]), kf)
            t_fb = time_fn(fb, bsets, args.reps)
            d_fb = device_ms(lambda: fb(*bsets[0]), kfb)
            for what, kt in (("fwd", kf), ("fwd+bwd", kfb)):
                print(f"  {B}x{T} {H}/{HV} {algo} {what} kernels: "
                      + ", ".join(f"{k} {v:.3f}" for k, v in sorted(kt.items(), key=lambda kv: -kv[1])))
            xs, do = bsets[0]
            fb(xs, do)
            with torch.no_grad():
                outs[algo] = [f(*xs).float()] + [x.grad.float().clone() for x in xs]
            diff = max(rel_err(a, b) for a, b in zip(outs[algo], outs["chunk"]))
            print(f"| {B}x{T}, {H}/{HV} | {algo} | {t_f:.3f} | {d_f:.3f} | {t_fb:.3f} | {d_fb:.3f} | {diff:.1e} |",
                  flush=True)
        for algo in ("auto", "scan"):
            diffs = [rel_err(a, b) for a, b in zip(outs[algo], outs["chunk"])]
            print(f"  {B}x{T} {H}/{HV} {algo} vs chunk: o, dq, dk, dv, dg, dbeta = "
                  + ", ".join(f"{d:.1e}" for d in diffs), flush=True)
        del fsets, bsets, outs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
