"""The fused helper ops of the Gated DeltaNet layer (short convolution + SiLU, gated RMSNorm, decode step): the
functional API and the fake (meta) kernels of their ops."""
from typing import Optional, Tuple

import torch

from . import _C  # noqa: F401  (loads the library that registers torch.ops.gated_delta)
from .ops import default_scale

__all__ = ["short_conv", "short_conv_update", "gated_rmsnorm", "l2norm", "decode_step"]

_ACTIVATIONS = (None, "silu", "swish")


def _use_silu(activation) -> bool:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    return activation is not None


def _eps(eps) -> float:
    """eps as the ops take it: a Python number (a tensor or a string is refused, not converted)."""
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        raise TypeError(f"eps must be a Python number, got {type(eps).__name__}")
    return float(eps)


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Causal depthwise convolution over time, then SiLU (unless activation is None), per sequence:

        y[t, d] = silu(bias[d] + sum_j weight[d, j] * x[t - (W - 1) + j, d])

    Equivalent to `F.silu(F.conv1d(x.transpose(1, 2), weight[:, None], bias, padding=W - 1, groups=D)[..., :T])`
    for each sequence, with the W - 1 positions before a sequence read from `initial_state` instead of zeros.

    Args:
        x: [B, T, D]. weight: [D, W] (an nn.Conv1d weight [D, 1, W] is accepted too). bias: [D] or None.
            weight and bias have x's dtype or float32.
        initial_state: [N, D, W - 1] in x's dtype: the last W - 1 inputs before each sequence, oldest first.
        output_final_state: also return the final conv state [N, D, W - 1] (the last W - 1 inputs).
        cu_seqlens: [N + 1] int offsets of a packed batch (B must be 1); no mixing across sequences.
    """
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight.squeeze(1)
    if not isinstance(output_final_state, bool):
        raise TypeError(f"output_final_state must be a bool, got {type(output_final_state).__name__}")
    y, final_state = torch.ops.gated_delta.short_conv_fwd(x, weight, bias, initial_state, cu_seqlens,
                                                          output_final_state, _use_silu(activation))
    return y, (final_state if output_final_state else None)


def short_conv_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
) -> torch.Tensor:
    """Decode with the short convolution: new tokens x [B, T, D] (T small) against the rolling conv state
    [B, D, W - 1] (contiguous, x's dtype), which is updated in place. Not differentiable."""
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight.squeeze(1)
    return torch.ops.gated_delta.short_conv_update(x, conv_state, weight, bias, _use_silu(activation))


def gated_rmsnorm(
    x: torch.Tensor,
    gate: Optional[torch.Tensor] = None,
    weight: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """RMSNorm over the last dimension with a SiLU output gate, computed in float32 (float64 for float64 x):

        y = x / sqrt(mean(x ** 2, -1) + eps) * weight * silu(gate)

    gate has x's shape and dtype (None: no gate); weight [D] has x's dtype or float32 (None: no scale).
    Returns y in x's dtype."""
    y, _ = torch.ops.gated_delta.gated_rmsnorm_fwd(x, gate, weight, _eps(eps))
    return y


def l2norm(x: torch.Tensor, eps: float = 1e-6, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """L2 normalisation over the last dimension, computed in float32 (float64 for float64 x or out_dtype):

        y = x / sqrt(sum(x ** 2, -1) + eps)

    what gated_delta_rule applies to q and k with use_qk_l2norm_in_kernel (FLA's l2norm, same eps). Returns y in
    out_dtype (x's dtype when None), contiguous. Differentiable (one kernel each way on CUDA, the norm recomputed
    from x in the backward); x may be strided (CUDA reads it in place where its last dim is dense)."""
    return torch.ops.gated_delta.l2norm_fwd(x, _eps(eps), out_dtype)


def decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    scale: Optional[float] = None,
    allow_neg_eigval: bool = False,
) -> torch.Tensor:
    """One fused decode step of the gated delta rule for T (few) new tokens, the state updated in place:

        q, k <- L2-normalised;  g = -exp(A_log) softplus(a + dt_bias);  beta = sigmoid(b) (2 sigmoid(b) with
        allow_neg_eigval);  S <- exp(g) S;  S <- S + beta k (v - S^T k)^T;  o = scale S^T q

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V] (HV a multiple of H); a, b: [B, T, HV]; A_log, dt_bias: [HV].
        state: [B, HV, K, V] float32 (float64 for float64 inputs), contiguous; updated in place.
    Returns o [B, T, HV, V] in v's dtype. Equals `gated_delta_rule(..., use_qk_l2norm_in_kernel=True,
    use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True, initial_state=state, output_final_state=True)`.
    Not differentiable."""
    if scale is None:
        scale = default_scale(q)
    return torch.ops.gated_delta.decode_step(q, k, v, a, b, A_log, dt_bias, state, float(scale),
                                             bool(allow_neg_eigval))


# ---- fake (meta) kernels ----

@torch.library.register_fake("gated_delta::short_conv_fwd")
def _short_conv_fwd_fake(x, weight, bias, initial_state, cu_seqlens, output_final_state, use_silu):
    B, T, D = x.shape
    W = weight.shape[1]
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
    final_state = x.new_empty((N, D, W - 1)) if output_final_state else x.new_empty((0,))
    return x.new_empty((B, T, D)), final_state


@torch.library.register_fake("gated_delta::short_conv_bwd")
def _short_conv_bwd_fake(dy, d_final_state, x, weight, bias, initial_state, cu_seqlens, use_silu):
    return (
        x.new_empty(x.shape),
        weight.new_empty(weight.shape),
        bias.new_empty(bias.shape) if bias is not None else weight.new_empty((0,)),
        initial_state.new_empty(initial_state.shape) if initial_state is not None else x.new_empty((0,)),
    )


@torch.library.register_fake("gated_delta::short_conv_update")
def _short_conv_update_fake(x, conv_state, weight, bias, use_silu):
    return x.new_empty(x.shape)


def _acc_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@torch.library.register_fake("gated_delta::gated_rmsnorm_fwd")
def _gated_rmsnorm_fwd_fake(x, gate, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=_acc_dtype(x))


@torch.library.register_fake("gated_delta::gated_rmsnorm_bwd")
def _gated_rmsnorm_bwd_fake(dy, x, gate, weight, rstd, eps):
    return (
        x.new_empty(x.shape),
        x.new_empty(x.shape) if gate is not None else x.new_empty((0,)),
        weight.new_empty(weight.shape) if weight is not None else x.new_empty((0,)),
    )


@torch.library.register_fake("gated_delta::decode_step")
def _decode_step_fake(q, k, v, a, b, A_log, dt_bias, state, scale, allow_neg_eigval):
    return v.new_empty(v.shape)
