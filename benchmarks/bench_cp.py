"""Context parallelism across GPUs (NCCL): correctness against one GPU, then speed.

    torchrun --nproc_per_node 2 benchmarks/bench_cp.py --out cp_h200.md
    python benchmarks/bench_cp.py --device cpu --nproc 2 --quick        # a smoke test on the CPU (gloo)

1. Correctness. Each rank holds the whole (small) problem, runs it on its own device in one process and, with the
   sequence split, over the group; both are compared with float64 on the CPU (the library's op, from the same
   rounded inputs): the op with a packed batch whose middle sequence crosses the rank boundary and an equal-length
   batch, both with initial and final states, in bfloat16 and float32, and the GatedDeltaNet layer. A row passes when
   the split run's error against float64 is at most 1.1x the one-device run's (1.5x in float32) plus a small slack
   (for bfloat16, one rounding per rank of the shares of replicated gradients).
2. Speed. B = 1, H = 16, HV = 32, K = V = 128, bfloat16: forward+backward of the whole sequence on one GPU against
   the sequence split over the group; the all-gathers of one forward+backward timed on their own; peak memory. A
   size that does not fit is reported as such.

Prints a markdown table and writes it to --out.
"""
import argparse
import datetime
import os
import statistics
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (SHARP) on the lent machines

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import gated_delta  # noqa: E402


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    d = b.norm().item()
    return (a - b).norm().item() / d if d else (a - b).norm().item()


def bounds(T, rank, world):
    sizes = [T // world + (r < T % world) for r in range(world)]
    return sum(sizes[:rank]), sum(sizes[:rank + 1])


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_inputs(T, B, H, HV, K, V, N, gen):
    """Float64 inputs on the CPU, as in the library's benchmarks: unit-norm-ish q, k (normalised in the kernel),
    g = logsigmoid(N(0,1) + 3), beta = sigmoid(N(0,1)), a random initial state."""
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=F.logsigmoid(r(B, T, HV) + 3),
                beta=torch.sigmoid(r(B, T, HV)), initial_state=r(N, HV, K, V) * 0.1)


def cast(inputs, dtype, device):
    sd = torch.float64 if dtype == torch.float64 else torch.float32
    out = {}
    for n, t in inputs.items():
        out[n] = t.to(device, sd if n in ("g", "initial_state") else dtype)
    return out


def op_run(inputs, cu, d_o, d_ht, group=None, slc=None):
    """o, final state and gradients of <o, d_o> + <final, d_ht> (on the slice slc of the tokens with group)."""
    x = {n: (t[:, slc] if slc is not None and n != "initial_state" else t).detach().clone().requires_grad_(True)
         for n, t in inputs.items()}
    do = d_o[:, slc] if slc is not None else d_o
    o, ht = gated_delta.gated_delta_rule(**x, cu_seqlens=cu, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                         cp_group=group)
    ((o.double() * do.to(o.device)).sum() + (ht.double() * d_ht.to(ht.device)).sum()).backward()
    return {"o": o, "final_state": ht, **{"d" + n: t.grad for n, t in x.items()}}


def check_op(rows, name, dtype, device, group, T, B, lengths, gen):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    H, HV, K, V = 4, 8, 128, 128
    if device.type == "cpu":
        H, HV, K, V = 2, 4, 32, 32
    N = len(lengths) if lengths else B
    inputs = make_inputs(T, B, H, HV, K, V, N, gen)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32) if lengths else None
    d_o = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64)
    d_ht = torch.randn(N, HV, K, V, generator=gen, dtype=torch.float64)
    low = cast(inputs, dtype, device)
    ref = op_run({n: t.double().cpu() for n, t in low.items()}, cu, d_o, d_ht)
    one = op_run(low, cu.to(device) if cu is not None else None, d_o, d_ht)
    s, e = bounds(T, rank, world)
    got = op_run(low, cu.to(device) if cu is not None else None, d_o, d_ht, group, slice(s, e))
    got["final_state"] = all_sum(got["final_state"], group)
    got["dinitial_state"] = all_sum(got["dinitial_state"], group)
    for q in got:
        rep = q in ("final_state", "dinitial_state")
        compare(rows, f"{name}, {str(dtype)[6:]}", q, got[q], one[q] if rep else one[q][:, s:e],
                ref[q] if rep else ref[q][:, s:e], dtype, world, rep)


def check_layer(rows, dtype, device, group, T, lengths, gen):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(0)
    kw = dict(hidden_size=256, num_heads=2, num_v_heads=4, head_dim=64 if device.type == "cuda" else 32)
    base = gated_delta.GatedDeltaNet(**kw).to(dtype)  # rounded once: every copy below holds the same values
    layers = {}
    for key, dev, dt, grp in (("ref", torch.device("cpu"), torch.float64, None), ("one", device, dtype, None),
                              ("cp", device, dtype, group)):
        layer = gated_delta.GatedDeltaNet(**kw, cp_group=grp).to(dev, dt)
        layer.load_state_dict(base.state_dict())
        layers[key] = layer
    x = torch.randn(1, T, kw["hidden_size"], generator=gen).to(dtype)
    dy = torch.randn(1, T, kw["hidden_size"], generator=gen, dtype=torch.float64)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    s, e = bounds(T, rank, world)
    out = {}
    for key, layer in layers.items():
        dev, dt = next(layer.parameters()).device, next(layer.parameters()).dtype
        slc = slice(s, e) if key == "cp" else slice(None)
        xi = x[:, slc].to(dev, dt).requires_grad_(True)
        y, _ = layer(xi, cu_seqlens=cu.to(dev))
        (y.double() * dy[:, slc].to(dev)).sum().backward()
        grads = {"d" + n: p.grad for n, p in layer.named_parameters()}
        if key == "cp":
            grads = {n: all_sum(g, group) for n, g in grads.items()}
        out[key] = {"y": y, "dx": xi.grad, **grads}
    for q in out["cp"]:
        rep = q not in ("y", "dx")
        compare(rows, f"layer, {str(dtype)[6:]}", q, out["cp"][q], out["one"][q] if rep else out["one"][q][:, s:e],
                out["ref"][q] if rep else out["ref"][q][:, s:e], dtype, world, rep)


def all_sum(t, group):
    t = t.detach().double() if t.device.type == "cpu" else t.detach().float()
    dist.all_reduce(t, group=group)
    return t


def compare(rows, case, q, got, one, ref, dtype, world, replicated):
    err_cp, err_one = rel(got, ref), rel(one, ref)
    factor, slack = (1.5, 1e-6) if dtype == torch.float32 else (1.1, 1e-4)
    if replicated and dtype != torch.float32:
        slack += world * torch.finfo(dtype).eps / 2
    rows.append((case, q, err_one, err_cp, rel(got, one), err_cp <= factor * err_one + slack))


def timed(fn, reps, warmup, device, group):
    """Median over reps of the slowest rank's wall time of fn() (ms); None when any rank ran out of memory."""
    times = []
    for i in range(warmup + reps):
        dist.barrier(group=group)
        sync(device)
        t0 = time.perf_counter()
        ok = 1.0
        try:
            fn()
            sync(device)
        except RuntimeError as exc:  # out of memory here, or on another rank (then reported by the op)
            print(f"rank {dist.get_rank(group)}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            ok = 0.0
        t = torch.tensor([time.perf_counter() - t0, -ok], device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        if t[1].item() > -1:
            return None
        if i >= warmup:
            times.append(t[0].item() * 1e3)
    return statistics.median(times)


def speed_inputs(T, H, HV, K, V, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=device, dtype=torch.bfloat16)  # noqa: E731
    q = F.normalize(r(1, T, H, K), dim=-1)
    k = F.normalize(r(1, T, H, K), dim=-1)
    v = r(1, T, HV, V)
    g = F.logsigmoid(r(1, T, HV).float() + 3)
    beta = torch.sigmoid(r(1, T, HV))
    return [t.requires_grad_(True) for t in (q, k, v, g, beta)]


def fwd_bwd(inputs, group):
    for t in inputs:
        t.grad = None
    o, _ = gated_delta.gated_delta_rule(*inputs, cp_group=group)
    o.backward(torch.ones_like(o))  # any cotangent: the time does not depend on its values


def collective_ms(group, device, HV, K, V, reps):
    """The all-gathers of one forward+backward of the op, timed on their own: the metadata (int64), the maps
    [HV, K, V + K] and the gradient terms [HV, K, V] (float32, one flag each)."""
    bufs = [torch.zeros(25, dtype=torch.int64, device=device), torch.zeros(HV * K * (V + K) + 1, device=device),
            torch.zeros(HV * K * V + 1, device=device)]
    world = dist.get_world_size(group)
    outs = [b.new_empty(world * b.numel()) for b in bufs]

    def gathers():
        for b, o in zip(bufs, outs):
            if device.type == "cuda":
                dist.all_gather_into_tensor(o, b, group=group)
            else:
                dist.all_gather(list(o.chunk(world)), b, group=group)

    return timed(gathers, reps, 3, device, group)


def main_worker(rank, args, port):
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(rank))
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=600))
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the float64 references share the host's cores
    lines = []

    def say(line=""):
        if rank == 0:
            print(line, flush=True)
            lines.append(line)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    say(f"# Context parallelism: {world} x {name}, {dist.get_backend()}, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}")
    say()
    say(f"Command: `{' '.join(sys.argv)}` ({'torchrun' if port is None else 'processes started by the script'})")

    # ---- 1. correctness
    gen = torch.Generator().manual_seed(0)
    T = 4096 if not args.quick else 512
    rows = []
    lengths = [T // 4, T // 2 + 7, T - T // 4 - T // 2 - 7]  # the middle sequence crosses every boundary
    for dtype in (torch.bfloat16, torch.float32):
        check_op(rows, f"op, packed batch {lengths}", dtype, device, group, T, 1, lengths, gen)
        check_op(rows, "op, equal-length batch of 2", dtype, device, group, T // 2, 2, None, gen)
        check_layer(rows, dtype, device, group, T // 2, [T // 8, T // 4, T // 2 - T // 8 - T // 4], gen)
    every = [None] * world  # each rank compares its own slice: report the worst rank
    dist.all_gather_object(every, rows, group=group)
    rows = [(rs[0][0], rs[0][1], max(x[2] for x in rs), max(x[3] for x in rs), max(x[4] for x in rs),
             all(x[5] for x in rs)) for rs in zip(*every)]
    say()
    say(f"## Correctness (relative L2 error against float64 on the CPU, the worst rank's slice; T = {T}, sequence "
        f"split over {world})")
    say()
    say("| case | quantity | one device | split | split vs one device | pass |")
    say("|---|---|---|---|---|---|")
    bad = 0
    for case, q, e1, e2, e12, ok in rows:
        bad += not ok
        say(f"| {case} | {q} | {e1:.2e} | {e2:.2e} | {e12:.2e} | {'yes' if ok else '**NO**'} |")
    say()
    say(f"{len(rows) - bad} of {len(rows)} rows pass.")

    # ---- 2. speed
    H, HV, K, V = (16, 32, 128, 128) if not args.quick else (2, 4, 32, 32)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else (
        [65536, 262144, 1048576] if not args.quick else [2048, 8192])
    say()
    say(f"## Speed (B = 1, H = {H}, HV = {HV}, K = V = {K}, bf16; forward+backward, median of {args.reps} after "
        f"{args.warmup} warm-up, the slowest rank's wall time)")
    say()
    coll = collective_ms(group, device, HV, K, V, args.reps)
    say(f"The all-gathers of one forward+backward, timed alone: {coll:.3f} ms.")
    say()
    say(f"| T | 1 device ms | 1 device tokens/s | peak GiB | {world} devices ms | {world} devices tokens/s | "
        f"peak GiB per rank | speed-up |")
    say("|---|---|---|---|---|---|---|---|")
    for T in sizes:
        one_ms = one_peak = None
        if rank == 0:
            torch.manual_seed(0)
            try:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                inputs = speed_inputs(T, H, HV, K, V, device, 1)
                one_ms = timed_local(lambda: fwd_bwd(inputs, None), args.reps, args.warmup, device)
                one_peak = peak_gib(device)
            except torch.OutOfMemoryError:
                one_ms = None
            inputs = None
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        s, e = bounds(T, rank, world)
        cp_ms = cp_peak = None
        try:
            inputs = speed_inputs(e - s, H, HV, K, V, device, 2 + rank)
        except torch.OutOfMemoryError:
            inputs = None
        ok = torch.tensor([0.0 if inputs is None else 1.0], device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if ok.item() == 1.0:
            cp_ms = timed(lambda: fwd_bwd(inputs, group), args.reps, args.warmup, device, group)
            cp_peak = peak_gib(device)
        inputs = None
        peak = torch.tensor([cp_peak or 0.0], device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        fmt = lambda ms: f"{ms:.2f}" if ms is not None else "does not fit"  # noqa: E731
        tok = lambda ms: f"{T / ms * 1e3:,.0f}" if ms is not None else "—"  # noqa: E731
        speedup = f"{one_ms / cp_ms:.2f}x" if one_ms and cp_ms else "—"
        say(f"| {T:,} | {fmt(one_ms)} | {tok(one_ms)} | {one_peak or 0:.1f} | {fmt(cp_ms)} | {tok(cp_ms)} | "
            f"{peak.item():.1f} | {speedup} |")
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"wrote {args.out}")
    dist.destroy_process_group()
    if bad:
        raise SystemExit(f"{bad} correctness rows failed")


def timed_local(fn, reps, warmup, device):
    times = []
    for i in range(warmup + reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_gib(device):
    return torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write the markdown here (rank 0)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--nproc", type=int, default=2, help="processes to start when not run under torchrun")
    ap.add_argument("--sizes", default=None, help="comma-separated T of the speed table")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="small shapes (a smoke test, e.g. on the CPU)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --device cpu (with --quick) for a smoke test")
    if "RANK" in os.environ:  # torchrun
        main_worker(int(os.environ["RANK"]), args, None)
    else:
        import socket
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(main_worker, args=(args, port), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
