"""v split from a fused q | k | v projection, read in place (CUDA): device and eager time of gated_delta_rule with v
as that strided view, against the same call on a contiguous copy of it, and against the copy and the call together
(what a library that requires contiguous inputs runs). bf16, K = V = 128, unit-norm keys, inputs as bench_gpu.py.

    python benchmarks/bench_strided_v.py [--rows 8x4096:16:32,4x8192:16:64] [--reps 10]

In the fused layout each token's row holds q (H K), k (H K) and v (HV V): v's heads are V apart and its tokens
2 H K + HV V apart, as `torch.split` of a [B, T, 2 H K + HV V] projection output gives them (Qwen3-Next's layer).
v's gradient flows back into the fused tensor's in both strided columns (the split's backward, the same kernels).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import K, V, device_time, make, parse_rows, time_fn  # noqa: E402


def fused_rows(q, k, v):
    """A fused [B, T, 2 H K + HV V] leaf whose rows hold q, k and v."""
    B, T, H, _ = q.shape
    fused = torch.cat([q.reshape(B, T, H * K), k.reshape(B, T, H * K), v.reshape(B, T, -1)], dim=-1)
    return fused.detach().requires_grad_()


def split_v(fused, H, HV):
    """v, split from the fused rows (a view: its gradient flows back into the fused tensor's)."""
    return fused[..., 2 * H * K:].unflatten(-1, (HV, V))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8x4096:16:32,4x8192:16:64")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_strided_v.py measures CUDA calls: no GPU here")
    from gated_delta import gated_delta_rule

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; device / eager time in ms, median")
    print("| B x T | H / HV | pass | v contiguous | v strided (in place) | copy + call |")
    print("|---|---|---|---|---|---|")
    for row in parse_rows(args.rows):
        B, T, H, HV = row
        xs, do = make(*row, seed=1, requires_grad=True)
        q, k, v, g, beta = xs
        fused = fused_rows(q, k, v)
        vs = split_v(fused, H, HV)
        assert vs.stride(1) == 2 * H * K + HV * V and torch.equal(vs, v)

        def run(leaf, backward, copy=False):
            def fn():
                if backward:
                    for x in (q, k, leaf, g, beta):
                        x.grad = None
                vv = leaf if leaf is v else split_v(leaf, H, HV)
                vin = vv.contiguous() if copy else vv
                if not backward:
                    with torch.no_grad():
                        return gated_delta_rule(q, k, vin, g, beta, scale=K ** -0.5)[0]
                gated_delta_rule(q, k, vin, g, beta, scale=K ** -0.5)[0].backward(do)
            return fn

        for backward in (False, True):
            cells = []
            for leaf, copy in ((v, False), (fused, False), (fused, True)):
                fn = run(leaf, backward, copy)
                d = device_time(lambda: fn(), [()], calls=5)
                e = time_fn(lambda: fn(), [()], args.reps)
                cells.append(f"{d:.3f} / {e:.3f}")
            print(f"| {B}x{T} | {H} / {HV} | {'fwd+bwd' if backward else 'fwd'} | " + " | ".join(cells) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
