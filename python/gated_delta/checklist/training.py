"""Training checks of the GatedDeltaNet layer: multi-process DDP, the CUDA caching allocator, and a soak run."""
import datetime
import math
import os
import statistics
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

import gated_delta

from .common import (FAIL, PASS, SKIP, Config, Result, fastest_seconds, fmt_bytes, md_table, relative_error,
                     rss_bytes, save_plot, spawn_with_deadline, synchronize)

ALLOCATOR_MIN_RATIO = 0.85  # peak active bytes / peak reserved bytes over a loop of varying sequence lengths
CUDA_DRIFT_BYTES = 1 << 20  # allocated bytes may not grow more than this over a soak run
CPU_DRIFT_BYTES = 32 << 20  # resident set may not grow more than this over a soak run


class TinyModel(nn.Module):
    """One GatedDeltaNet layer with a residual and a linear read-out, trained to output the previous token."""

    def __init__(self, hidden: int, heads: int, head_dim: int):
        super().__init__()
        self.mixer = gated_delta.GatedDeltaNet(hidden, heads, head_dim=head_dim, head_v_dim=head_dim, layer_idx=0)
        self.readout = nn.Linear(hidden, hidden)

    def forward(self, x):
        y, _ = self.mixer(x)
        return self.readout(x + y)


def batch(B: int, T: int, hidden: int, seed: int, device):
    """Random tokens and the previous-token target (zero at t = 0): a task a token mixer can learn."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, hidden, generator=gen)
    target = F.pad(x[:, :-1], (0, 0, 1, 0))
    return x.to(device), target.to(device)


def layer_missing() -> str:
    """Why the layer checks cannot run, or "" when gated_delta.GatedDeltaNet is there."""
    return "" if hasattr(gated_delta, "GatedDeltaNet") else "gated_delta.GatedDeltaNet is not available"


# ---- multi-process training ----

DDP_TIMEOUT_S = 300  # the collectives' timeout, and the longest wait for the workers of the ddp check


def _ddp_run(rank: int, world: int, backend: str, device_kind: str, spec: dict) -> dict:
    """One process's part of the ddp check: its gradients (rank 0 also a single process's on the whole batch) and
    its timings."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    hidden, B, T = spec["hidden"], spec["B"], spec["T"]
    x, target = batch(B, T, hidden, seed=1, device=device)
    per_rank = B // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)

    torch.manual_seed(0)
    model = TinyModel(hidden, spec["heads"], spec["head_dim"]).to(device)
    ddp = DDP(model, device_ids=[rank] if backend == "nccl" else None)
    F.mse_loss(ddp(x[mine]), target[mine]).backward()
    result = {"grads": {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}}

    if rank == 0:  # one process on the whole batch, from the same initial weights
        torch.manual_seed(0)
        single = TinyModel(hidden, spec["heads"], spec["head_dim"]).to(device)
        F.mse_loss(single(x), target).backward()
        result["single_grads"] = {n: p.grad.detach().cpu().clone() for n, p in single.named_parameters()}

    flat = torch.cat([p.grad.detach().flatten() for p in model.parameters()])

    def allreduce():
        dist.all_reduce(flat)

    def forward():
        with torch.no_grad():
            model(x[mine])

    def step():
        ddp.zero_grad(set_to_none=True)
        F.mse_loss(ddp(x[mine]), target[mine]).backward()

    dist.barrier()
    result["allreduce_s"] = fastest_seconds(allreduce, device.type, repeats=5)
    result["forward_s"] = fastest_seconds(forward, device.type, repeats=5)
    dist.barrier()
    result["step_s"] = fastest_seconds(step, device.type, repeats=5)
    result["grad_bytes"] = flat.numel() * flat.element_size()
    dist.barrier()
    return result


def _ddp_worker(rank: int, world: int, store_file: str, backend: str, device_kind: str, spec: dict, out_dir: str):
    import gc

    import torch.distributed as dist

    if device_kind == "cpu":
        torch.set_num_threads(1)
    # rendezvous through a file in the check's own directory: no TCP port to pick and lose to another process
    dist.init_process_group(backend, init_method=f"file://{store_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=DDP_TIMEOUT_S))
    try:
        result = _ddp_run(rank, world, backend, device_kind, spec)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        # DDP's reducer holds the process group, and releasing the reducer keeps the GIL: were it the group's last
        # holder, the group's destructor would wait, under the GIL, for a worker thread that needs the GIL to
        # finish its last work (a deadlock). So DDP goes first (its frame has returned; the collection frees any
        # cycle), while the group is still registered, and destroy_process_group then ends the group.
        gc.collect()
        dist.destroy_process_group()


def _max_relative_error(grads, ref):
    """The largest relative error over the parameters, and that parameter's name."""
    errors = {n: relative_error(grads[n], r) for n, r in ref.items()}
    name = max(errors, key=lambda n: math.inf if math.isnan(errors[n]) else errors[n])
    return errors[name], name


def check_ddp(cfg: Config) -> Result:
    missing = layer_missing()
    if missing:
        return Result("ddp", SKIP, missing)
    world = 2
    if cfg.cuda and torch.cuda.device_count() >= world:
        backend, where = "nccl", f"nccl on {world} GPUs"
    elif cfg.cuda:
        backend, where = "gloo", "gloo, both processes on cuda:0 (one GPU)"
    else:
        backend, where = "gloo", "gloo on the CPU"
    if cfg.cuda and not cfg.quick:
        spec = dict(hidden=1024, heads=8, head_dim=128, B=8, T=2048)
    elif cfg.cuda:
        spec = dict(hidden=256, heads=2, head_dim=64, B=4, T=512)
    else:
        spec = dict(hidden=32, heads=2, head_dim=16, B=4, T=48)
    tol = 1e-3 if cfg.cuda else 1e-4
    with tempfile.TemporaryDirectory() as out_dir:
        args = (world, os.path.join(out_dir, "store"), backend, cfg.device, spec, out_dir)
        try:
            spawn_with_deadline(_ddp_worker, args, world, DDP_TIMEOUT_S + 60)
        except TimeoutError as e:
            return Result("ddp", FAIL, f"{world} processes, {where}: {e}")
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]
    err, worst_param = _max_relative_error(ranks[0]["grads"], ranks[0]["single_grads"])
    err_r1, _ = _max_relative_error(ranks[1]["grads"], ranks[0]["grads"])
    allreduce = max(r["allreduce_s"] for r in ranks)
    forward = max(r["forward_s"] for r in ranks)
    step = max(r["step_s"] for r in ranks)
    ok = err <= tol and err_r1 <= tol
    summary = (f"{world} processes, {where}: grads vs one process max rel err {err:.1e} ({worst_param}; tol "
               f"{tol:g}), rank 1 vs rank 0 {err_r1:.1e}; all-reduce of {fmt_bytes(ranks[0]['grad_bytes'])} "
               f"{allreduce * 1e3:.2f} ms vs forward {forward * 1e3:.2f} ms ({allreduce / forward:.2f}x), "
               f"DDP step {step * 1e3:.2f} ms")
    details = (f"A DistributedDataParallel step of `TinyModel` (one GatedDeltaNet layer, {spec}) with the batch split "
               f"over {world} processes ({where}) against one process on the whole batch from the same weights. "
               "Times are the fastest of 5: the all-reduce of a flat buffer of every gradient, the forward of one "
               "process's shard, and a whole DDP step (forward, backward, overlapped all-reduce).\n\n"
               + md_table(["parameter", "rel err"], [[n, f"{relative_error(ranks[0]['grads'][n], g):.1e}"]
                                                     for n, g in ranks[0]["single_grads"].items()]))
    return Result("ddp", PASS if ok else FAIL, summary, details)


# ---- allocator ----

def check_allocator(cfg: Config) -> Result:
    if not cfg.cuda:
        return Result("allocator", SKIP, "the CPU has no caching allocator to measure (torch.cuda.memory_stats is "
                                         "CUDA-only); memory drift on the CPU is measured by the soak check (RSS)")
    missing = layer_missing()
    if missing:
        return Result("allocator", SKIP, missing)
    if cfg.quick:
        hidden, heads, head_dim, B, lengths, steps = 256, 2, 64, 2, [256, 512, 768, 1024, 2048], 15
    else:
        hidden, heads, head_dim, B, lengths, steps = 1024, 8, 128, 2, [512, 1000, 2048, 3000, 4096, 8192], 60
    torch.manual_seed(0)
    model = TinyModel(hidden, heads, head_dim).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)

    def train_step(T, seed):
        x, target = batch(B, T, hidden, seed, "cuda")
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), target).backward()
        opt.step()

    train_step(max(lengths), 0)  # warm-up at the longest length
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    rows = []
    for step in range(steps):
        T = lengths[int(torch.randint(len(lengths), (1,), generator=gen))]
        torch.cuda.reset_peak_memory_stats()
        train_step(T, step + 1)
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        rows.append((T, stats["active_bytes.all.peak"], stats["reserved_bytes.all.current"]))
    peak_active = max(r[1] for r in rows)
    peak_reserved = max(r[2] for r in rows)
    ratio = peak_active / peak_reserved
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default")
    summary = (f"peak active / reserved = {ratio:.3f} (min {ALLOCATOR_MIN_RATIO}) over {steps} steps, T in "
               f"{lengths}; peak active {fmt_bytes(peak_active)}, reserved {fmt_bytes(peak_reserved)}; "
               f"PYTORCH_CUDA_ALLOC_CONF={conf}")

    def draw(ax):
        ax.plot([r[1] / 2 ** 20 for r in rows], "o-", label="peak active (step)")
        ax.plot([r[2] / 2 ** 20 for r in rows], "s--", label="reserved")
        ax.set_xlabel("step")
        ax.set_ylabel("MiB")
        ax.legend()
        ax.set_title("CUDA caching allocator over varying sequence lengths")

    plot = save_plot(cfg, "allocator.png", draw)
    details = (f"AdamW training of `TinyModel` (hidden {hidden}, {heads} heads of {head_dim}), B={B}, sequence "
               f"length drawn per step from {lengths}, after one warm-up step at the longest. The ratio is the "
               "largest per-step peak of active bytes over the largest reserved bytes.\n\n"
               + md_table(["step", "T", "peak active", "reserved"],
                          [[i, r[0], fmt_bytes(r[1]), fmt_bytes(r[2])] for i, r in enumerate(rows)]))
    return Result("allocator", PASS if ratio >= ALLOCATOR_MIN_RATIO else FAIL, summary, details,
                  [p for p in [plot] if p])


# ---- soak ----

def _slope(ys):
    n = len(ys)
    mx, my = (n - 1) / 2, sum(ys) / n
    den = sum((i - mx) ** 2 for i in range(n))
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / den if den else 0.0


def check_soak(cfg: Config) -> Result:
    missing = layer_missing()
    if missing:
        return Result("soak", SKIP, missing)
    if cfg.cuda:
        hidden, heads, head_dim, B, T = (256, 2, 64, 4, 1024) if cfg.quick else (1024, 8, 128, 4, 4096)
        default_steps = 200 if cfg.quick else 2000
    else:
        hidden, heads, head_dim, B, T = 32, 2, 16, 2, 64
        default_steps = 30 if cfg.quick else 300
    steps = cfg.soak_steps or default_steps
    lengths = [T, T // 2, 3 * T // 4]  # a fixed cycle, so the memory of equal phases can be compared
    cycle = len(lengths)
    steps = max(steps, 4 * cycle)
    torch.manual_seed(0)
    model = TinyModel(hidden, heads, head_dim).to(cfg.device)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses, memory = [], []
    for step in range(steps):
        x, target = batch(B, lengths[step % cycle], hidden, seed=step, device=cfg.device)
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        synchronize(cfg.device)
        memory.append(torch.cuda.memory_allocated() if cfg.cuda else rss_bytes())

    failures = []
    if not all(math.isfinite(v) for v in losses):
        failures.append("non-finite loss")
    windows = 5
    size = steps // windows
    slopes = [_slope(losses[w * size:(w + 1) * size]) for w in range(windows)]
    first, last = statistics.mean(losses[:size]), statistics.mean(losses[-size:])
    if not last < first:
        failures.append(f"loss grew: first window {first:.4g}, last {last:.4g}")
    # Memory at the same phase of the length cycle, from after a warm-up fifth of the run to the end.
    start = (steps // 5 // cycle + 1) * cycle - 1
    end = (steps // cycle) * cycle - 1
    drift = memory[end] - memory[start]
    limit = CUDA_DRIFT_BYTES if cfg.cuda else CPU_DRIFT_BYTES
    mem_label = "allocated" if cfg.cuda else "RSS"
    if drift > limit:
        failures.append(f"{mem_label} grew {fmt_bytes(drift)} > {fmt_bytes(limit)}")
    summary = (f"{steps} steps, T cycling {lengths}: loss {first:.4g}->{last:.4g}, window slopes "
               f"{min(slopes):.2e}..{max(slopes):.2e}/step (spread {max(slopes) - min(slopes):.2e}); {mem_label} "
               f"drift {fmt_bytes(drift)} from step {start} to {end} (limit {fmt_bytes(limit)})"
               + (f"; FAIL: {'; '.join(failures)}" if failures else ""))

    def draw(ax):
        ax.semilogy(losses, color="tab:blue", label="loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax2 = ax.twinx()
        ax2.plot([m / 2 ** 20 for m in memory], color="tab:red", label=mem_label)
        ax2.set_ylabel(f"{mem_label} (MiB)")
        ax.set_title("soak: loss and memory per step")

    plot = save_plot(cfg, "soak.png", draw)
    details = (f"Adam training of `TinyModel` (hidden {hidden}, {heads} heads of {head_dim}), B={B}, for {steps} "
               f"steps; the loss is split into {windows} windows with a least-squares slope each. Fails on a "
               f"non-finite loss, a last window not below the first, or {mem_label} growth above "
               f"{fmt_bytes(limit)} between equal phases of the length cycle.\n\n"
               + md_table(["window", "mean loss", "slope / step"],
                          [[w, f"{statistics.mean(losses[w * size:(w + 1) * size]):.4g}", f"{s:.2e}"]
                           for w, s in enumerate(slopes)]))
    return Result("soak", FAIL if failures else PASS, summary, details, [p for p in [plot] if p])
