"""State-pool decode benchmark (GPU): `gated_delta.decode_pool` for one new token per sequence, B sequences at
random distinct slots of a pool of 512 fp32 states, H=16 q/k heads, HV=32 value heads, K=V=128, bf16 inputs with
the gate, beta sigmoid and q/k L2 norm in the kernel (vLLM's decode call).

Per batch size it reports the median time per call under a CUDA graph (and eager, with check_slots=False), next
to the floor: the bytes of state read and written divided by the device's copy bandwidth measured in the same
run, and next to `decode_step` on a contiguous [B, HV, K, V] state. The last rows run speculative decoding: T
draft tokens per sequence with the state after every token written to its own slot (the floor counts one read
and T writes).

    python benchmarks/bench_decode_pool.py [--batch 1 64 256] [--slots 512] [--spec 4]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gated_delta as gd  # noqa: E402
from bench_decode import H, HV, K, V, copy_bandwidth, time_eager, time_graph  # noqa: E402


def call_inputs(B, T, slots, num_slots, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(B * 10 + T)
    r = lambda *s, dt=dtype: torch.randn(*s, device="cuda", generator=g).to(dt)  # noqa: E731
    idx = torch.randperm(num_slots, device="cuda", generator=g)[:B * slots].view(B, slots)
    return dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=r(B, T, HV), beta=r(B, T, HV),
                A_log=r(HV, dt=torch.float32) * 0.5, dt_bias=r(HV, dt=torch.float32) * 0.5,
                state_indices=(idx[:, 0] if slots == 1 else idx).to(torch.int32).contiguous(),
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--slots", type=int, default=512, help="pool size")
    ap.add_argument("--spec", type=int, default=4, help="draft tokens per sequence of the speculative rows (0: none)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_pool needs a CUDA device")
    bw = copy_bandwidth()
    pool = torch.randn(args.slots, HV, K, V, device="cuda") * 0.01
    state_bytes = HV * K * V * 4
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s (read+write)  "
          f"H={H} HV={HV} K={K} V={V} bf16 inputs, fp32 pool of {args.slots} slots "
          f"({pool.numel() * 4 / 2**30:.2f} GiB)")
    print()
    print("| B | tokens / seq | state MiB read+written | floor us | eager us | graph us | graph / floor | "
          "decode_step graph us |")
    print("|---|---|---|---|---|---|---|---|")
    rows = [(B, 1) for B in args.batch]
    if args.spec > 1:  # speculative rows need spec slots per sequence
        rows += [(B, args.spec) for B in args.batch if 1 < B and B * args.spec <= args.slots]
    for B, T in rows:
        inp = call_inputs(B, T, T, args.slots)
        if T > 1:
            inp["num_accepted_tokens"] = torch.ones(B, dtype=torch.int32, device="cuda")
        moved = B * state_bytes * (1 + T)  # one read, one write per written state
        floor_us = moved / bw * 1e6
        run = lambda: gd.decode_pool(**inp, state_pool=pool, check_slots=False)  # noqa: E731
        eager, graph = time_eager(run), time_graph(run)
        step = float("nan")
        if T == 1:
            st = torch.randn(B, HV, K, V, device="cuda") * 0.01
            a = {n: inp[n] for n in ("q", "k", "v", "A_log", "dt_bias")}
            step = time_graph(lambda: gd.decode_step(**a, a=inp["g"], b=inp["beta"], state=st))
        print(f"| {B} | {T} | {moved / 2**20:.0f} | {floor_us:.1f} | {eager:.1f} | {graph:.1f} | "
              f"{graph / floor_us:.2f} | {step:.1f} |")


if __name__ == "__main__":
    main()
