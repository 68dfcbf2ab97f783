"""GPU benchmark of gated_delta against FlashQLA and flash-linear-attention (FLA) on the shapes of DESIGN.md section 5.

bf16, K = V = 128 (`--head-dims K:V` for others). For each shape and implementation, in one process: forward and forward+backward
- eager time: median of CUDA-event timings after warm-up, rotating several input sets (what a caller waits for,
  host overhead included when the host is slower than the GPU);
- device time: the time the GPU runs the kernels of one call (the union of their intervals from torch.profiler: their
  sum where they run one after another), median over several calls;
- peak extra memory of forward+backward.
FlashQLA (`flash_qla.chunk_gated_delta_rule`) and FLA's chunk_gated_delta_rule are measured when importable. Relative errors against a float64 reference are measured on a
T = 1024 slice of each head configuration (the reference is the token loop, run in float64 on the GPU). Cold start
is the wall time of a fresh process importing the package and running a first forward+backward.

    python benchmarks/bench_gpu.py --out DIR [--no-fla] [--no-qla] [--reps 20] [--rows 1x32768:16:64,...] [--head-dims 256:512]
    python benchmarks/bench_gpu.py --plot-from RUN.json [RUN.json ...] --plot-to PNG     (the plot only, from runs)

Writes DIR/bench_gpu.md (tables), DIR/bench_gpu.json and DIR/bench_gpu.png (device time per row, one bar per
implementation), after every row, so that a run cut short keeps the rows it measured.
FLA's Triton kernels compile (and autotune) on first use, minutes on a fresh machine; Triton keeps them in
TRITON_CACHE_DIR (default ~/.triton/cache), so pointing that at a folder kept between runs spares most of it.
FLA 0.6 hands chunk_gated_delta_rule to FlashQLA whenever FlashQLA is importable (its backend dispatch); the
benchmark turns that dispatch off before importing FLA, so that FLA's rows are FLA's own Triton kernels.
FLA 0.6's gated backward refuses to run on Hopper with Triton < 3.7.1 (a correctness concern of its dq/dk kernel on
those Triton versions); for timing only the benchmark lifts that guard and says so in its output.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

DEFAULT_ROWS = "1x32768:16:64,4x8192:16:64,1x32768:16:32,8x4096:16:32,1x8192:16:32,1x32768:2:8,1x8192:4:8"
K = V = 128  # (--head-dims sets them before anything is made)
L2NORM = False  # (--l2norm: q and k unnormalised, every implementation called with use_qk_l2norm_in_kernel=True)
IMPLS = ("ours", "qla", "fla")  # the implementations a row can hold, in table order
PLOT_STYLE = {"ours": ("gated_delta (CUDA)", "tab:blue"), "qla": ("FlashQLA (TileLang)", "tab:orange"),
              "fla": ("FLA (Triton)", "tab:green")}  # the plot's label and colour of each


def parse_rows(s):
    rows = []
    for item in s.split(","):
        bt, h, hv = item.split(":")
        b, t = bt.split("x")
        rows.append((int(b), int(t), int(h), int(hv)))
    return rows


def make(B, T, H, HV, seed, requires_grad=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    unit = (lambda x: x) if L2NORM else (lambda x: F.normalize(x, dim=-1))  # noqa: E731
    q = unit(torch.randn(B, T, H, K, device="cuda", generator=gen)).bfloat16()
    k = unit(torch.randn(B, T, H, K, device="cuda", generator=gen)).bfloat16()
    v = torch.randn(B, T, HV, V, device="cuda", generator=gen).bfloat16()
    g = F.logsigmoid(torch.randn(B, T, HV, device="cuda", generator=gen) + 3.0)
    beta = torch.sigmoid(torch.randn(B, T, HV, device="cuda", generator=gen)).bfloat16()
    do = torch.randn(B, T, HV, V, device="cuda", generator=gen).bfloat16()
    xs = [q, k, v, g, beta]
    if requires_grad:
        xs = [x.requires_grad_() for x in xs]
    return xs, do


def load_fla():
    # FLA 0.6 hands chunk_gated_delta_rule to registered backends, FlashQLA among them, whenever their package is
    # importable: with FlashQLA on the path its rows would time FlashQLA's kernels under FLA's name. The dispatch is
    # read at import, so it is turned off before FLA is imported: its rows are FLA's own Triton kernels.
    os.environ["FLA_DISABLE_BACKEND_DISPATCH"] = "1"
    os.environ["FLA_FLASH_QLA"] = "0"
    try:
        import fla.ops.common.chunk_o as chunk_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # noqa: BLE001
        print(f"FLA not importable: {e!r}")
        return None, None
    try:
        import fla.backends as fla_backends
    except Exception:  # noqa: BLE001  (a version without backends: nothing to turn off)
        fla_backends = None
    if fla_backends is not None and not getattr(fla_backends, "_DISPATCH_DISABLED", True):
        print("FLA was imported before the benchmark turned its backend dispatch off: FLA is left out")
        return None, None
    notes = ["FLA's backend dispatch was turned off (FLA_DISABLE_BACKEND_DISPATCH=1, FLA_FLASH_QLA=0), so its rows "
             "time FLA's own Triton kernels, not FlashQLA's"]
    if hasattr(chunk_o, "TRITON_ABOVE_3_7_1") and not chunk_o.TRITON_ABOVE_3_7_1:
        chunk_o.TRITON_ABOVE_3_7_1 = True
        notes.append("FLA's Hopper/Triton<3.7.1 guard of its gated backward was lifted for timing")
    return chunk_gated_delta_rule, "; ".join(notes)


def load_qla():
    try:
        from flash_qla import chunk_gated_delta_rule
    except Exception as e:  # noqa: BLE001
        print(f"FlashQLA not importable: {e!r}")
        return None
    return chunk_gated_delta_rule


def impls(use_fla, use_qla=True):
    from gated_delta import gated_delta_rule

    kw = {"scale": K ** -0.5, "use_qk_l2norm_in_kernel": L2NORM}
    out = {"ours": lambda q, k, v, g, b: gated_delta_rule(q, k, v, g, b, **kw)[0]}
    note = None
    if use_qla:
        qla = load_qla()
        if qla is not None:
            out["qla"] = lambda q, k, v, g, b: qla(q, k, v, g, b, **kw)[0]
    if use_fla:
        fla, note = load_fla()
        if fla is not None:
            out["fla"] = lambda q, k, v, g, b: fla(q, k, v, g, b, **kw)[0]
    return out, note


def time_fn(fn, sets, reps, warmup=3):
    for i in range(warmup):
        fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    times = []
    for r in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        args = sets[r % len(sets)]
        a.record()
        fn(*args)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def busy_us(intervals):
    """The length of the union of (start, end) intervals: the time the GPU runs at least one of the call's kernels.
    For kernels on one stream, which never overlap, it is the sum of their durations; kernels on two streams at once
    count once."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def device_time(fn, sets, calls=5):
    """Median over `calls` calls of one call's device time (torch.profiler's kernels, memcopies and memsets: the
    union of their intervals, `busy_us`), in ms."""
    fn(*sets[0])
    torch.cuda.synchronize()
    per_call = []
    for c in range(calls):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn(*sets[c % len(sets)])
            torch.cuda.synchronize()
        per_call.append(busy_us([(e.time_range.start, e.time_range.end) for e in prof.events()
                                 if e.device_type == torch.autograd.DeviceType.CUDA]) / 1000.0)
    return statistics.median(per_call)


def peak_extra_bytes(fn, *args):
    """`max_memory_allocated` during one call fn(*args) minus what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(*args)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def bench_row(row, fns, reps, nsets, skip=()):
    B, T, H, HV = row
    res = {}
    fwd_sets = [make(B, T, H, HV, seed=s)[0] for s in range(nsets)]
    bwd_sets = [make(B, T, H, HV, seed=100 + s, requires_grad=True) for s in range(nsets)]
    for name, f in fns.items():
        if name in skip:
            continue
        with torch.no_grad():
            t_f = time_fn(lambda *x: f(*x), fwd_sets, reps)
            d_f = device_time(lambda *x: f(*x), fwd_sets)

        def fb(xs, do):
            for x in xs:
                x.grad = None  # time the gradients, not their accumulation
            o = f(*xs)
            o.backward(do)

        t_fb = time_fn(lambda xs, do: fb(xs, do), bwd_sets, reps)
        d_fb = device_time(lambda xs, do: fb(xs, do), bwd_sets)
        for xs, _ in bwd_sets:
            for x in xs:
                x.grad = None
        peak = peak_extra_bytes(fb, *bwd_sets[0])
        for x in bwd_sets[0][0]:
            x.grad = None
        res[name] = {"fwd_ms": t_f, "fwdbwd_ms": t_fb, "fwd_dev_ms": d_f, "fwdbwd_dev_ms": d_fb,
                     "peak_extra_gib": peak / 2 ** 30}
        print(f"  {name:5s} {B}x{T} H={H} HV={HV}: fwd {t_f:.3f} ms (device {d_f:.3f})  fwd+bwd {t_fb:.3f} ms "
              f"(device {d_fb:.3f})  peak extra {peak / 2**30:.2f} GiB", flush=True)
    del fwd_sets, bwd_sets
    torch.cuda.empty_cache()
    return res


def profile(row, fns):
    """Per-kernel CUDA time of one forward+backward (after warm-up), for each implementation."""
    B, T, H, HV = row
    xs, do = make(B, T, H, HV, seed=5, requires_grad=True)
    for name, f in fns.items():
        for _ in range(2):
            f(*xs).backward(do)
        for x in xs:
            x.grad = None  # profile the gradients, not their accumulation into .grad
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            f(*xs).backward(do)
            torch.cuda.synchronize()
        tot = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                key = e.name[:90]
                tot[key] = tot.get(key, 0.0) + e.device_time_total / 1000.0
        print(f"  profile {name} {B}x{T} H={H} HV={HV}: total {sum(tot.values()):.3f} ms")
        for key, ms in sorted(tot.items(), key=lambda kv: -kv[1])[:14]:
            print(f"    {ms:8.3f} ms  {key}")
        for x in xs:
            x.grad = None


def errors(H, HV, fns, T=1024):
    from gpu_helpers import reference, rel_err

    xs, do = make(1, T, H, HV, seed=999)
    inp = dict(q=xs[0], k=xs[1], v=xs[2], g=xs[3], beta=xs[4], use_qk_l2norm_in_kernel=L2NORM)
    ref = reference(inp, d_o=do, d_ht=torch.zeros(1, HV, K, V, device="cuda"))
    out = {}
    for name, f in fns.items():
        ys = [x.detach().clone().requires_grad_() for x in xs]
        o = f(*ys)
        o.backward(do)
        e = {"o": rel_err(o, ref["o"])}
        for n, y in zip(("q", "k", "v", "g", "beta"), ys):
            e["d" + n] = rel_err(y.grad, ref["d" + n])
        out[name] = e
    return out


COLD = r"""
import time, sys
t0 = time.time()
import torch
torch.cuda.init()
{imp}
import torch.nn.functional as F
q = F.normalize(torch.randn(1, 2048, 4, 128, device='cuda'), dim=-1).bfloat16().requires_grad_()
k = F.normalize(torch.randn(1, 2048, 4, 128, device='cuda'), dim=-1).bfloat16().requires_grad_()
v = torch.randn(1, 2048, 8, 128, device='cuda').bfloat16().requires_grad_()
g = F.logsigmoid(torch.randn(1, 2048, 8, device='cuda') + 3).requires_grad_()
b = torch.rand(1, 2048, 8, device='cuda').bfloat16().requires_grad_()
o = {call}
o.backward(torch.randn_like(o))
torch.cuda.synchronize()
print(time.time() - t0)
"""


def cold_start(which):
    if which == "torch":  # the floor: the same process with a plain torch op instead of the gated delta rule
        imp, call = "", "v * g[..., None] * b[..., None] + q.float().sum() + k.float().sum()"
    elif which == "ours":
        imp, call = "from gated_delta import gated_delta_rule", "gated_delta_rule(q, k, v, g, b)[0]"
    else:
        imp = ("import fla.ops.common.chunk_o as co; co.TRITON_ABOVE_3_7_1 = True\n"
               "from fla.ops.gated_delta_rule import chunk_gated_delta_rule")
        call = "chunk_gated_delta_rule(q, k, v, g, b)[0]"
    try:
        r = subprocess.run([sys.executable, "-c", COLD.format(imp=imp, call=call)], capture_output=True, text=True,
                           timeout=900)
        return float(r.stdout.strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001
        print(f"cold start of {which} failed: {e!r}")
        return None


def plot(results, path, gpu):
    """Device time per row, one bar per implementation (log scale), forward and forward+backward side by side."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return False
    impls_ = [(n, *PLOT_STYLE[n]) for n in IMPLS if any(n in r for r in results)]
    labels = [f'{r["B"]}x{r["T"]}\n{r["H"]}/{r["HV"]}' for r in results]
    width = 0.8 / max(1, len(impls_))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, key, title in ((axes[0], "fwd_dev_ms", "forward"), (axes[1], "fwdbwd_dev_ms", "forward + backward")):
        for i, (name, lab, col) in enumerate(impls_):
            xs = [j + (i - (len(impls_) - 1) / 2) * width for j, r in enumerate(results) if name in r]
            ys = [r[name][key] for r in results if name in r]
            bars = ax.bar(xs, ys, width, label=lab, color=col)
            ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=6, rotation=90, padding=2)
        ax.set_xticks(range(len(results)), labels, fontsize=8)
        ax.set_yscale("log")
        top = max(r[n][key] for r in results for n, _, _ in impls_ if n in r)
        ax.set_ylim(top=top * 1.8)  # room for the bars' labels
        ax.set_ylabel("device ms per call (log)")
        ax.set_xlabel("B x T, H / HV")
        ax.set_title(f"{title}, bf16, K = {K}, V = {V}, {gpu}")
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def report(meta, note, results, errs, cold):
    """The tables of bench_gpu.md."""
    lines = [f"Date {meta['date']}; {meta['gpu']}; torch {meta['torch']} (CUDA {meta['cuda']}); "
             f"triton {meta.get('triton', '-')}; FLA {meta.get('fla', '-')}; FlashQLA {meta.get('flash_qla', '-')} "
             f"(TileLang {meta.get('tilelang', '-')}); gated_delta {meta['gated_delta']}; bf16, K = {meta.get('K', 128)}, "
             f"V = {meta.get('V', 128)}." + (" q and k unnormalised, normalised by each implementation "
                                              "(use_qk_l2norm_in_kernel=True)." if meta.get("l2norm") else ""),
             # (runs before --head-dims: K = V = 128)
             f"Command: `{meta['command']}`.", ""]
    if note:
        lines += [f"Note: {note}.", ""]
    names = [n for n in IMPLS if any(n in r for r in results)]
    label = {"ours": "ours", "qla": "FlashQLA", "fla": "FLA"}
    lines += ["Device time (the GPU's busy time per call: the union of its kernels' intervals, torch.profiler) and "
              "eager time (CUDA events around "
              "the call, host overhead included), ms; peak extra memory of forward+backward, GiB. A dash: not "
              "measured on that row.", ""]
    hdr = "| B x T | H | HV | pass |" + "".join(f" {label[n]} device | {label[n]} eager |" for n in names)
    others = [n for n in names if n != "ours"]
    hdr += "".join(f" ours / {label[n]} (device) |" for n in others)
    lines += [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for r in results:
        for key, pas in (("fwd", "fwd"), ("fwdbwd", "fwd+bwd")):
            cells = []
            for n in names:
                m = r.get(n)
                cells += [f"{m[key + '_dev_ms']:.3f}", f"{m[key + '_ms']:.3f}"] if m else ["-", "-"]
            for n in others:
                m = r.get(n)
                cells.append(f"{r['ours'][key + '_dev_ms'] / m[key + '_dev_ms']:.2f}" if m else "-")
            lines.append(f"| {r['B']} x {r['T']} | {r['H']} | {r['HV']} | {pas} | " + " | ".join(cells) + " |")
    lines += ["", "| B x T | H | HV |" + "".join(f" peak {label[n]} |" for n in names),
              "|---|---|---|" + "---|" * len(names)]
    for r in results:
        lines.append(f"| {r['B']} x {r['T']} | {r['H']} | {r['HV']} | " +
                     " | ".join(f"{r[n]['peak_extra_gib']:.2f}" if n in r else "-" for n in names) + " |")
    if errs:
        lines += ["", "Relative L2 error against the float64 reference (B=1, T=1024, same heads):", "",
                  "| H/HV | impl | o | dq | dk | dv | dg | dbeta |", "|---|---|---|---|---|---|---|---|"]
        for hh, e in errs.items():
            for name, v in e.items():
                lines.append(f"| {hh} | {name} | " + " | ".join(f"{v[k]:.2e}" for k in
                                                                 ("o", "dq", "dk", "dv", "dg", "dbeta")) + " |")
    if cold:
        lines += ["", "Cold start (fresh process: import + first forward+backward, 1x2048, H=4, HV=8): " +
                  ", ".join(f"{k} {v:.1f} s" if v is not None else f"{k} failed" for k, v in cold.items()) +
                  (" (FLA with the Triton cache already warm from this run)" if "fla" in cold else "")]
    return "\n".join(lines) + "\n"


def write_outputs(out, meta, note, results, errs, cold):
    md = report(meta, note, results, errs, cold)
    with open(os.path.join(out, "bench_gpu.md"), "w") as fh:
        fh.write(md)
    with open(os.path.join(out, "bench_gpu.json"), "w") as fh:
        json.dump({"meta": meta, "results": results, "errors": errs, "cold": cold}, fh, indent=1)
    plot(results, os.path.join(out, "bench_gpu.png"), meta["gpu"])
    return md


def merge_results(paths):
    """The rows of several bench_gpu.json files, merged by shape: an implementation measured in more than one file
    keeps the first file's figures. Rows come in the order of DEFAULT_ROWS, others after them in first-seen order.
    Returns (rows, GPU name of the first file)."""
    rows, gpu = {}, None
    for path in paths:
        with open(path) as fh:
            data = json.load(fh)
        gpu = gpu or data.get("meta", {}).get("gpu", "")
        for r in data["results"]:
            key = (r["B"], r["T"], r["H"], r["HV"])
            merged = rows.setdefault(key, {k: r[k] for k in ("B", "T", "H", "HV")})
            for name in IMPLS:
                if name in r and name not in merged:
                    merged[name] = r[name]
    order = {row: i for i, row in enumerate(parse_rows(DEFAULT_ROWS))}
    keys = sorted(rows, key=lambda k: order.get(k, len(order)))  # (stable: the rest stay in first-seen order)
    return [rows[k] for k in keys], gpu


def main():
    global K, V, L2NORM
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", default=DEFAULT_ROWS)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sets", type=int, default=3)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--no-qla", action="store_true", help="leave FlashQLA out")
    ap.add_argument("--head-dims", default=f"{K}:{V}", metavar="K:V", help="head dims of q/k and of v")
    ap.add_argument("--l2norm", action="store_true",
                    help="q and k unnormalised, every implementation normalising them (use_qk_l2norm_in_kernel=True), "
                         "as a Gated DeltaNet layer calls it")
    ap.add_argument("--no-errors", action="store_true")
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--no-fla-cold", action="store_true")
    ap.add_argument("--profile", default="", help="rows (same syntax) to break down per kernel")
    ap.add_argument("--fla-budget-s", type=float, default=1e9,
                    help="start no new FLA measurement after this many seconds (its JIT compilation is slow)")
    ap.add_argument("--plot-from", nargs="+", metavar="JSON",
                    help="draw the plot from these bench_gpu.json files (rows merged by shape) into --plot-to, and "
                         "measure nothing")
    ap.add_argument("--plot-to", default="bench_gpu.png")
    args = ap.parse_args()
    K, V = (int(x) for x in args.head_dims.split(":"))
    L2NORM = args.l2norm
    if args.plot_from:
        results, gpu = merge_results(args.plot_from)
        if not plot(results, args.plot_to, gpu):
            sys.exit("matplotlib is needed for the plot")
        print(f"{args.plot_to}: {len(results)} rows from {', '.join(args.plot_from)}")
        return
    os.makedirs(args.out, exist_ok=True)
    fns, note = impls(not args.no_fla, not args.no_qla)
    rows = parse_rows(args.rows)
    import gated_delta

    meta = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gated_delta": gated_delta.__version__,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "note": note,
        "K": K,
        "V": V,
        "l2norm": L2NORM,
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    for mod in ("fla", "flash_qla", "tilelang"):
        try:
            meta[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception:  # noqa: BLE001
            pass
    print(meta, flush=True)
    t_start = time.time()
    for prow in (parse_rows(args.profile) if args.profile else []):
        profile(prow, fns)
    results = []
    for row in rows:
        B, T, H, HV = row
        r = {"B": B, "T": T, "H": H, "HV": HV}
        skip = ("fla",) if time.time() - t_start > args.fla_budget_s else ()
        r.update(bench_row(row, fns, args.reps, args.sets, skip))
        results.append(r)
        write_outputs(args.out, meta, note, results, {}, {})  # so far (a run cut short keeps its rows)
    errs = {}
    if not args.no_errors:
        for H, HV in sorted({(r[2], r[3]) for r in rows}):
            efns = fns if time.time() - t_start <= args.fla_budget_s else {"ours": fns["ours"]}
            errs[f"{H}/{HV}"] = errors(H, HV, efns)
            print(f"  errors H={H} HV={HV}: {errs[f'{H}/{HV}']}", flush=True)
    cold = {}
    if not args.no_cold:
        cold["torch only"] = cold_start("torch")
        cold["ours"] = cold_start("ours")
        if "fla" in fns and not args.no_fla_cold:
            cold["fla"] = cold_start("fla")
        print(f"  cold start: {cold}", flush=True)

    md = write_outputs(args.out, meta, note, results, errs, cold)
    print("\n" + md)


if __name__ == "__main__":
    main()
