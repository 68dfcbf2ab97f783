"""The functional API of the gated delta rule and the fake (meta) kernels of its ops."""
import warnings
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


def default_scale(q) -> float:
    """K ** -0.5 for q of shape [B, T, H, K]: the default scale, with an error naming q where it has no such K."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor of shape [B, T, H, K], got {type(q).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B, T, H, K] (4 dimensions), got {list(q.shape)}")
    if q.shape[-1] < 1:
        raise ValueError(f"q must have K >= 1 (its last dimension), got shape {list(q.shape)}")
    return q.shape[-1] ** -0.5


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
    state_v_first: bool = False,
    cp_group=None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The gated delta rule, per sequence and value head (query/key head h // (HV // H)):

        S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t

    Args:
        q, k: [B, T, H, K] (one dtype); v: [B, T, HV, V] with HV a multiple of H (bf16, fp16, fp32; fp64 on CPU).
            q/k and v may differ in dtype: the computation runs in the wider one, o has v's dtype.
        g: [B, T, HV] log decay (g_raw when use_gate_in_kernel). beta: [B, T, HV] (logits when
            use_beta_sigmoid_in_kernel). Any float dtype, read in the state dtype.
        scale: output scale, default K ** -0.5.
        initial_state: [N, HV, K, V] in any float dtype, read as the state dtype (float32; float64 for float64
            inputs); zeros when None.
        output_final_state: also return the final state [N, HV, K, V] in the state dtype.
        cu_seqlens: [N + 1] int offsets of a packed batch of N sequences (B must be 1).
        cu_seqlens_cpu: optional host copy of cu_seqlens; on CUDA it spares a device-to-host copy.
        use_qk_l2norm_in_kernel: q <- q / sqrt(|q|^2 + 1e-6), same for k.
        use_beta_sigmoid_in_kernel: beta <- sigmoid(beta) (2 * sigmoid(beta) with allow_neg_eigval).
        use_gate_in_kernel: g <- -exp(A_log) * softplus(g + dt_bias), with A_log [HV] and optional dt_bias [HV].
        algorithm: "recurrent", "chunk", "scan" or "auto" (picked by device and shape).
        chunk_size: tokens per chunk for "chunk" and "scan".
        gk, gv: optional per-key [B, T, HV, K] / per-value [B, T, HV, V] log decays, any float dtype: each step
            also scales the state's rows by exp(gk_t) and its columns by exp(gv_t) before the delta update.
            Algorithm "recurrent" only ("auto" picks it).
        state_v_first: initial_state and the final state (and their gradients) are [N, HV, V, K].
        cp_group: a torch.distributed process group over which the token dimension is split (context parallelism):
            each rank passes its slice, cu_seqlens are then the global offsets; see `gated_delta.cp`.

    Returns:
        o [B, T, HV, V] in v's dtype, and the final state (or None when output_final_state is False).
    """
    if cp_group is not None:
        if gk is not None or gv is not None:
            raise ValueError("gk and gv (per-key / per-value decays) are not supported with cp_group: the context-"
                             "parallel run composes the maps of the scalar-gated rule only")
        if state_v_first:
            raise ValueError("state_v_first=True is not supported with cp_group: pass states as [N, HV, K, V] "
                             "(transpose them before and after the call)")
        from .cp import cp_gated_delta_rule
        return cp_gated_delta_rule(
            cp_group, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
            use_beta_sigmoid_in_kernel, allow_neg_eigval, use_gate_in_kernel, A_log, dt_bias, algorithm, chunk_size,
            cu_seqlens_cpu)
    _check_python_args(scale, algorithm, chunk_size, output_final_state)
    if scale is None:
        scale = default_scale(q)
    if not isinstance(state_v_first, bool):
        raise TypeError(f"state_v_first must be a bool, got {type(state_v_first).__name__}")
    o, final_state = torch.ops.gated_delta.fwd(
        q, k, v, g, beta, float(scale), initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
        use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, use_gate_in_kernel, A_log, dt_bias,
        algorithm, chunk_size, gk, gv, state_v_first)
    return o, (final_state if output_final_state else None)


# ---- flash-linear-attention's functions under their own names, keywords and defaults (FLA 0.6.0) ----

_HEAD_FIRST_MESSAGE = "head_first has been removed. Inputs must be in `[B, T, H, ...]` format."


def _fla_options(kwargs, allowed, state_v_first, use_beta_sigmoid_in_kernel, allow_neg_eigval, where):
    """FLA's **kwargs handling, shared by both wrappers: the deprecated alias of state_v_first, head_first, and
    unknown keywords (an error naming them: nothing is dropped). Returns the final state_v_first."""
    if "head_first" in kwargs:
        raise DeprecationWarning(_HEAD_FIRST_MESSAGE)  # raised, as FLA does
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning,
                      stacklevel=3)
        state_v_first = kwargs.pop("transpose_state_layout")
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise TypeError(f"{where}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; it accepts "
                        f"FLA's keywords and {', '.join(sorted(allowed))}")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    return state_v_first


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    chunk_indices: Optional[torch.Tensor] = None,
    cp_context=None,
    **kwargs,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """flash-linear-attention's `chunk_gated_delta_rule` (0.6.0): its arguments, keywords and defaults.

    kwargs: `use_gate_in_kernel`, `A_log`, `dt_bias` (optional), `chunk_size` (16, 32 or 64; the result does not
    depend on it), the deprecated `transpose_state_layout`, and `algorithm` (ours, default "auto").
    `chunk_indices` is accepted and ignored (the chunk layout is computed from cu_seqlens). `cp_context`, FLA's
    context-parallel object, is not supported (gated_delta_rule's `cp_group` is the context-parallel path here).
    """
    state_v_first = _fla_options(kwargs, ("use_gate_in_kernel", "A_log", "dt_bias", "chunk_size", "algorithm"),
                                 state_v_first, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                                 "chunk_gated_delta_rule")
    if cp_context is not None:
        raise NotImplementedError(
            "cp_context (flash-linear-attention's context-parallel object) is not supported; for context "
            "parallelism call gated_delta.gated_delta_rule with cp_group=")
    chunk_size = kwargs.pop("chunk_size", 64)
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got {chunk_size}.")
    del chunk_indices  # FLA's precomputed chunk table: our kernels lay out their own chunks
    return gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                            chunk_size=chunk_size, cu_seqlens_cpu=cu_seqlens_cpu, state_v_first=state_v_first,
                            **kwargs)


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
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    **kwargs,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """flash-linear-attention's `fused_recurrent_gated_delta_rule` (0.6.0): the token-by-token algorithm, the
    decode path, with a backward. g None: no decay; beta None: ones. The output has v's dtype (q/k may be wider).
    gk [B, T, HV, K] and gv [B, T, HV, V] are optional per-key / per-value log decays of the state's rows and columns
    (differentiable, unlike flash-linear-attention's).

    kwargs: the deprecated `transpose_state_layout`, and `cu_seqlens_cpu`, `algorithm` (default "recurrent"),
    `chunk_size` of gated_delta_rule.
    """
    state_v_first = _fla_options(kwargs, ("cu_seqlens_cpu", "algorithm", "chunk_size"), state_v_first,
                                 use_beta_sigmoid_in_kernel, allow_neg_eigval, "fused_recurrent_gated_delta_rule")
    if not isinstance(v, torch.Tensor) or v.dim() != 4:
        raise ValueError(f"v must be a tensor of shape [B, T, HV, V], got {getattr(v, 'shape', type(v).__name__)}")
    if beta is not None and beta.dim() == v.dim():
        raise NotImplementedError(
            f"beta of shape [B, T, HV, V] (a write strength per value column) is not supported, got beta of shape "
            f"{list(beta.shape)}; give one per head: [B, T, HV]")
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True`.")
        if g is None:
            raise ValueError("`g` (raw pre-activation) must be provided when `use_gate_in_kernel=True`.")
    if g is None:
        g = torch.zeros(v.shape[:3], dtype=torch.float32, device=v.device)
    if beta is None:
        beta = torch.ones(v.shape[:3], dtype=torch.float32, device=v.device)
    kwargs.setdefault("algorithm", "recurrent")
    return gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                            use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                            state_v_first=state_v_first, gk=gk, gv=gv, **kwargs)


# ---- fake (meta) kernels: shapes and dtypes of every op's outputs, for torch.compile and opcheck ----

def _state_dtype(q, v=None):
    return torch.float64 if torch.float64 in (q.dtype, getattr(v, "dtype", None)) else torch.float32


def _check_devices(ref, *, ref_name="q", **tensors):
    # A call that mixes meta tensors with real ones dispatches here rather than to a backend: same check, same words.
    for name, t in tensors.items():
        if t is not None and t.device != ref.device:
            raise RuntimeError(f"{name} must be on the same device as {ref_name} ({ref.device}), got {t.device}")


@torch.library.register_fake("gated_delta::fwd")
def _fwd_fake(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
              use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, use_gate_in_kernel, A_log,
              dt_bias, algorithm, chunk_size, gk=None, gv=None, state_v_first=False):
    _check_devices(q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens, A_log=A_log,
                   dt_bias=dt_bias, gk=gk, gv=gv)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
    o = v.new_empty(v.shape)
    if output_final_state:
        shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        final_state = q.new_empty(shape, dtype=_state_dtype(q, v))
    else:
        final_state = q.new_empty((0,), dtype=_state_dtype(q, v))
    return o, final_state


@torch.library.register_fake("gated_delta::fwd_with_residual")
def _fwd_with_residual_fake(*args, **kwargs):
    o, final_state = _fwd_fake(*args, **kwargs)
    q = args[0]
    # The CPU backend keeps no residual; the CUDA one keeps a number of bytes that depends on the sequence lengths
    # (cu_seqlens' values) and on the path its kernels take.
    n = 0 if q.device.type == "cpu" else torch.library.get_ctx().new_dynamic_size()
    return o, final_state, q.new_empty((n,), dtype=torch.uint8)


@torch.library.register_fake("gated_delta::l2norm_fwd")
def _l2norm_fwd_fake(x, eps, out_dtype=None):
    return x.new_empty(x.shape, dtype=out_dtype or x.dtype)


@torch.library.register_fake("gated_delta::l2norm_bwd")
def _l2norm_bwd_fake(dy, x, eps, out_dtype=None):
    _check_devices(x, ref_name="x", dy=dy)
    return x.new_empty(x.shape, dtype=out_dtype or x.dtype)


@torch.library.register_fake("gated_delta::bwd")
def _bwd_fake(d_o, d_final_state, q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu,
              use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, use_gate_in_kernel, A_log,
              dt_bias, algorithm, chunk_size, gk=None, gv=None, state_v_first=False, residual=None, q_normed=None,
              k_normed=None):
    _check_devices(q, d_o=d_o, d_final_state=d_final_state, k=k, v=v, g=g, beta=beta, initial_state=initial_state,
                   cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias, gk=gk, gv=gv, residual=residual,
                   q_normed=q_normed, k_normed=k_normed)
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
