"""CPU benchmark of the gated delta rule: our recurrent, chunk and scan kernels against autograd through a naive
PyTorch token loop, forward and forward+backward, float32.

    python benchmarks/bench_cpu.py                 # B=1, T=4096, H=4, HV=8, K=V=64; writes benchmarks/RESULTS.md
    python benchmarks/bench_cpu.py --T 1024 --no-write

Times are medians of --runs runs after --warmup runs (wall clock). Ours run with all intra-op threads and again with
one. The naive loops are thousands of tiny ops, which only lose from more threads (synchronisation, and on a busy
machine much worse), so they run with one intra-op thread; their forward+backward is timed --naive-runs times.
Two naive loops:
  - `gated_delta_rule_ref`, the package's reference: it indexes every token out of the full tensors, so autograd
    materialises a full-size gradient per token and its backward grows as T^2;
  - the same loop over tokens split once with `unbind` (backward linear in T): the stronger baseline.
"""
import argparse
import datetime
import os
import platform
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

import gated_delta  # noqa: E402


def naive_unbind(q, k, v, g, beta, scale):
    """The token loop with the tokens split once (B = 1 batch, no initial state)."""
    H, HV = q.shape[2], v.shape[2]
    q = q[0].repeat_interleave(HV // H, dim=1).unbind(0)
    k = k[0].repeat_interleave(HV // H, dim=1).unbind(0)
    v, alpha, beta = v[0].unbind(0), g[0].exp().unbind(0), beta[0].unbind(0)
    S = q[0].new_zeros(HV, q[0].shape[-1], v[0].shape[-1])
    out = []
    for t in range(len(q)):
        S = S * alpha[t][:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k[t]))
        S = S + k[t][:, :, None] * u[:, None, :]
        out.append(scale * torch.einsum("hkv,hk->hv", S, q[t]))
    return torch.stack(out)[None]


def timed(fn, warmup, runs):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def with_threads(n, fn):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average():
    try:
        return "%.2f" % os.getloadavg()[0]
    except OSError:
        return "n/a"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--HV", type=int, default=8)
    ap.add_argument("--K", type=int, default=64)
    ap.add_argument("--V", type=int, default=64)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--naive-runs", type=int, default=1)
    ap.add_argument("--skip-ref-bwd", action="store_true", help="skip the slow (T^2) backward of the reference")
    ap.add_argument("--no-write", action="store_true", help="print only; do not update benchmarks/RESULTS.md")
    args = ap.parse_args()

    threads = torch.get_num_threads()
    B, T, H, HV, K, V = args.B, args.T, args.H, args.HV, args.K, args.V
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, HV, generator=gen) + 3.0)  # decay ~0.95
    beta = torch.rand(B, T, HV, generator=gen)
    d_o = torch.randn(B, T, HV, V, generator=gen)
    scale = K ** -0.5
    leaves = [x.requires_grad_(True) for x in (q, k, v, g, beta)]

    def clear():
        for x in leaves:
            x.grad = None

    def ours(algorithm):
        def fwd():
            with torch.no_grad():
                gated_delta.gated_delta_rule(q, k, v, g, beta, scale=scale, algorithm=algorithm,
                                             chunk_size=args.chunk_size)

        def fwd_bwd():
            clear()
            o, _ = gated_delta.gated_delta_rule(q, k, v, g, beta, scale=scale, algorithm=algorithm,
                                                chunk_size=args.chunk_size)
            o.backward(d_o)

        return fwd, fwd_bwd

    def naive(loop):
        def fwd():
            with torch.no_grad():
                loop()

        def fwd_bwd():
            clear()
            loop().backward(d_o)

        return fwd, fwd_bwd

    ref_loop = lambda: gated_delta.gated_delta_rule_ref(q, k, v, g, beta, scale=scale)[0]  # noqa: E731
    unbind_loop = lambda: naive_unbind(q, k, v, g, beta, scale)  # noqa: E731

    rows = []  # (name, threads, fwd ms, fwd+bwd ms)
    load_before = load_average()
    for algorithm in ("chunk", "scan", "recurrent"):
        for n in sorted({threads, 1}, reverse=True):
            fwd, fwd_bwd = ours(algorithm)
            tf = with_threads(n, lambda: timed(fwd, args.warmup, args.runs))
            tb = with_threads(n, lambda: timed(fwd_bwd, args.warmup, args.runs))
            rows.append((f"gated_delta {algorithm}", n, tf, tb))
            print(f"{algorithm:>10} threads={n}: fwd {tf:9.2f} ms   fwd+bwd {tb:9.2f} ms", flush=True)
    for name, loop, skip_bwd in (("naive loop, tokens unbound first", unbind_loop, False),
                                 ("naive loop `gated_delta_rule_ref`", ref_loop, args.skip_ref_bwd)):
        fwd, fwd_bwd = naive(loop)
        tf = with_threads(1, lambda: timed(fwd, 1, max(1, args.naive_runs)))
        tb = float("nan") if skip_bwd else with_threads(1, lambda: timed(fwd_bwd, 0, args.naive_runs))
        rows.append((name, 1, tf, tb))
        print(f"{name}: fwd {tf:9.1f} ms   fwd+bwd {tb:9.1f} ms", flush=True)
    load_after = load_average()

    # correctness guard: the chunk path against the reference loop on this input
    with torch.no_grad():
        o_ref = ref_loop()
        o_chunk = gated_delta.gated_delta_rule(q, k, v, g, beta, scale=scale, algorithm="chunk")[0]
    err = ((o_chunk - o_ref).norm() / o_ref.norm()).item()

    ref_fb = {name: tb for name, n, tf, tb in rows if name.startswith("naive")}
    strong = ref_fb["naive loop, tokens unbound first"]
    weak = ref_fb["naive loop `gated_delta_rule_ref`"]

    def fmt(x):
        return "—" if x != x else (f"{x:,.1f}" if x >= 100 else f"{x:.2f}")

    lines = ["| implementation | threads | fwd ms | fwd+bwd ms | fwd+bwd speed-up vs unbound loop | vs `gated_delta_rule_ref` |",
             "|---|---|---|---|---|---|"]
    def ratio(base, t):
        if t != t or base != base:
            return "—"
        x = base / t
        return f"{x:,.0f}×" if x >= 10 else f"{x:.2g}×"

    for name, n, tf, tb in rows:
        s1, s2 = ratio(strong, tb), ratio(weak, tb)
        lines.append(f"| {name} | {n} | {fmt(tf)} | {fmt(tb)} | {s1} | {s2} |")
    table = "\n".join(lines)
    print()
    print(table)
    print(f"\nchunk vs reference loop, relative L2 error of o: {err:.2e}")

    if args.no_write:
        return
    command = "python " + " ".join([os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)] + sys.argv[1:])
    section = f"""## CPU

{datetime.date.today().isoformat()} · {cpu_model()} · {os.cpu_count()} logical CPUs · torch {torch.__version__} · \
{threads} intra-op threads · load average {load_before} before, {load_after} after (the machine was shared)

Command (from the repository root): `{command}`

float32, B={B}, T={T}, H={H}, HV={HV}, K={K}, V={V}, chunk_size={args.chunk_size}, no initial state. Wall-clock
median of {args.runs} runs after {args.warmup} warm-up runs for ours; the naive loops' forward+backward
{args.naive_runs} run(s), with one intra-op thread (their thousands of tiny ops only lose from more threads).
"gated_delta_rule_ref" indexes every token out of the full tensors, so autograd materialises a full-size
gradient per token and its backward grows as T²; "tokens unbound first" is the same loop over tokens split once
(backward linear in T), the stronger baseline. Relative L2 error of the chunk output against the loop: {err:.1e}.
When other processes load the machine, the multi-threaded rows suffer most: a descheduled thread stalls every
parallel region, so compare rows of one run, and single-threaded rows across runs.

{table}
"""
    path = os.path.join(ROOT, "benchmarks", "RESULTS.md")
    text = open(path).read() if os.path.exists(path) else "# Benchmark results\n"
    if re.search(r"^## CPU\n", text, flags=re.M):
        text = re.sub(r"^## CPU\n.*?(?=^## |\Z)", section + "\n", text, flags=re.M | re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    with open(path, "w") as f:
        f.write(text.rstrip("\n") + "\n")
    print(f"wrote {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    main()
