"""What every check shares: the run configuration, results, timing, memory readings, inputs and plots."""
import contextlib
import dataclasses
import os
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F


PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclasses.dataclass
class Config:
    device: str  # "cpu" or "cuda"
    quick: bool
    out: str
    soak_steps: Optional[int] = None  # None: the check's default for the mode

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


@dataclasses.dataclass
class Result:
    name: str
    status: str  # PASS, FAIL or SKIP
    summary: str  # the figures, on one line
    details: str = ""  # markdown for the report: tables, notes
    plots: List[str] = dataclasses.field(default_factory=list)  # file names under the output folder
    seconds: float = 0.0

    def line(self) -> str:
        return f"{self.status} {self.name:<12} {self.summary} [{self.seconds:.1f}s]"


@dataclasses.dataclass
class Shape:
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int


def spawn_with_deadline(fn, args, nprocs: int, seconds: float) -> None:
    """torch.multiprocessing.spawn that raises TimeoutError, after ending the workers, when they have not all
    finished within seconds."""
    ctx = torch.multiprocessing.spawn(fn, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + seconds
    while not ctx.join(timeout=max(0.0, min(5.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join()
            raise TimeoutError(f"{nprocs} workers did not all finish within {seconds:g} s")


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def fastest_seconds(fn: Callable[[], object], device: str, repeats: int, warmup: int = 1,
                    cpu_time: bool = False) -> float:
    """Shortest time of fn() over `repeats` runs after `warmup` runs, with the device synchronised (the shortest,
    as other work on the machine only ever adds time). cpu_time: CPU time of this process instead of wall time."""
    clock = time.process_time if cpu_time else time.perf_counter
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        synchronize(device)
        times.append(clock() - start)
    return min(times)


@contextlib.contextmanager
def torch_threads(n: int):
    """Runs the block with n intra-op threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def is_oom(err: BaseException) -> bool:
    if isinstance(err, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(err, (RuntimeError, MemoryError)) and (
        isinstance(err, MemoryError) or "out of memory" in str(err).lower()
        or "can't allocate memory" in str(err).lower())


def reset_peak_memory(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_memory_bytes(device: str) -> Optional[int]:
    """Peak bytes allocated by tensors since the last reset (CUDA); None on the CPU, where no allocator counts."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return None


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def fmt_rate(x: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.0f}"


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the state, and of g and beta as the kernels use them: float64 for float64 inputs, else
    float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def op_inputs(shape: Shape, dtype: torch.dtype, device: str, requires_grad: bool = True,
              seed: int = 0) -> Dict[str, torch.Tensor]:
    """Typical inputs of a Gated DeltaNet layer: raw q, k (normalised in the kernel), v, a log decay g < 0 and
    beta in (0, 1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    s = shape

    def rand(*size, fn=None):  # drawn on the device: a million-token input is not made on the host
        x = torch.randn(*size, generator=gen, device=device)
        return fn(x) if fn else x

    tensors = dict(
        q=rand(s.B, s.T, s.H, s.K), k=rand(s.B, s.T, s.H, s.K), v=rand(s.B, s.T, s.HV, s.V),
        g=rand(s.B, s.T, s.HV, fn=lambda x: F.logsigmoid(x + 4.0)),
        beta=rand(s.B, s.T, s.HV, fn=torch.sigmoid))
    out = {}
    for name, x in tensors.items():
        x = x.to(device=device, dtype=dtype if name in ("q", "k", "v") else state_dtype(dtype))
        out[name] = x.requires_grad_(requires_grad)
    return out


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref||, in float64 on the CPU."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def save_plot(cfg: Config, filename: str, draw: Callable) -> Optional[str]:
    """Draws with draw(ax) into cfg.out/filename (PNG); returns the file name, or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=100)
    try:
        draw(ax)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        os.makedirs(cfg.out, exist_ok=True)
        fig.savefig(os.path.join(cfg.out, filename))
    finally:
        plt.close(fig)
    return filename


def md_table(header: List[str], rows: List[List[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
