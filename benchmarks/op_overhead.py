"""Host time of one call of the registered forward op on a tiny input, by how autograd sees the call.

    python benchmarks/op_overhead.py [--device cpu|cuda] [--calls 3000]

One token, one head, K = V = 16 (the kernels' work is negligible; on CUDA the calls are not synchronised, so this
is the time to enqueue). Median over 7 rounds of the mean time per call, microseconds, for: the op under no_grad,
the Python function under no_grad, the op with grad mode on and no input requiring grad, the op recording a graph
(q requires grad) and the op under inference_mode (no Autograd kernel at all).
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from gated_delta import gated_delta_rule


def per_call_us(fn, calls):
    for _ in range(200):
        fn()
    rounds = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(rounds)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dev, K = args.device, 16
    q = F.normalize(torch.randn(1, 1, 1, K, device=dev), dim=-1)
    k = F.normalize(torch.randn(1, 1, 1, K, device=dev), dim=-1)
    v = torch.randn(1, 1, 1, K, device=dev)
    g = F.logsigmoid(torch.randn(1, 1, 1, device=dev))
    beta = torch.rand(1, 1, 1, device=dev)
    op = torch.ops.gated_delta.fwd
    rest = (K ** -0.5, None, False, None, None, False, False, False, False, None, None, "auto", 64)
    qr = q.clone().requires_grad_()
    rows = []
    with torch.no_grad():
        rows.append(("op, no_grad", per_call_us(lambda: op(q, k, v, g, beta, *rest), args.calls)))
        rows.append(("Python function, no_grad", per_call_us(lambda: gated_delta_rule(q, k, v, g, beta), args.calls)))
    rows.append(("op, grad mode on, no input requires grad", per_call_us(lambda: op(q, k, v, g, beta, *rest),
                                                                          args.calls)))
    rows.append(("op, recording a graph", per_call_us(lambda: op(qr, k, v, g, beta, *rest), args.calls)))
    with torch.inference_mode():
        rows.append(("op, inference_mode", per_call_us(lambda: op(q, k, v, g, beta, *rest), args.calls)))
    if dev == "cuda":
        torch.cuda.synchronize()
    print(f"device {dev}, torch {torch.__version__}, {torch.get_num_threads()} thread(s); us per call")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
