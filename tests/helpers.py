"""Shared helpers of the CPU algorithm tests: random inputs, the reference, relative errors; and where nvcc is."""
import contextlib
import itertools
import os
import shutil
from typing import Dict, List, Optional, Sequence

import torch

import gated_delta

OPTION_SETS = {
    "plain": {},
    "l2norm": {"use_qk_l2norm_in_kernel": True},
    "beta_sigmoid": {"use_beta_sigmoid_in_kernel": True},
    "neg_eigval": {"use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True},
    "gate": {"use_gate_in_kernel": True},
    "all": {"use_qk_l2norm_in_kernel": True, "use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True,
            "use_gate_in_kernel": True},
}

DIFF_NAMES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of a against b (in float64)."""
    a, b = a.double(), b.double()
    den = b.norm().item()
    num = (a - b).norm().item()
    if den == 0:
        return num
    return num / den


def make_inputs(gen: torch.Generator, T: int, B: int = 1, H: int = 2, HV: int = 4, K: int = 16, V: int = 24,
                dtype=torch.float64, lengths: Optional[Sequence[int]] = None, initial_state: bool = True,
                options: Optional[Dict] = None, beta_max: float = 1.0, special_gates: bool = True) -> Dict:
    """Random inputs of gated_delta_rule (as keyword arguments, without algorithm/chunk_size).

    lengths: per-sequence lengths of a packed batch (B is then 1 and T their sum). The values keep the recurrence
    bounded: k has norm <= 1 and |1 - beta |k|^2| <= 1 for beta <= 2. With special_gates some g are exactly 0 (no
    decay) and some -1e4 (a full reset)."""
    options = dict(options or {})
    if lengths is not None:
        B, T = 1, int(sum(lengths))
    N = len(lengths) if lengths is not None else B

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def unif(*shape):
        return torch.rand(*shape, generator=gen, dtype=torch.float64)

    q = rnd(B, T, H, K)
    k = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1) * (0.5 + 0.5 * unif(B, T, H, 1))
    v = rnd(B, T, HV, V)
    kw = {}
    if options.get("use_gate_in_kernel"):
        g = rnd(B, T, HV)
        kw["A_log"] = (rnd(HV) * 0.5).to(dtype)
        kw["dt_bias"] = (rnd(HV) * 0.5).to(dtype)
    else:
        g = -unif(B, T, HV) * 0.5
        if special_gates and T > 0:
            g.view(-1)[torch.randperm(g.numel(), generator=gen)[: max(1, g.numel() // 10)]] = 0.0
            g.view(-1)[torch.randperm(g.numel(), generator=gen)[: max(1, g.numel() // 40)]] = -1e4
    if options.get("use_beta_sigmoid_in_kernel"):
        beta = rnd(B, T, HV) * 2
    else:
        beta = unif(B, T, HV) * beta_max
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.to(state_dtype), beta=beta.to(dtype), **kw,
               **options)
    if initial_state:
        out["initial_state"] = rnd(N, HV, K, V).to(state_dtype)
    if lengths is not None:
        out["cu_seqlens"] = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.long)
    return out


def upcast(inputs: Dict) -> Dict:
    """The same inputs with every floating tensor in float64 (the reference's view of rounded inputs)."""
    return {key: (val.double() if isinstance(val, torch.Tensor) and val.is_floating_point() else val)
            for key, val in inputs.items()}


def run_ours(inputs: Dict, algorithm: str, chunk_size: int = 64, output_final_state: bool = True):
    return gated_delta.gated_delta_rule(**inputs, output_final_state=output_final_state, algorithm=algorithm,
                                        chunk_size=chunk_size)


@contextlib.contextmanager
def single_thread():
    """The reference loop is thousands of tiny ops: one thread is much faster (and immune to a busy machine)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def run_ref(inputs: Dict, output_final_state: bool = True):
    with single_thread():
        return gated_delta.gated_delta_rule_ref(**inputs, output_final_state=output_final_state)


def diff_inputs(inputs: Dict) -> List[str]:
    return [name for name in DIFF_NAMES if isinstance(inputs.get(name), torch.Tensor)]


def grads_of(fn, inputs: Dict, d_o: torch.Tensor, d_ht: torch.Tensor):
    """(o, final_state, {name: gradient}) of the loss <o, d_o> + <final_state, d_ht> through fn(**inputs)."""
    inputs = dict(inputs)
    names = diff_inputs(inputs)
    for name in names:
        inputs[name] = inputs[name].detach().clone().requires_grad_(True)
    o, ht = fn(inputs)
    loss = (o.double() * d_o).sum() + (ht.double() * d_ht).sum()
    grads = torch.autograd.grad(loss, [inputs[n] for n in names])
    return o.detach(), ht.detach(), dict(zip(names, grads))


def ref_grads(inputs: Dict, d_o: torch.Tensor, d_ht: torch.Tensor):
    """grads_of through the float64 reference, single-threaded."""
    with single_thread():
        return grads_of(run_ref, inputs, d_o, d_ht)


def cotangents(gen: torch.Generator, inputs: Dict):
    """Random gradients of o and of the final state (float64)."""
    v = inputs["v"]
    B, T, HV, V = v.shape
    K = inputs["q"].shape[-1]
    N = inputs["cu_seqlens"].numel() - 1 if "cu_seqlens" in inputs else B
    d_o = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64)
    d_ht = torch.randn(N, HV, K, V, generator=gen, dtype=torch.float64)
    return d_o, d_ht


def find_nvcc() -> Optional[str]:
    """nvcc on PATH, else in CUDA_HOME (or CUDA_PATH, or /usr/local/cuda)'s bin; None when there is none"""
    found = shutil.which("nvcc")
    if found is None:
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        cand = os.path.join(home, "bin", "nvcc")
        found = cand if os.path.exists(cand) else None
    return found
