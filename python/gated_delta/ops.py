"""The functional API of the gated delta rule and the fake (meta) kernels of its ops."""
from typing import Optional, Tuple

import torch

from . import _C  # noqa: F401  (loads the library that registers torch.ops.gated_delta)

ALGORITHMS = ("auto", "recurrent", "chunk", "scan")

__all__ = ["gated_delta_rule", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "ALGORITHMS"]


def _check_python_args(scale, algorithm, chunk_size, output_final_state):
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a Python number or None, got {type(scale).__name__}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    if not isinstance(output_final_state, bool):
        raise TypeError(f"output_final_state must be a bool, got {type(output_final_state).__name__}")


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    algorithm: str = "auto",
    chunk_size: int = 64,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    gk: Optional[torch.Tensor] = None,
    gv: Optional[torch.Tensor] = None,
    cp_group=None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The gated delta rule, per sequence and value head (query/key head h // (HV // H)):

        S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V] with HV a multiple of H; one dtype (bf16, fp16, fp32; fp64 on CPU).
        g: [B, T, HV] log decay (g_raw when use_gate_in_kernel). beta: [B, T, HV] (logits when
            use_beta_sigmoid_in_kernel).
        scale: output scale, default K ** -0.5.
        initial_state: [N, HV, K, V] float32 (float64 for float64 inputs); zeros when None.
        output_final_state: also return the final state [N, HV, K, V].
        cu_seqlens: [N + 1] int offsets of a packed batch of N sequences (B must be 1).
        cu_seqlens_cpu: optional host copy of cu_seqlens; on CUDA it spares a device-to-host copy.
        use_qk_l2norm_in_kernel: q <- q / sqrt(|q|^2 + 1e-6), same for k.
        use_beta_sigmoid_in_kernel: beta <- sigmoid(beta) (2 * sigmoid(beta) with allow_neg_eigval).
        use_gate_in_kernel: g <- -exp(A_log) * softplus(g + dt_bias), with A_log, dt_bias [HV].
        algorithm: "recurrent", "chunk", "scan" or "auto" (picked by device and shape).
        chunk_size: tokens per chunk for "chunk" and "scan".
        gk, gv: optional per-key [B, T, HV, K] / per-value [B, T, HV, V] log decays, any float dtype: each step
            also scales the state's rows by exp(gk_t) and its columns by exp(gv_t) before the delta update.
            Algorithm "recurrent" only ("auto" picks it).
        cp_group: a torch.distributed process group over which the token dimension is split (context parallelism):
            each rank passes its slice, cu_seqlens are then the global offsets; see `gated_delta.cp`.

    Returns:
        o [B, T, HV, V] in v's dtype, and the final state (or None when output_final_state is False).
    """
    if cp_group is not None:
        if gk is not None or gv is not None:
            raise ValueError("gk and gv (per-key / per-value decays) are not supported with cp_group: the context-"
                             "parallel run composes the maps of the scalar-gated rule only")
        from .cp import cp_gated_delta_rule
        return cp_gated_delta_rule(
            cp_group, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
            use_beta_sigmoid_in_kernel, allow_neg_eigval, use_gate_in_kernel, A_log, dt_bias, algorithm, chunk_size,
            cu_seqlens_cpu)
    _check_python_args(scale, algorithm, chunk_size, output_final_state)
    if scale is None:
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q must be a torch.Tensor of shape [B, T, H, K], got {type(q).__name__}")
        if q.dim() != 4:
            raise ValueError(f"q must have shape [B, T, H, K] (4 dimensions), got {list(q.shape)}")
        scale = q.shape[-1] ** -0.5
    o, final_state = torch.ops.gated_delta.fwd(
        q, k, v, g, beta, float(scale), initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
        use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, use_gate_in_kernel, A_log, dt_bias,
        algorithm, chunk_size, gk, gv)
    return o, (final_state if output_final_state else None)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
    **options,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """flash-linear-attention's `chunk_gated_delta_rule` under its own name and keywords (chunked algorithm unless
    `algorithm` says otherwise). Further keywords are those of `gated_delta_rule`."""
    options.setdefault("algorithm", "auto")
    return gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **options)


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    gk: Optional[torch.Tensor] = None,
    gv: Optional[torch.Tensor] = None,
    beta: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
    **options,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """flash-linear-attention's `fused_recurrent_gated_delta_rule`: the token-by-token algorithm, the decode path.
    g defaults to zeros (no decay) and beta to ones, as there; gk [B, T, HV, K] and gv [B, T, HV, V] are optional
    per-key / per-value log decays of the state's rows and columns (differentiable, unlike flash-linear-attention's)."""
    if g is None:
        g = torch.zeros(v.shape[:3], dtype=torch.float32, device=v.device)
    if beta is None:
        beta = torch.ones(v.shape[:3], dtype=v.dtype, device=v.device)
    options.setdefault("algorithm", "recurrent")
    return gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, gk=gk, gv=gv, **options)


# ---- fake (meta) kernels: shapes and dtypes of every op's outputs, for torch.compile and opcheck ----

def _state_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _check_devices(q, **tensors):
    # A call that mixes meta tensors with real ones dispatches here rather than to a backend: same check, same words.
    for name, t in tensors.items():
        if t is not None and t.device != q.device:
            raise RuntimeError(f"{name} must be on the same device as q ({q.device}), got {t.device}")


@torch.library.register_fake("gated_delta::fwd")
def _fwd_fake(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
              use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, use_gate_in_kernel, A_log,
              dt_bias, algorithm, chunk_size, gk=None, gv=None):
    _check_devices(q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens, A_log=A_log,
                   dt_bias=dt_bias, gk=gk, gv=gv)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
    o = v.new_empty(v.shape)
    if output_final_state:
        final_state = q.new_empty((N, HV, K, V), dtype=_state_dtype(q))
    else:
        final_state = q.new_empty((0,), dtype=_state_dtype(q))
    return o, final_state


@torch.library.register_fake("gated_delta::bwd")
def _bwd_fake(d_o, d_final_state, q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu,
              use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, use_gate_in_kernel, A_log,
              dt_bias, algorithm, chunk_size, gk=None, gv=None):
    _check_devices(q, d_o=d_o, d_final_state=d_final_state, k=k, v=v, g=g, beta=beta, initial_state=initial_state,
                   cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias, gk=gk, gv=gv)
    empty = lambda: q.new_empty((0,), dtype=_state_dtype(q))  # noqa: E731
    return (
        q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
        beta.new_empty(beta.shape),
        initial_state.new_empty(initial_state.shape) if initial_state is not None else empty(),
        A_log.new_empty(A_log.shape) if A_log is not None else empty(),
        dt_bias.new_empty(dt_bias.shape) if dt_bias is not None else empty(),
        gk.new_empty(gk.shape) if gk is not None else empty(),
        gv.new_empty(gv.shape) if gv is not None else empty(),
    )
