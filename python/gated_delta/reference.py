"""The definition of the gated delta rule: a short pure-PyTorch token loop.

Used by the tests and by users to check an install. Differentiable by autograd; run it in float64 for a reference.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def gated_delta_rule_ref(
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
    gk: Optional[torch.Tensor] = None,
    gv: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Token loop, per sequence and value head h (query/key head h // (HV // H)):

        S <- exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = scale * S^T q_t

    with the optional per-key gk [B, T, HV, K] and per-value gv [B, T, HV, V] log decays applied after exp(g_t):
    S <- diag(exp(gk_t)) S diag(exp(gv_t)).

    Computes in the dtype of q promoted with float32 (float64 for float64 inputs); returns o in v's dtype and the
    final state [N, HV, K, V] in the compute dtype (or None).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = K ** -0.5 if scale is None else scale
    out_dtype = v.dtype
    q, k, v, g, beta = (x.to(cd) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta) * (2.0 if allow_neg_eigval else 1.0)
    if use_gate_in_kernel:
        g = -torch.exp(A_log.to(cd)) * F.softplus(g if dt_bias is None else g + dt_bias.to(cd))
    gk = gk.to(cd) if gk is not None else None
    gv = gv.to(cd) if gv is not None else None
    group = HV // H
    q = q.repeat_interleave(group, dim=2)
    k = k.repeat_interleave(group, dim=2)
    if cu_seqlens is None:
        bounds = [(b, 0, T) for b in range(B)]
    else:
        cu = cu_seqlens.tolist()
        bounds = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    # Unbind the time axis once, so that autograd through the loop stays linear in T.
    qs, ks, vs, gs, bs = (x.unbind(1) for x in (q, k, v, g, beta))
    gks = gk.unbind(1) if gk is not None else None
    gvs = gv.unbind(1) if gv is not None else None
    rows = [[None] * T for _ in range(B)]
    finals = []
    for n, (b, start, end) in enumerate(bounds):
        S = (initial_state[n].to(cd) if initial_state is not None
             else torch.zeros(HV, K, V, dtype=cd, device=q.device))
        for t in range(start, end):
            q_t, k_t, v_t, g_t, b_t = qs[t][b], ks[t][b], vs[t][b], gs[t][b], bs[t][b]
            S = S * g_t.exp()[:, None, None]
            if gks is not None:
                S = S * gks[t][b].exp()[:, :, None]
            if gvs is not None:
                S = S * gvs[t][b].exp()[:, None, :]
            u = b_t[:, None] * (v_t - torch.einsum("hkv,hk->hv", S, k_t))
            S = S + k_t[:, :, None] * u[:, None, :]
            rows[b][t] = scale * torch.einsum("hkv,hk->hv", S, q_t)
        finals.append(S)
    if T == 0:
        o = v.new_zeros(B, 0, HV, V)
    else:
        o = torch.stack([torch.stack(r) for r in rows])
    o = o.to(out_dtype)
    final_state = torch.stack(finals) if output_final_state else None
    return o, final_state
