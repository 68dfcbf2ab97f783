"""Throughput checks: how far the sequence length goes, and how throughput scales with the batch size."""
import gc
import math

import torch

from ..testing import fwd_bwd
from .common import (FAIL, PASS, Config, Result, Shape, fastest_seconds, fmt_bytes, fmt_rate, is_oom,
                     md_table, op_inputs, peak_memory_bytes, reset_peak_memory, rss_bytes, save_plot, torch_threads)

TIME_PER_TOKEN_JUMP = 3.0  # the sequence-length sweep stops when time per token exceeds this times the best
BATCH_DROP = 0.75  # a batch size whose throughput is below this fraction of a smaller one's is a drop


def _perf_setup(cfg: Config):
    """Head sizes and dtype of the throughput checks: the production shape on CUDA, a small one on the CPU."""
    if cfg.cuda:
        return dict(H=8, HV=8, K=128, V=128), torch.bfloat16
    return dict(H=2, HV=2, K=32, V=32), torch.float32


def _timing(cfg: Config) -> str:
    return ("wall time, fastest of the repeats" if cfg.cuda else
            "CPU time of one thread, fastest of the repeats (the machine's other load does not count)")


def _release(device):
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _measure(cfg: Config, shape: Shape, dtype, repeats: int):
    """Fastest fwd+bwd seconds and peak bytes (CUDA: wall time, peak allocated; CPU: CPU time of one thread,
    resident set after the run)."""
    inputs = op_inputs(shape, dtype, cfg.device)
    reset_peak_memory(cfg.device)
    run = lambda: fwd_bwd(inputs, use_qk_l2norm_in_kernel=True)  # noqa: E731
    if cfg.cuda:
        seconds = fastest_seconds(run, cfg.device, repeats)
    else:
        with torch_threads(1):
            seconds = fastest_seconds(run, cfg.device, repeats, cpu_time=True)
    mem = peak_memory_bytes(cfg.device)
    if mem is None:
        mem = rss_bytes()
    del inputs
    _release(cfg.device)
    return seconds, mem


def check_seqlen(cfg: Config) -> Result:
    dims, dtype = _perf_setup(cfg)
    if cfg.cuda:
        cap = 2 ** 16 if cfg.quick else 2 ** 20
    else:
        cap = 2 ** 13 if cfg.quick else 2 ** 16
    mem_label = "peak allocated" if cfg.cuda else "process RSS"
    rows, stop, reached = [], None, 0
    best = math.inf
    T = 128
    while T <= cap:
        shape = Shape(B=1, T=T, **dims)
        repeats = 3 if T <= 2 ** 14 else 1
        try:
            seconds, mem = _measure(cfg, shape, dtype, repeats)
            per_token = seconds / T
            if per_token > TIME_PER_TOKEN_JUMP * best:  # measure again before calling it a jump
                seconds, mem = _measure(cfg, shape, dtype, repeats)
                per_token = seconds / T
        except Exception as err:  # noqa: BLE001 -- out of memory ends the sweep, anything else is a failure
            if not is_oom(err):
                raise
            stop = f"out of memory at T={T}"
            break
        rows.append((T, seconds, T / seconds, mem))
        if per_token > TIME_PER_TOKEN_JUMP * best:
            stop = f"time per token jumped {per_token / best:.1f}x at T={T}"
            break
        best = min(best, per_token)
        reached = T
        T *= 2
    _release(cfg.device)  # what an out-of-memory error held
    status = PASS if stop is None else FAIL
    shape_txt = f"B=1 H={dims['H']} HV={dims['HV']} K={dims['K']} V={dims['V']} {str(dtype).replace('torch.', '')}"
    last = rows[-1] if rows else None
    summary = (f"reached T={reached} (cap {cap}) fwd+bwd, {shape_txt}{'' if cfg.cuda else ', 1 thread'}"
               + (f"; stopped: {stop}" if stop else "")
               + (f"; {fmt_rate(last[2])} tok/s, {mem_label} {fmt_bytes(last[3])} at T={last[0]}" if last else ""))

    plot = save_plot(cfg, "seqlen.png", lambda ax: _plot_seqlen(ax, rows, mem_label))
    details = (f"Forward + backward of the op (algorithm 'auto', q/k L2-normalised in the kernel), {shape_txt}. "
               f"T doubles from 128 until out of memory, time per token above {TIME_PER_TOKEN_JUMP:g}x the best "
               f"so far, or the cap T={cap}. Timing: {_timing(cfg)}.\n\n"
               + md_table(["T", "fwd+bwd ms", "tokens/s", mem_label],
                          [[t, f"{s * 1e3:.2f}", fmt_rate(r), fmt_bytes(m)] for t, s, r, m in rows]))
    return Result("seqlen", status, summary, details, [p for p in [plot] if p])


def _plot_seqlen(ax, rows, mem_label):
    ts = [r[0] for r in rows]
    ax.loglog(ts, [r[2] for r in rows], "o-", color="tab:blue", label="tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("tokens/s (fwd+bwd)")
    ax2 = ax.twinx()
    ax2.semilogx([r[0] for r in rows], [r[3] / 2 ** 20 for r in rows], "s--", color="tab:red", label=mem_label)
    ax2.set_xscale("log", base=2)
    ax2.set_ylabel(f"{mem_label} (MiB)")
    ax.set_title("sequence length sweep")


def batch_drops(rates: dict) -> list:
    """(B, smaller B) for each batch size B, in the order given, whose throughput is below BATCH_DROP times that
    of the fastest batch size before it."""
    drops, sizes = [], list(rates)
    for i, B in enumerate(sizes):
        best_prev = max(sizes[:i], key=rates.__getitem__, default=None)
        if best_prev is not None and rates[B] < BATCH_DROP * rates[best_prev]:
            drops.append((B, best_prev))
    return drops


def check_batch(cfg: Config) -> Result:
    dims, dtype = _perf_setup(cfg)
    if cfg.cuda:
        T, batches = (1024, [1, 2, 4, 8, 16, 32]) if cfg.quick else (4096, [1, 2, 4, 8, 16, 32])
    else:
        T, batches = (256, [1, 2, 4, 8, 16]) if cfg.quick else (1024, [1, 2, 4, 8, 16, 32])
    repeats = 3

    def throughput(B):
        seconds, mem = _measure(cfg, Shape(B=B, T=T, **dims), dtype, repeats)
        return B * T / seconds, mem

    rows, stop = {}, None
    for B in batches:
        try:
            rows[B] = throughput(B)
        except Exception as err:  # noqa: BLE001 -- out of memory ends the sweep, anything else is a failure
            if not is_oom(err):
                raise
            stop = f"out of memory at B={B}"
            break
    _release(cfg.device)
    drops = []
    for B, best_prev in batch_drops({b: r[0] for b, r in rows.items()}):
        rows[B], rows[best_prev] = throughput(B), throughput(best_prev)  # confirm before flagging
        if batch_drops({b: rows[b][0] for b in (best_prev, B)}):
            drops.append(f"B={B} {fmt_rate(rows[B][0])} tok/s < {BATCH_DROP:g} x B={best_prev} "
                         f"{fmt_rate(rows[best_prev][0])} tok/s")
    status = FAIL if drops or stop else PASS
    shape_txt = f"T={T} H={dims['H']} HV={dims['HV']} K={dims['K']} V={dims['V']} {str(dtype).replace('torch.', '')}"
    curve = ", ".join(f"B={B}: {fmt_rate(r[0])}" for B, r in rows.items())
    summary = (f"{shape_txt}{'' if cfg.cuda else ', 1 thread'}; tok/s {curve}; "
               + (f"drops: {'; '.join(drops)}" if drops else "no drop") + (f"; stopped: {stop}" if stop else ""))
    mem_label = "peak allocated" if cfg.cuda else "process RSS"

    def draw(ax):
        ax.semilogx(list(rows), [r[0] for r in rows.values()], "o-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size B")
        ax.set_ylabel("tokens/s (fwd+bwd)")
        ax.set_title(f"batch sweep, {shape_txt}")

    plot = save_plot(cfg, "batch.png", draw)
    details = (f"Forward + backward of the op, {shape_txt}. A drop is a batch size whose throughput falls below "
               f"{BATCH_DROP:g} x that of a smaller batch size (confirmed by a second measurement). Timing: "
               f"{_timing(cfg)}.\n\n"
               + md_table(["B", "tokens/s", mem_label],
                          [[B, fmt_rate(r[0]), fmt_bytes(r[1])] for B, r in rows.items()]))
    return Result("batch", status, summary, details, [p for p in [plot] if p])
