"""Decode-step benchmark (GPU): the fused `gated_delta.decode_step` for one new token per sequence against a cached
fp32 state, with H=16 q/k heads, HV=32 value heads, K=V=128, at several batch sizes.

Per step it reports the median time (CUDA events, after warm-up) of eager calls and of CUDA-graph replays, next to
flash-linear-attention's `fused_recurrent_gated_delta_rule` when importable, and the memory floor: the time to
read and write the fp32 state once at the device's measured copy bandwidth. With --layer it also times one
decode step of a whole GatedDeltaNet layer (hidden 2048, bf16 weights).

    python benchmarks/bench_decode.py [--batch 1 64 256] [--dtype bf16] [--layer]
"""
import argparse
import statistics

import torch

import gated_delta as gd
from gated_delta.testing import warm_up_for_capture

try:
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fused_recurrent
except Exception:  # noqa: BLE001  (not installed, or no Triton for this device)
    fla_fused_recurrent = None

H, HV, K, V = 16, 32, 128, 128


def copy_bandwidth(nbytes=1 << 30, reps=20):
    """Device-to-device copy bandwidth in bytes/s (read + write counted), median of reps."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return 2 * nbytes / statistics.median(times)


def time_eager(fn, steps=50, reps=15, warmup=20):
    """Median over reps of the mean time per call of `steps` back-to-back calls (includes launch overhead)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(steps):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / steps)
    return statistics.median(times)


def time_graph(fn, steps=50, reps=15):
    """Median over reps of the time per step of a CUDA graph holding `steps` calls."""
    warm_up_for_capture(fn, 3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / steps)
    return statistics.median(times)


def inputs(B, dtype):
    g = torch.Generator(device="cuda").manual_seed(B)
    r = lambda *s, dt=dtype: torch.randn(*s, device="cuda", generator=g).to(dt)  # noqa: E731
    return dict(q=r(B, 1, H, K), k=r(B, 1, H, K), v=r(B, 1, HV, V), a=r(B, 1, HV), b=r(B, 1, HV),
                A_log=r(HV, dt=torch.float32) * 0.5, dt_bias=r(HV, dt=torch.float32) * 0.5)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--layer", action="store_true", help="also time a whole GatedDeltaNet layer decode step")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode needs a CUDA device")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s (read+write)  "
          f"H={H} HV={HV} K={K} V={V} {args.dtype} inputs, fp32 state, 1 token/step"
          f"  FLA: {'yes' if fla_fused_recurrent else 'not importable'}")
    print()
    print("| B | state MiB | floor us | ours eager us | ours graph us | graph/floor | FLA eager us | FLA graph us |")
    print("|---|---|---|---|---|---|---|---|")
    for B in args.batch:
        inp = inputs(B, dtype)
        state = torch.randn(B, HV, K, V, device="cuda") * 0.01
        state_bytes = state.numel() * 4
        floor_us = 2 * state_bytes / bw * 1e6
        ours = lambda: gd.decode_step(**inp, state=state)  # noqa: E731
        ours_eager, ours_graph = time_eager(ours), time_graph(ours)
        fla_eager = fla_graph = float("nan")
        if fla_fused_recurrent is not None:
            st = state.clone()

            def fla():
                return fla_fused_recurrent(inp["q"], inp["k"], inp["v"], g=inp["a"], beta=inp["b"], initial_state=st,
                                           output_final_state=True, use_qk_l2norm_in_kernel=True,
                                           use_gate_in_kernel=True, A_log=inp["A_log"], dt_bias=inp["dt_bias"],
                                           use_beta_sigmoid_in_kernel=True)
            try:
                fla_eager, fla_graph = time_eager(fla), time_graph(fla)
            except Exception as e:  # noqa: BLE001
                print(f"(FLA failed at B={B}: {type(e).__name__}: {str(e)[:120]})")
        print(f"| {B} | {state_bytes / 2**20:.0f} | {floor_us:.1f} | {ours_eager:.1f} | {ours_graph:.1f} | "
              f"{ours_graph / floor_us:.2f} | {fla_eager:.1f} | {fla_graph:.1f} |")

    if args.layer:
        print()
        print("| B | layer decode step eager us | graph us |  (GatedDeltaNet hidden 2048, bf16 weights)")
        print("|---|---|---|")
        layer = gd.GatedDeltaNet(2048, H, num_v_heads=HV, head_dim=K, head_v_dim=V).to("cuda", torch.bfloat16)
        for B in args.batch:
            with torch.inference_mode():
                x = torch.randn(B, 1, 2048, device="cuda", dtype=torch.bfloat16)
                cache = layer.empty_cache(B, dtype=torch.bfloat16)
                step = lambda: layer(x, cache=cache, use_cache=True)  # noqa: E731
                print(f"| {B} | {time_eager(step):.1f} | {time_graph(step):.1f} |")


if __name__ == "__main__":
    main()
