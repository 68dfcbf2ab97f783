"""Shared helpers of the GPU tests and benchmark: input generation, float64 references, relative errors.

Run as a script for a small forward + backward on the GPU (used under compute-sanitizer):
    compute-sanitizer --tool memcheck python tests/gpu_helpers.py [small | segments | fused]
("segments": one tiny shape on the segments of algorithm="auto", a proven head and one that falls back; "fused":
the one-kernel forward, an equal-length batch and a varlen one)
"""
import sys

import torch
import torch.nn.functional as F

from gated_delta.testing import warm_up_for_capture


# relative L2 error tolerances of the GPU tests against the float64 reference: outputs / final state, gradients
TOL = {
    torch.bfloat16: (5e-3, 1e-2),
    torch.float16: (2.5e-3, 5e-3),
    torch.float32: (1e-3, 1e-3),
}


def rel_err(a, b):
    a = a.double()
    b = b.double()
    den = b.norm()
    if den == 0:
        return (a - b).norm().item()
    return ((a - b).norm() / den).item()


def make_inputs(B, T, H, HV, K, V, dtype, device="cuda", h0=True, cu_seqlens=None, options=False, seed=0):
    """Random inputs in the ranges models use (unit-norm keys, negative log decay, beta in (0, 1))."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, HV, V, generator=gen)
    kw = {}
    if options:
        g = torch.randn(B, T, HV, generator=gen)  # g_raw
        beta = torch.randn(B, T, HV, generator=gen)  # logits
        kw = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                  use_gate_in_kernel=True, A_log=(torch.rand(HV, generator=gen) - 0.5).to(device),
                  dt_bias=(0.5 * torch.randn(HV, generator=gen)).to(device))
    else:
        q = F.normalize(q, dim=-1)
        k = F.normalize(k, dim=-1)
        g = F.logsigmoid(torch.randn(B, T, HV, generator=gen) + 3.0)
        beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen))
    init = torch.randn(N, HV, K, V, generator=gen) * 0.5 if h0 else None
    t = lambda x: x.to(device=device, dtype=dtype)  # noqa: E731
    out = dict(q=t(q), k=t(k), v=t(v), g=g.to(device), beta=t(beta),
               initial_state=None if init is None else init.to(device), **kw)
    if cu_seqlens is not None:
        out["cu_seqlens"] = torch.tensor(cu_seqlens, dtype=torch.long, device=device)
    return out


def output_grads(inp, N, seed=3):
    """Random gradients of the outputs for a backward of `inp`: d_o [B, T, HV, V] in v's dtype and d_ht
    [N, HV, K, V] in fp32, on v's device (drawn on the CPU, so a seed gives the same values on every device)."""
    B, T, HV, V = inp["v"].shape
    K = inp["k"].shape[-1]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    d_o = torch.randn(B, T, HV, V, generator=gen).to(inp["v"].device, inp["v"].dtype)
    d_ht = torch.randn(N, HV, K, V, generator=gen).to(inp["v"].device)
    return d_o, d_ht


DIFFERENTIABLE = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def _leaves(inputs, grads, convert):
    """The differentiable inputs present, and a copy of `inputs` whose floating-point tensors are fresh leaves
    (convert(x.detach())), requiring grad when `grads` and differentiable; other values pass through."""
    names = [n for n in DIFFERENTIABLE if inputs.get(n) is not None]
    out = {}
    for n, x in inputs.items():
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            out[n] = convert(x.detach()).requires_grad_(grads and n in names)
        else:
            out[n] = x
    return names, out


def reference(inputs, d_o=None, d_ht=None, grads=True):
    """float64 reference (the token loop) of o, the final state and, given d_o / d_ht, every gradient.

    With use_qk_l2norm_in_kernel and a 16-bit compute dtype (q's and v's promoted) the op layer (csrc/delta_rule.h)
    hands the kernels the normalised q, k rounded to it; the reference rounds them the same way (straight through
    for the gradient, as the op layer's chain rule does), so that the comparison measures the kernels.
    """
    from gated_delta.reference import gated_delta_rule_ref

    names, x64 = _leaves(inputs, grads, torch.Tensor.double)
    call = dict(x64)
    dt = torch.promote_types(inputs["q"].dtype, inputs["v"].dtype)
    if call.get("use_qk_l2norm_in_kernel") and dt in (torch.bfloat16, torch.float16):
        for n in ("q", "k"):
            x = call[n]
            u = x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
            call[n] = u + (u.float().to(dt).double() - u).detach()
        call["use_qk_l2norm_in_kernel"] = False
    o, ht = gated_delta_rule_ref(**call, output_final_state=True)
    res = {"o": o.detach(), "ht": ht.detach()}
    if grads:
        loss = (o * d_o.double()).sum() + (ht * d_ht.double()).sum()
        gs = torch.autograd.grad(loss, [x64[n] for n in names])
        res.update({"d" + n: gv for n, gv in zip(names, gs)})
    return res


def run_ours(inputs, d_o=None, d_ht=None, algorithm="chunk", grads=True, **extra):
    from gated_delta import gated_delta_rule

    names, xs = _leaves(inputs, grads, torch.Tensor.clone)
    o, ht = gated_delta_rule(**xs, output_final_state=True, algorithm=algorithm, **extra)
    res = {"o": o.detach(), "ht": ht.detach()}
    if grads:
        loss = (o.float() * d_o.float()).sum() + (ht * d_ht).sum()
        gs = torch.autograd.grad(loss, [xs[n] for n in names])
        res.update({"d" + n: gv for n, gv in zip(names, gs)})
    return res


def check_graph_replay(inputs, d_o, d_ht, algorithm):
    """Captures one forward + backward of the ops (q, k, v, g, beta, initial_state of `inputs`, no in-kernel options)
    in a CUDA graph after two warm-up calls on a side stream, poisons the captured outputs, replays the graph and
    checks every output and gradient bitwise against an eager call."""
    K = inputs["q"].shape[-1]
    args = (inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], K ** -0.5, inputs["initial_state"])
    rest = (None, None, False, False, False, False, None, None, algorithm, 64)

    def step():
        o, ht = torch.ops.gated_delta.fwd(*args, True, *rest)
        grads = torch.ops.gated_delta.bwd(d_o, d_ht, *args, *rest)
        return (o, ht) + tuple(grads[:6])

    warm_up_for_capture(step, 2)
    eager = [x.clone() for x in step()]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for x in static:
        if x.is_floating_point():
            x.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, static):
        assert torch.equal(a, b)


def _sanitize_segments():
    """1 x 1100 tokens (18 chunks: segments of 8 chunks, the last one of 2), two value heads: the first with
    decaying gates (proven warm-ups), the second with g = 0 (the exact fallback)."""
    inp = make_inputs(1, 1100, 1, 2, 64, 64, torch.bfloat16)
    inp["g"][..., 1] = 0.0
    d_o, d_ht = output_grads(inp, 1)
    r = run_ours(inp, d_o, d_ht, algorithm="auto")
    torch.cuda.synchronize()
    print("segments ok", all(torch.isfinite(x).all().item() for x in r.values()))


def _sanitize_main(small=False):
    """A small forward + backward touching every kernel family (chunk and scan, varlen, K = 256, and enough chunks
    x q/k heads, 33 x 8, for the preparation to walk two value heads per CTA on a 132-SM GPU). `small` (for racecheck)
    keeps V = 128 (the forward's two-warpgroup CTAs), the varlen batch and the two value heads per CTA."""
    torch.manual_seed(0)
    configs = [(2, 70, 1, 2, 64, 128, None, torch.bfloat16),
               (1, 150, 1, 1, 128, 64, [0, 20, 20, 150], torch.bfloat16),
               (1, 66, 1, 1, 256, 64, None, torch.float32),
               (1, 33 * 64, 8, 16, 64, 64, None, torch.bfloat16)]
    for algo in ("chunk", "scan"):
        for (B, T, H, HV, K, V, cu, dtype) in ((configs[0], configs[1], configs[3]) if small else configs):
                inp = make_inputs(B, T, H, HV, K, V, dtype, cu_seqlens=cu)
                N = B if cu is None else len(cu) - 1
                d_o, d_ht = output_grads(inp, N)
                r = run_ours(inp, d_o, d_ht, algorithm=algo)
                torch.cuda.synchronize()
                print(algo, dtype, K, V, "ok", all(torch.isfinite(x).all().item() for x in r.values()))


def _sanitize_fused():
    """The one-kernel forward (GATED_DELTA_FUSED_FWD=1; 16-bit, K = V = 128, 256 tiles of 64 columns): 4 x 65 tokens
    with 32 value heads in groups of two, and a varlen batch of lengths 0, 1, 63, 400 with 64 value heads; a backward
    after the first; segments with a proven warm-up and the exact fallback, and their backward (both backwards from
    the residual the forward kept)."""
    for (B, T, H, HV, cu) in ((4, 65, 16, 32, None), (1, 464, 16, 64, [0, 0, 1, 64, 464])):
        inp = make_inputs(B, T, H, HV, 128, 128, torch.bfloat16, cu_seqlens=cu)
        N = B if cu is None else len(cu) - 1
        d_o, d_ht = output_grads(inp, N)
        r = run_ours(inp, d_o, d_ht, grads=cu is None)
        torch.cuda.synchronize()
        print("fused", B, T, HV, "ok", all(torch.isfinite(x).all().item() for x in r.values()))
    # segments (algorithm="auto"): 18 chunks, 16 value heads, the first without decay (the exact fallback); the
    # backward reads the residual the forward kept (its own segments' warm-up bounds from prep_residual)
    inp = make_inputs(1, 1100, 4, 16, 128, 128, torch.bfloat16)
    inp["g"][..., 0] = 0.0
    d_o, d_ht = output_grads(inp, 1)
    r = run_ours(inp, d_o, d_ht, algorithm="auto")
    torch.cuda.synchronize()
    print("fused segments ok", all(torch.isfinite(x).all().item() for x in r.values()))


def _sanitize_v_slices():
    """V above 256 as slices of v's columns: 512 (two of 256, K = 256) and, on a varlen batch, 300 (five of 64, the
    last zero-padded; K = 100 padded), each forward + backward from the residual its first slice kept."""
    for (B, T, H, HV, K, V, cu) in ((1, 130, 1, 2, 256, 512, None), (1, 200, 2, 4, 100, 300, [0, 1, 65, 200])):
        inp = make_inputs(B, T, H, HV, K, V, torch.bfloat16, cu_seqlens=cu)
        N = B if cu is None else len(cu) - 1
        d_o, d_ht = output_grads(inp, N)
        r = run_ours(inp, d_o, d_ht)
        torch.cuda.synchronize()
        print("v slices", K, V, "ok", all(torch.isfinite(x).all().item() for x in r.values()))


def _sanitize_strided():
    """v and d_o read in place through their strides: v split from a fused q | k | v projection's output (tokens
    2 H K + HV V elements apart) and d_o a slice of wider rows' columns, through the one-kernel forward and the
    backward from its residual (16-bit, K = V = 128, 256 tiles of 64 columns), then through the mma.sync kernels
    (K = 256); and V = 384 as three slices of 128 through the one-kernel forward."""
    for (B, T, H, HV, K, V) in ((2, 130, 8, 32, 128, 128), (1, 130, 1, 2, 256, 64), (2, 130, 8, 32, 128, 384)):
        inp = make_inputs(B, T, H, HV, K, V, torch.bfloat16)
        d_o, d_ht = output_grads(inp, B)
        fused = torch.randn(B, T, 2 * H * K + HV * V, device="cuda").bfloat16()
        fused[..., 2 * H * K:] = inp["v"].reshape(B, T, HV * V)
        v = fused[..., 2 * H * K:].unflatten(-1, (HV, V))
        wide = torch.randn(B, T, HV, V + 64, device="cuda").bfloat16()
        wide[..., :V] = d_o
        do = wide[..., :V]
        args = (inp["q"], inp["k"], v, inp["g"], inp["beta"], K ** -0.5, inp["initial_state"])
        rest = (None, None, False, False, False, False, None, None, "chunk", 64)
        o, ht, res = torch.ops.gated_delta.fwd_with_residual(*args, True, *rest)
        grads = torch.ops.gated_delta.bwd(do, d_ht, *args, *rest, residual=res)
        torch.cuda.synchronize()
        print("strided", K, V, "ok", all(torch.isfinite(x).all().item() for x in (o, ht) + tuple(grads[:6])))


def _sanitize_l2norm():
    """The L2-norm kernels (l2norm_fwd, l2norm_bwd) on their access patterns: four elements per access (K = 128, q
    split from a fused projection's rows), one (K = 100, and rows one element off alignment), leading dims that do
    not merge, fp32 and bf16 results; then forwards + backwards with use_qk_l2norm_in_kernel (grad_wy reads the
    caller's k for dk's chain rule): bf16 with grouped heads, a varlen batch of odd lengths with K = 64, and q and k
    read in place from a fused projection's rows."""
    ops = torch.ops.gated_delta
    for K in (128, 100):
        fused = torch.randn(2, 65, 3 * 4 * K + 8, device="cuda").bfloat16()
        for x in (fused[..., 4:4 + 4 * K].unflatten(-1, (4, K)), fused[..., 5:5 + 4 * K].unflatten(-1, (4, K)),
                  fused[..., :4 * K].unflatten(-1, (4, K)).permute(1, 0, 2, 3)):
            for out in (None, torch.float32):
                y = ops.l2norm_fwd(x, 1e-6, out)
                dx = ops.l2norm_bwd(torch.randn(x.shape, device="cuda"), x, 1e-6, out)
                torch.cuda.synchronize()
                ok = bool(torch.isfinite(y).all() and torch.isfinite(dx).all())
                print("l2norm", K, tuple(x.stride()), out, "ok", ok)
    for B, T, K, cu in ((2, 130, 128, None), (1, 300, 64, [0, 1, 63, 65, 300])):
        inp = make_inputs(B, T, 2, 4, K, 128, torch.bfloat16, options=True, cu_seqlens=cu)
        d_o, d_ht = output_grads(inp, B if cu is None else len(cu) - 1)
        r = run_ours(inp, d_o, d_ht)
        torch.cuda.synchronize()
        print("l2norm in the op", K, cu, "ok", all(torch.isfinite(x).all().item() for x in r.values()))
    inp = make_inputs(2, 130, 2, 4, 128, 128, torch.bfloat16, options=True)
    rows = torch.randn(2, 130, 3 * 2 * 128, device="cuda").bfloat16()
    rows[..., :256] = inp["q"].flatten(2)
    rows[..., 256:512] = inp["k"].flatten(2)
    q, k = rows[..., :256].unflatten(-1, (2, 128)), rows[..., 256:512].unflatten(-1, (2, 128))
    o, _ = ops.fwd(q, k, inp["v"], inp["g"], inp["beta"], 0.1, None, False, None, None, True, True, True, True,
                   inp["A_log"], inp["dt_bias"], "chunk", 64)
    dq, dk = ops.bwd(torch.randn_like(o), None, q, k, inp["v"], inp["g"], inp["beta"], 0.1, None, None, None, True,
                     True, True, True, inp["A_log"], inp["dt_bias"], "chunk", 64)[:2]
    torch.cuda.synchronize()
    ok = bool(torch.isfinite(dk).all() and torch.isfinite(dq).all())
    print("l2norm in the op, q and k in place", tuple(q.stride()), tuple(k.stride()), "ok", ok)


if __name__ == "__main__":
    if "l2norm" in sys.argv[1:]:
        sys.exit(_sanitize_l2norm())
    if "vslices" in sys.argv[1:]:
        sys.exit(_sanitize_v_slices())
    if "strided" in sys.argv[1:]:
        sys.exit(_sanitize_strided())
    if "fused" in sys.argv[1:]:
        import os
        os.environ["GATED_DELTA_FUSED_FWD"] = "1"
        sys.exit(_sanitize_fused())
    if "segments" in sys.argv[1:]:
        sys.exit(_sanitize_segments())
    sys.exit(_sanitize_main(small="small" in sys.argv[1:]))
