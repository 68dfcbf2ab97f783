"""The gated delta rule called as a Gated DeltaNet layer calls it, on the GPU: q and k unnormalised, beta as logits,
g as the raw gate with A_log and dt_bias, and every in-kernel option on (use_qk_l2norm_in_kernel,
use_beta_sigmoid_in_kernel, allow_neg_eigval, use_gate_in_kernel); bf16 q, k, v, g and beta, fp32 A_log and dt_bias.
Per row: device time (profiler kernel sum) and eager time of the forward (no_grad) and of the forward+backward (every
input's gradient), and the kernels one call launches. Timing as bench_gpu.py (median of CUDA events after warm-up,
rotating input sets).

    python benchmarks/layer_options.py --rows 8x4096:16:32,1x8192:4:8
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_gpu as bg  # noqa: E402


def make(B, T, H, HV, seed, requires_grad):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    xs = [r(B, T, H, bg.K).bfloat16(), r(B, T, H, bg.K).bfloat16(), r(B, T, HV, bg.V).bfloat16(),
          r(B, T, HV).bfloat16(), r(B, T, HV).bfloat16(), torch.rand(HV, device="cuda", generator=gen) - 0.5,
          0.5 * r(HV)]
    if requires_grad:
        xs = [x.requires_grad_() for x in xs]
    return xs, r(B, T, HV, bg.V).bfloat16()


def layer_call(q, k, v, g, beta, A_log, dt_bias):
    from gated_delta import gated_delta_rule

    return gated_delta_rule(q, k, v, g, beta, scale=bg.K ** -0.5, use_qk_l2norm_in_kernel=True,
                            use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, use_gate_in_kernel=True,
                            A_log=A_log, dt_bias=dt_bias)[0]


def kernels_per_call(fn, args):
    fn(*args)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="8x4096:16:32,1x8192:4:8", help="BxT:H:HV,...")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sets", type=int, default=2)
    a = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| B × T, H / HV | pass | device ms | eager ms | kernels per call |")
    print("|---|---|---|---|---|")
    for B, T, H, HV in bg.parse_rows(a.rows):
        fwd_sets = [make(B, T, H, HV, s, False)[0] for s in range(a.sets)]
        bwd_sets = [make(B, T, H, HV, 100 + s, True) for s in range(a.sets)]

        def fb(xs, do):
            for x in xs:
                x.grad = None
            layer_call(*xs).backward(do)

        with torch.no_grad():
            t_f = bg.time_fn(layer_call, fwd_sets, a.reps)
            d_f = bg.device_time(layer_call, fwd_sets)
            n_f = kernels_per_call(layer_call, fwd_sets[0])
        t_fb = bg.time_fn(fb, bwd_sets, a.reps)
        d_fb = bg.device_time(fb, bwd_sets)
        n_fb = kernels_per_call(fb, bwd_sets[0])
        row = f"{B}×{T}, {H}/{HV}"
        print(f"| {row} | fwd | {d_f:.3f} | {t_f:.3f} | {n_f} |")
        print(f"| {row} | fwd+bwd | {d_fb:.3f} | {t_fb:.3f} | {n_fb} |", flush=True)
        del fwd_sets, bwd_sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
