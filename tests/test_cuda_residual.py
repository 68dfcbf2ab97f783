"""GPU tests of the residual a forward keeps for its backward (fwd_with_residual, bwd's residual): each chunk's A,
gam and Tm, which the backward reads instead of running the preparation again.

Every path that keeps one (the one-kernel forward, prep + state_fwd, segments with their warm-up, varlen, V = 256
in two CTAs per value head, K = 64) is checked against the float64 token loop, with and without the residual, and
the output is checked bitwise against the forward that keeps nothing. Marked `gpu`, skipped without CUDA.
"""
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_helpers import TOL, make_inputs, output_grads, reference, rel_err  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# B, T, H, HV, K, V, cu_seqlens, GATED_DELTA_FUSED_FWD (None: the default); each grid holds enough state tiles for
# the backward's passes to take 64-column ones (where a residual is kept)
CASES = {
    "fused": (2, 130, 8, 64, 128, 128, None, None),
    "two_kernels": (2, 130, 8, 64, 128, 128, None, "0"),
    # segments of 8 chunks after a proven warm-up (the forward: prep + state_fwd by default, or forced one-kernel)
    "segments": (1, 8192, 4, 8, 128, 128, None, None),
    "segments_fused": (1, 8192, 4, 8, 128, 128, None, "1"),
    "varlen": (1, 1000, 4, 16, 128, 128, [0, 1, 64, 65, 300, 1000], None),
    "V256": (2, 130, 8, 16, 128, 256, None, None),
    "K64_V64": (2, 130, 16, 64, 64, 64, None, None),
}


def _op_args(inp, scale):
    cu = inp.get("cu_seqlens")
    return (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale, inp["initial_state"], True, cu, None,
            False, False, False, False, None, None, "auto", 64)


def _expected_bytes(B, T, HV, K, cu, es):
    lens = [T] * B if cu is None else [b - a for a, b in zip(cu[:-1], cu[1:])]
    nc = sum(math.ceil(n / 64) for n in lens)
    up = lambda x: (x + 255) // 256 * 256  # noqa: E731
    return 2 * up(nc * HV * 64 * 64 * es) + up(nc * HV * 64 * 4)


_REF_CACHE = {}


def _case(shape, dtype):
    # (the cases of one shape share their inputs and float64 reference)
    key = (shape, dtype)
    if key not in _REF_CACHE:
        B, T, H, HV, K, V, cu = shape
        inp = make_inputs(B, T, H, HV, K, V, dtype, cu_seqlens=cu, seed=len(_REF_CACHE))
        N = B if cu is None else len(cu) - 1
        d_o, d_ht = output_grads(inp, N)
        _REF_CACHE[key] = (inp, d_o, d_ht, reference(inp, d_o, d_ht))
    return _REF_CACHE[key]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(CASES))
def test_backward_from_the_residual(name, dtype, monkeypatch):
    B, T, H, HV, K, V, cu, fused = CASES[name]
    if fused is not None:
        monkeypatch.setenv("GATED_DELTA_FUSED_FWD", fused)
    inp, d_o, d_ht, ref = _case((B, T, H, HV, K, V, None if cu is None else tuple(cu)), dtype)
    args = _op_args(inp, K ** -0.5)
    o, ht, res = torch.ops.gated_delta.fwd_with_residual(*args)
    o_plain, ht_plain = torch.ops.gated_delta.fwd(*args)
    assert torch.equal(o, o_plain) and torch.equal(ht, ht_plain)  # keeping it changes no output
    assert res.dtype == torch.uint8 and res.numel() == _expected_bytes(B, T, HV, K, cu, 2)

    tol_o, tol_g = TOL[dtype]
    assert rel_err(o, ref["o"]) <= tol_o and rel_err(ht, ref["ht"]) <= tol_o
    names = ("dq", "dk", "dv", "dg", "dbeta", "dinitial_state")
    runs = {}
    for label, r in (("residual", res), ("recomputed", None)):
        gr = torch.ops.gated_delta.bwd(d_o, d_ht, *args[:6], args[6], *args[8:], residual=r)
        runs[label] = dict(zip(names, gr[:6]))
        for n in names:
            e = rel_err(runs[label][n], ref[n])
            assert e <= tol_g, f"{label} {n}: {e:.3e} > {tol_g:.1e}"
    # the two backwards differ only by the roundings of A and Tm (the forward's against prep's) and where diag(beta)
    # is applied (to the state passes' operand in fp32, against prep's rounded Tm diag(beta))
    for n in names:
        assert rel_err(runs["residual"][n], runs["recomputed"][n]) <= tol_g / 2, n


def test_autograd_reads_the_residual():
    """The autograd Function keeps the residual of its forward, and its backward runs no preparation (its state
    passes apply diag(beta) to the stored Tm; prep_residual_kernel forms warm-up bounds, for segments only); a
    retained graph gives the same gradients twice."""
    inp = make_inputs(2, 130, 8, 64, 128, 128, torch.bfloat16)
    leaves = {n: inp[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")}
    from gated_delta import gated_delta_rule

    o, _ = gated_delta_rule(**leaves, initial_state=inp["initial_state"])
    d_o = torch.randn_like(o)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        g1 = torch.autograd.grad(o, list(leaves.values()), d_o, retain_graph=True)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("state_rev_kernel" in k for k in kernels), kernels
    assert not any("prep_kernel" in k or "prep_residual_kernel" in k for k in kernels), kernels
    g2 = torch.autograd.grad(o, list(leaves.values()), d_o)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_backward_peak_memory():
    """The backward's peak is the larger of its two phases: while grad_qk runs, the workspace, hT and Vn^T (in an
    allocation of their own) and dq; while grad_wy runs, the workspace and the gradients, allocated once hT and Vn^T
    are released. dW has no buffer: it lives in dhT's tiles. (The default path: bf16, from the residual, with
    64-column state tiles and no segments.)"""
    from gated_delta import gated_delta_rule

    B, T, H, HV, K, V = 4, 512, 4, 32, 128, 128
    es, fs, nc = 2, 4, B * T // 64
    up = lambda x: (x + 255) // 256 * 256  # noqa: E731  (the workspace's regions)
    blk = lambda x: (x + 511) // 512 * 512  # noqa: E731  (the caching allocator's blocks)
    ws = blk(up(nc * HV * V * K * es) + up(nc * HV * V * 64 * es) + up(K // 64 * nc * HV * 64 * fs)
             + up(B * T * H * K * fs))  # dhT (and dW), dVn^T, dgam1, dk1
    states = blk(up(nc * HV * V * K * es) + up(nc * HV * V * 64 * es))  # hT, Vn^T
    dq = dk = blk(B * T * H * K * es)
    rest = dk + blk(B * T * HV * V * es) + blk(B * T * HV * fs) + blk(B * T * HV * es)  # dk, dv, dg, dbeta
    dW = nc * HV * 64 * K * es  # (what a buffer of its own would take)

    inp = make_inputs(B, T, H, HV, K, V, torch.bfloat16, h0=False)
    _, _, res = torch.ops.gated_delta.fwd_with_residual(*_op_args(inp, K ** -0.5))
    assert res.numel() == _expected_bytes(B, T, HV, K, None, es)  # (the layout the sizes below are for)
    leaves = [inp[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    o, _ = gated_delta_rule(*leaves)
    d_o = torch.randn_like(o)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = torch.autograd.grad(o, leaves, d_o)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    # (a buffer of dW's own, or the gradients allocated beside hT and Vn^T, would each add more than this margin)
    assert peak <= max(ws + states + dq, ws + dq + rest) + min(dW, rest - dq) // 2, (peak, ws, states, dq, rest)
    assert all(torch.isfinite(g).all() for g in grads)


def test_residual_only_where_the_backward_takes_it():
    """fp32 inputs, K = 256 and the scan keep no residual (their backward needs prep's W and U); a residual of the
    wrong size is refused."""
    for dtype, K, algorithm in ((torch.float32, 128, "auto"), (torch.bfloat16, 256, "auto"),
                                (torch.bfloat16, 128, "scan")):
        inp = make_inputs(2, 130, 8, 64, K, 64, dtype)
        args = list(_op_args(inp, K ** -0.5))
        args[16] = algorithm
        _, _, res = torch.ops.gated_delta.fwd_with_residual(*args)
        assert res.numel() == 0, (dtype, K, algorithm)
    inp = make_inputs(2, 130, 8, 64, 128, 128, torch.bfloat16)
    args = _op_args(inp, 128 ** -0.5)
    o, ht, res = torch.ops.gated_delta.fwd_with_residual(*args)
    with pytest.raises(RuntimeError, match="residual must be what fwd_with_residual returned for these inputs"):
        torch.ops.gated_delta.bwd(torch.ones_like(o), None, *args[:6], args[6], *args[8:], residual=res[:-256])


def test_torch_compile_gradients_without_the_residual():
    """Under torch.compile (fullgraph) the traced forward keeps no residual (its size would be an unbacked symbol
    that fwd's outputs cannot bind) and the compiled backward prepares the chunks itself: its gradients differ from
    the eager ones, which came through the residual, by the roundings of A and Tm and where diag(beta) is applied
    only (prep's rounded Tm diag(beta), against the state passes' fp32 operands)."""
    from gated_delta import gated_delta_rule

    torch._dynamo.reset()
    inp = make_inputs(2, 130, 8, 64, 128, 128, torch.bfloat16)

    def loss_fn(q, k, v, g, beta):
        o, _ = gated_delta_rule(q, k, v, g, beta, initial_state=inp["initial_state"])
        return (o.float() * o.float()).sum()

    def grads(fn):
        xs = [inp[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
        return torch.autograd.grad(fn(*xs), xs)

    eager = grads(loss_fn)
    compiled = grads(torch.compile(loss_fn, fullgraph=True))
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), eager, compiled):
        assert rel_err(b, a) <= TOL[torch.bfloat16][1] / 2, name
