"""flash-linear-attention (FLA 0.6.0) parity of chunk_gated_delta_rule and fused_recurrent_gated_delta_rule: every
call FLA documents, forward and backward, on the CPU and (marked `gpu`) on CUDA, against the float64 token loop.

The reference runs on the rounded inputs (each upcast from the dtype it was given in), so the errors measure the
computation and the rounding of the results. Relative L2 error tolerances, (outputs and final state, gradients):
"""
import warnings

import pytest
import torch
import torch.nn.functional as F

import gated_delta
from gated_delta.reference import gated_delta_rule_ref

F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16

# per compute dtype (the wider of q/k and v); CUDA's fp32 products run on tensor cores in a split bf16x3 form
TOL = {
    "cpu": {F64: (1e-10, 1e-10), F32: (1e-5, 1e-5), BF16: (5e-3, 1e-2), F16: (1e-3, 2e-3)},
    "cuda": {F32: (1e-3, 1e-3), BF16: (5e-3, 1e-2), F16: (2.5e-3, 5e-3)},
}

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FNS = {"chunk": gated_delta.chunk_gated_delta_rule, "fused_recurrent": gated_delta.fused_recurrent_gated_delta_rule}


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    den = b.norm().item()
    return (a - b).norm().item() / (den if den > 0 else 1.0)


def draw(seed, B=1, T=20, H=1, HV=2, K=16, V=24, lengths=None, gate=False):
    """float64 CPU inputs in the ranges models use: unit-norm keys, log decays in (-1, 0) with some exactly 0 and
    one full reset, beta in (0, 1); with gate, raw gates and A_log, dt_bias."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    if lengths is not None:
        B, T = 1, sum(lengths)
    N = B if lengths is None else len(lengths)
    x = dict(q=rnd(B, T, H, K), k=F.normalize(rnd(B, T, H, K), dim=-1), v=rnd(B, T, HV, V),
             beta=torch.rand(B, T, HV, generator=gen, dtype=F64), initial_state=rnd(N, HV, K, V) * 0.5)
    if gate:
        x.update(g=rnd(B, T, HV), A_log=rnd(HV) * 0.5, dt_bias=rnd(HV) * 0.5)
    else:
        g = -torch.rand(B, T, HV, generator=gen, dtype=F64)
        if T > 2:
            g.view(-1)[::7] = 0.0
            g.view(-1)[1] = -1e4
        x["g"] = g
    if lengths is not None:
        x["cu_seqlens"] = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.long)
    return x


def check(fn, x, dtypes, device, v_first=False, drop=(), ref_options=None, **kwargs):
    """Runs fn on x (float64 CPU tensors converted to dtypes[name], default the dtype of q, on device), forward
    and backward through o and the final state, and compares with the float64 loop. Returns our results."""
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias") if n in x and n not in drop]
    qdt = dtypes.get("q", F32)
    ours = {}
    for n in names:
        t = x[n]
        if n == "initial_state" and v_first:
            t = t.transpose(-1, -2).contiguous()
        ours[n] = t.to(device=device, dtype=dtypes.get(n, qdt)).requires_grad_()
    extra = {n: x[n].to(device) for n in ("cu_seqlens",) if n in x}
    o, ht = fn(**ours, **extra, output_final_state=True, state_v_first=v_first, **kwargs)

    # the reference sees the rounded inputs, in float64, with the state [N, HV, K, V]
    ref = {n: t.detach().double().cpu().requires_grad_() for n, t in ours.items()}
    call = dict(ref)
    if v_first:
        call["initial_state"] = ref["initial_state"].transpose(-1, -2)
    call.update({k: v for k, v in kwargs.items() if k in ("use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel",
                                                         "allow_neg_eigval", "use_gate_in_kernel")})
    call.update(ref_options or {})
    o_ref, ht_ref = gated_delta_rule_ref(**call, cu_seqlens=x.get("cu_seqlens"), output_final_state=True)
    if v_first:
        ht_ref = ht_ref.transpose(-1, -2)

    gen = torch.Generator().manual_seed(1)
    w_o = torch.randn(o_ref.shape, generator=gen, dtype=F64)
    w_h = torch.randn(ht_ref.shape, generator=gen, dtype=F64)
    (o.double() * w_o.to(device)).sum().add((ht.double() * w_h.to(device)).sum()).backward()
    (o_ref.double() * w_o).sum().add((ht_ref * w_h).sum()).backward()

    cd = torch.promote_types(dtypes.get("q", F32), dtypes.get("v", qdt))
    assert o.dtype == ours["v"].dtype and o.device.type == device
    assert ht.dtype == (F64 if cd == F64 else F32) and ht.shape == ht_ref.shape
    errs = {"o": (rel(o, o_ref), o.dtype), "ht": (rel(ht, ht_ref), ht.dtype)}
    for n in names:
        assert ours[n].grad is not None, n
        assert ours[n].grad.dtype == ours[n].dtype, (n, ours[n].grad.dtype, ours[n].dtype)
        errs["d" + n] = (rel(ours[n].grad, ref[n].grad), ours[n].dtype)
    for key, (e, held_in) in errs.items():
        # the tolerance of the compute dtype, or of a coarser dtype the result is rounded to (the gradients start
        # from the output's gradient, held in v's dtype)
        grad = key not in ("o", "ht")
        tol = max(TOL[device][d][grad] for d in (cd, held_in) + ((o.dtype,) if grad else ()) if d in TOL[device])
        assert e <= tol, f"{key}: relative error {e:.2e} > {tol:.0e} ({errs})"
    return o.detach(), ht.detach()


# ---------------------------------------------------------------- initial_state in any float dtype

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", sorted(FNS))
@pytest.mark.parametrize("dt,state_dt", [(BF16, BF16), (F16, F16), (F32, BF16), (F32, F64), (BF16, F32)])
def test_initial_state_in_any_float_dtype(device, fn, dt, state_dt):
    # the state is read in fp32 (an fp64 state with fp32 inputs included: it is rounded to fp32, as FLA reads it);
    # the final state is fp32 and the initial state's gradient comes back in the initial state's dtype
    x = draw(0, B=2, T=65, H=1, HV=2, K=64 if device == "cuda" else 16, V=64 if device == "cuda" else 24)
    check(FNS[fn], x, {"q": dt, "k": dt, "v": dt, "g": F32, "beta": dt, "initial_state": state_dt}, device)


def test_float64_inputs_keep_a_float64_state():
    x = draw(1, T=9)
    _, ht = check(FNS["chunk"], x, {"q": F64, "initial_state": F32}, "cpu")
    assert ht.dtype == F64


# ---------------------------------------------------------------- state_v_first, both layouts

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", sorted(FNS))
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("lengths", [None, [1, 63, 0, 65]])
def test_state_layouts(device, fn, v_first, lengths):
    K, V = (64, 128) if device == "cuda" else (16, 24)  # K != V: a transposed layout cannot pass by accident
    x = draw(2, B=2, T=63, H=1, HV=2, K=K, V=V, lengths=lengths)
    check(FNS[fn], x, {"q": F32, "g": F32}, device, v_first=v_first)


@pytest.mark.parametrize("device", DEVICES)
def test_state_v_first_with_the_scan(device):
    # the scan composes unit maps and reads / writes the caller's states in the combine kernel on CUDA
    K, V = (64, 128) if device == "cuda" else (16, 24)
    x = draw(3, B=1, T=40 * 64 if device == "cuda" else 200, H=1, HV=1, K=K, V=V)
    check(gated_delta.gated_delta_rule, x, {"q": BF16 if device == "cuda" else F32, "g": F32}, device,
          v_first=True, algorithm="scan", **({} if device == "cuda" else {"chunk_size": 16}))


def test_state_v_first_is_a_transpose():
    x = draw(4, B=2, T=30)
    kw = {n: x[n].float() for n in ("q", "k", "v", "g", "beta")}
    h0 = x["initial_state"].float()
    o1, h1 = gated_delta.chunk_gated_delta_rule(**kw, initial_state=h0, output_final_state=True)
    o2, h2 = gated_delta.chunk_gated_delta_rule(**kw, initial_state=h0.transpose(-1, -2).contiguous(),
                                                output_final_state=True, state_v_first=True)
    assert torch.equal(o1, o2) and torch.equal(h1, h2.transpose(-1, -2))
    # a non-contiguous view is read as what it shows
    o3, _ = gated_delta.chunk_gated_delta_rule(**kw, initial_state=h0.transpose(-1, -2), state_v_first=True)
    assert torch.equal(o1, o3)


@pytest.mark.parametrize("fn", sorted(FNS))
def test_transpose_state_layout_is_a_deprecated_alias(fn):
    x = draw(5, B=1, T=12)
    kw = {n: x[n].float() for n in ("q", "k", "v", "g", "beta")}
    h0 = x["initial_state"].float().transpose(-1, -2).contiguous()
    o1, h1 = FNS[fn](**kw, initial_state=h0, output_final_state=True, state_v_first=True)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        o2, h2 = FNS[fn](**kw, initial_state=h0, output_final_state=True, transpose_state_layout=True)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)
    with pytest.raises(ValueError, match="Cannot pass both `state_v_first` and the deprecated"):
        FNS[fn](**kw, state_v_first=True, transpose_state_layout=True)


def test_state_v_first_errors_name_the_layout():
    x = draw(6, B=1, T=5)
    kw = {n: x[n].float() for n in ("q", "k", "v", "g", "beta")}
    with pytest.raises(RuntimeError, match=r"initial_state must have shape \[N, HV, V, K\] = \[1, 2, 24, 16\]"):
        gated_delta.chunk_gated_delta_rule(**kw, initial_state=x["initial_state"].float(), state_v_first=True)


# ---------------------------------------------------------------- the gate in the kernel, dt_bias optional

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", sorted(FNS))
@pytest.mark.parametrize("with_dt_bias", [False, True])
def test_gate_in_kernel_with_optional_dt_bias(device, fn, with_dt_bias):
    K, V = (64, 64) if device == "cuda" else (16, 24)
    x = draw(7, B=2, T=33, K=K, V=V, gate=True)
    dts = {"q": F32, "g": BF16, "A_log": F32, "dt_bias": BF16}
    if with_dt_bias:
        check(FNS[fn], x, dts, device, use_gate_in_kernel=True)
    else:
        # FLA: no dt_bias -> g = -exp(A_log) softplus(g_raw); the reference takes dt_bias = 0
        check(FNS[fn], x, dts, device, drop=("dt_bias",), use_gate_in_kernel=True,
              ref_options={"dt_bias": torch.zeros(2, dtype=F64)})


# ---------------------------------------------------------------- head dims between the kernels' sizes

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("K,V", [(32, 32), (60, 60), (100, 100), (128, 256), (16, 80), (200, 48), (64, 512),
                                 (48, 300)])
@pytest.mark.parametrize("v_first", [False, True])
def test_head_dims(device, K, V, v_first):
    # CUDA zero-pads K and V to its kernels' sizes; the CPU takes any size (short: the reference loop is slow)
    x = draw(8, B=1, T=65 if device == "cuda" else 7, H=1, HV=2, K=K, V=V)
    dt = BF16 if device == "cuda" else F32
    check(FNS["chunk"], x, {"q": dt, "g": F32, "initial_state": F32}, device, v_first=v_first,
          use_qk_l2norm_in_kernel=(dt == F32))


@pytest.mark.parametrize("device", DEVICES)
def test_head_dims_varlen_grouped(device):
    x = draw(9, H=2, HV=4, K=48, V=72, lengths=[64, 1, 65] if device == "cuda" else [6, 1, 9])
    check(FNS["chunk"], x, {"q": F32, "g": F32}, device)


@pytest.mark.parametrize("K,V", [(257, 64), (300, 512)])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
def test_head_dim_k_over_256_raises_on_cuda(device, K, V):
    # (FLA's chunk kernels take K up to 256 as well; V has no limit in either)
    x = draw(10, T=4, K=K, V=V)
    kw = {n: x[n].to(device=device, dtype=F32) for n in ("q", "k", "v", "g", "beta")}
    with pytest.raises(RuntimeError, match=f"support head dim K up to 256 \\(V any\\), got K = {K}, V = {V}"):
        gated_delta.chunk_gated_delta_rule(**kw)


# ---------------------------------------------------------------- q/k and v in different dtypes

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", sorted(FNS))
@pytest.mark.parametrize("qk_dt,v_dt", [(F32, F16), (F32, BF16), (BF16, F32)])
def test_qk_and_v_in_different_dtypes(device, fn, qk_dt, v_dt):
    # FLA's fused_recurrent returns empty_like(v): the output has v's dtype; the computation runs in the wider
    K, V = (64, 64) if device == "cuda" else (16, 24)
    x = draw(11, B=2, T=17, K=K, V=V)
    check(FNS[fn], x, {"q": qk_dt, "k": qk_dt, "v": v_dt, "g": F16, "beta": BF16, "initial_state": F16}, device,
          use_qk_l2norm_in_kernel=(qk_dt == F32))


# ---------------------------------------------------------------- fused_recurrent's optional g and beta

@pytest.mark.parametrize("device", DEVICES)
def test_fused_recurrent_without_g_or_beta(device):
    K, V = (64, 64) if device == "cuda" else (16, 24)
    x = draw(12, B=2, T=21, K=K, V=V)
    ones, zeros = torch.ones(2, 21, 2, dtype=F64), torch.zeros(2, 21, 2, dtype=F64)
    fn = FNS["fused_recurrent"]
    check(fn, x, {"q": F32}, device, drop=("g",), ref_options={"g": zeros})
    check(fn, x, {"q": F32}, device, drop=("beta",), ref_options={"beta": ones})
    check(fn, x, {"q": F32}, device, drop=("g", "beta"), ref_options={"g": zeros, "beta": ones})


def test_fused_recurrent_beta_sigmoid_and_negative_eigenvalues():
    x = draw(13, B=1, T=19)
    x["beta"] = x["beta"] * 4 - 2  # logits
    check(FNS["fused_recurrent"], x, {"q": F64}, "cpu", use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)


# ---------------------------------------------------------------- FLA's other keywords

def _small():
    x = draw(14, B=1, T=70, lengths=None)
    return {n: x[n].float() for n in ("q", "k", "v", "g", "beta")}, x["initial_state"].float()


def test_chunk_size_keyword_does_not_change_the_result():
    kw, h0 = _small()
    o64, h64 = gated_delta.chunk_gated_delta_rule(**kw, initial_state=h0, output_final_state=True)
    for cs in (16, 32):
        o, h = gated_delta.chunk_gated_delta_rule(**kw, initial_state=h0, output_final_state=True, chunk_size=cs)
        assert rel(o, o64) < 1e-5 and rel(h, h64) < 1e-5
    for cs in (8, 128):
        with pytest.raises(ValueError, match=f"`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got {cs}"):
            gated_delta.chunk_gated_delta_rule(**kw, chunk_size=cs)


def test_chunk_indices_and_cu_seqlens_cpu_are_accepted():
    x = draw(15, lengths=[5, 64, 3])
    kw = {n: x[n].float() for n in ("q", "k", "v", "g", "beta")}
    cu = x["cu_seqlens"]
    o1, h1 = gated_delta.chunk_gated_delta_rule(**kw, cu_seqlens=cu, output_final_state=True)
    # FLA's chunk table (pairs of sequence, chunk index): ours is laid out from cu_seqlens, the table is not read
    chunk_indices = torch.tensor([[0, 0], [1, 0], [2, 0]])
    o2, h2 = gated_delta.chunk_gated_delta_rule(**kw, cu_seqlens=cu, cu_seqlens_cpu=cu.clone(),
                                                chunk_indices=chunk_indices, output_final_state=True)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)
    o3, _ = gated_delta.fused_recurrent_gated_delta_rule(**kw, cu_seqlens=cu, cu_seqlens_cpu=cu.clone())
    assert rel(o3, o1) < 1e-5


@pytest.mark.parametrize("fn", sorted(FNS))
def test_head_first_raises_as_fla(fn):
    kw, _ = _small()
    for value in (True, False):
        with pytest.raises(DeprecationWarning, match=r"head_first has been removed. Inputs must be in `\[B, T, H"):
            FNS[fn](**kw, head_first=value)


def test_cp_context_is_refused_by_name():
    kw, _ = _small()
    with pytest.raises(NotImplementedError, match="cp_context .* is not supported.*cp_group="):
        gated_delta.chunk_gated_delta_rule(**kw, cp_context=object())


@pytest.mark.parametrize("fn", sorted(FNS))
def test_unknown_keywords_raise(fn):
    kw, _ = _small()
    with pytest.raises(TypeError, match="unexpected keyword argument\\(s\\) 'bogus', 'use_tma'"):
        FNS[fn](**kw, use_tma=True, bogus=1)


@pytest.mark.parametrize("fn", sorted(FNS))
def test_allow_neg_eigval_needs_beta_sigmoid(fn):
    kw, _ = _small()
    with pytest.raises(ValueError, match="`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`."):
        FNS[fn](**kw, allow_neg_eigval=True)


def test_fused_recurrent_refusals_name_the_argument():
    kw, _ = _small()
    beta_v = torch.rand(*kw["v"].shape)
    with pytest.raises(NotImplementedError, match=r"beta of shape \[B, T, HV, V\]"):
        gated_delta.fused_recurrent_gated_delta_rule(kw["q"], kw["k"], kw["v"], kw["g"], beta=beta_v)
    with pytest.raises(ValueError, match="`A_log` must be provided when `use_gate_in_kernel=True`."):
        gated_delta.fused_recurrent_gated_delta_rule(**kw, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="`g` .* must be provided when `use_gate_in_kernel=True`."):
        gated_delta.fused_recurrent_gated_delta_rule(kw["q"], kw["k"], kw["v"], beta=kw["beta"],
                                                     use_gate_in_kernel=True, A_log=torch.zeros(2))


def test_fla_positional_order():
    # FLA's positions: chunk (..., scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, ...),
    # fused_recurrent (q, k, v, g, gk, gv, beta, scale, initial_state, output_final_state, ...)
    kw, h0 = _small()
    q, k, v, g, beta = (kw[n] for n in ("q", "k", "v", "g", "beta"))
    o1, h1 = gated_delta.chunk_gated_delta_rule(q, k, v, g, beta, 0.3, h0, True, True)
    o2, h2 = gated_delta.chunk_gated_delta_rule(q, k, v, g, beta, scale=0.3, initial_state=h0,
                                                output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)
    o3, h3 = gated_delta.fused_recurrent_gated_delta_rule(q, k, v, g, None, None, beta, 0.3, h0, True, True)
    assert rel(o3, o1) < 1e-5 and rel(h3, h1) < 1e-5


def test_gated_delta_rule_keeps_its_signature():
    kw, h0 = _small()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o1, h1 = gated_delta.gated_delta_rule(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], None, h0, True)
    o2, h2 = gated_delta.gated_delta_rule(**kw, initial_state=h0.transpose(-1, -2), output_final_state=True,
                                          state_v_first=True)
    assert torch.equal(o1, o2) and torch.equal(h1, h2.transpose(-1, -2))


# ---------------------------------------------------------------- the ops with the new arguments (fake kernels)

@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_state_v_first_mixed_dtypes(requires_grad):
    x = draw(16, B=1, T=11, K=8, V=6, gate=True)
    q, k = x["q"], x["k"]  # float64
    v = x["v"].float().requires_grad_(requires_grad)
    h0 = x["initial_state"].transpose(-1, -2).contiguous().to(BF16).requires_grad_(requires_grad)
    A_log = x["A_log"].float().requires_grad_(requires_grad)
    args = (q.requires_grad_(requires_grad), k.requires_grad_(requires_grad), v, x["g"].to(F16), x["beta"].float(),
            0.3, h0, True, None, None, True, False, False, True, A_log, None, "chunk", 4)
    kwargs = {"state_v_first": True}
    torch.library.opcheck(torch.ops.gated_delta.fwd.default, args, kwargs)
    o, ht = torch.ops.gated_delta.fwd(*args, **kwargs)
    assert o.dtype == F32 and ht.dtype == F64 and ht.shape == (1, 2, 6, 8)
    if not requires_grad:
        d_o, d_ht = torch.randn_like(o), torch.randn(1, 2, 6, 8, dtype=F32)
        torch.library.opcheck(torch.ops.gated_delta.bwd.default, (d_o, d_ht) + args[:7] + args[8:], kwargs)
