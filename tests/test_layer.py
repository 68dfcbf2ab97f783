"""CPU tests of the layer ops (short convolution, gated RMSNorm, decode step) and the GatedDeltaNet module,
against plain PyTorch references in float64."""
import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck

import gated_delta as gd
from gated_delta import layer_ops
from gated_delta.reference import gated_delta_rule_ref

ops = torch.ops.gated_delta
f64 = torch.float64


# ---------------------------------------------------------------- references

def short_conv_ref(x, weight, bias=None, initial_state=None, cu_seqlens=None, activation="silu"):
    """Per sequence: prepend the initial state (or zeros), depthwise conv1d, SiLU. Returns y, final state."""
    B, T, D = x.shape
    W = weight.shape[1]
    bounds = ([(b, 0, T) for b in range(B)] if cu_seqlens is None else
              [(0, int(s), int(e)) for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])])
    ys, finals = [], []
    for n, (b, s, e) in enumerate(bounds):
        h0 = initial_state[n] if initial_state is not None else x.new_zeros(D, W - 1)
        xe = torch.cat([h0, x[b, s:e].t()], dim=1)  # [D, W - 1 + L]
        if e > s:
            z = F.conv1d(xe[None], weight[:, None], bias, groups=D)[0].t()  # [L, D]
        else:
            z = x.new_zeros(0, D)
        ys.append(F.silu(z) if activation else z)
        finals.append(xe[:, xe.shape[1] - (W - 1):])
    y = torch.stack(ys) if cu_seqlens is None else torch.cat(ys)[None]
    return y, torch.stack(finals)


def gated_rmsnorm_ref(x, gate, weight, eps):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    if gate is not None:
        y = y * F.silu(gate)
    return y


def rand(*shape, dtype=f64, requires_grad=False):
    return torch.randn(*shape, dtype=dtype).requires_grad_(requires_grad)


# ---------------------------------------------------------------- short convolution

@pytest.mark.parametrize("T", [1, 3, 17, 71])
@pytest.mark.parametrize("W", [1, 2, 4])
@pytest.mark.parametrize("bias,h0,act", [(True, True, "silu"), (False, False, "silu"), (True, False, None)])
def test_short_conv_matches_reference(T, W, bias, h0, act):
    torch.manual_seed(T * 10 + W)
    B, D = 2, 6
    x, w = rand(B, T, D), rand(D, W)
    b = rand(D) if bias else None
    s0 = rand(B, D, W - 1) if h0 else None
    y, fs = gd.short_conv(x, w, b, initial_state=s0, output_final_state=True, activation=act)
    y_ref, fs_ref = short_conv_ref(x, w, b, s0, activation=act)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fs, fs_ref, rtol=0, atol=0)
    y2, none = gd.short_conv(x, w, b, initial_state=s0, activation=act)
    assert none is None and torch.equal(y, y2)


def test_short_conv_varlen_and_state_with_short_sequences():
    torch.manual_seed(1)
    lens = [3, 0, 1, 10, 2]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))
    D, W = 5, 4
    x, w, b, s0 = rand(1, sum(lens), D), rand(D, W), rand(D), rand(len(lens), D, W - 1)
    y, fs = gd.short_conv(x, w, b, initial_state=s0, output_final_state=True, cu_seqlens=cu)
    y_ref, fs_ref = short_conv_ref(x, w, b, s0, cu_seqlens=cu)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fs, fs_ref, rtol=0, atol=0)
    # int32 offsets give the same result
    y32, fs32 = gd.short_conv(x, w, b, initial_state=s0, output_final_state=True, cu_seqlens=cu.int())
    assert torch.equal(y32, y) and torch.equal(fs32, fs)


def test_short_conv_gradcheck():
    torch.manual_seed(2)
    x, w, b, s0 = rand(2, 7, 3, requires_grad=True), rand(3, 4, requires_grad=True), rand(3, requires_grad=True), \
        rand(2, 3, 3, requires_grad=True)
    assert gradcheck(lambda *a: gd.short_conv(*a[:3], initial_state=a[3], output_final_state=True), (x, w, b, s0))
    assert gradcheck(lambda x, w: gd.short_conv(x, w)[0], (x, w))
    assert gradcheck(lambda x, w, b: gd.short_conv(x, w, b, activation=None)[0], (x, w, b))


def test_short_conv_gradcheck_varlen():
    torch.manual_seed(3)
    cu = torch.tensor([0, 2, 2, 7, 8])
    x, w, b, s0 = rand(1, 8, 3, requires_grad=True), rand(3, 3, requires_grad=True), rand(3, requires_grad=True), \
        rand(4, 3, 2, requires_grad=True)
    assert gradcheck(
        lambda *a: gd.short_conv(*a[:3], initial_state=a[3], output_final_state=True, cu_seqlens=cu), (x, w, b, s0))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_short_conv_low_precision(dtype, tol):
    torch.manual_seed(4)
    x, w, b = rand(2, 33, 16), rand(16, 4) * 0.5, rand(16)
    y_ref, _ = short_conv_ref(x.to(dtype).double(), w, b)
    for wd in (dtype, torch.float32):  # parameters in the input dtype or fp32 master weights
        y, _ = gd.short_conv(x.to(dtype), w.to(wd), b.to(wd))
        assert y.dtype == dtype
        w_used = w.to(wd).double()
        y_ref, _ = short_conv_ref(x.to(dtype).double(), w_used, b.to(wd).double())
        torch.testing.assert_close(y.double(), y_ref, rtol=tol, atol=tol)
        yy = y.float().requires_grad_()
        xg = x.to(dtype).requires_grad_()
        wg = w.to(wd).requires_grad_()
        gd.short_conv(xg, wg)[0].float().sum().backward()
        assert xg.grad.dtype == dtype and wg.grad.dtype == wd
        del yy


def test_short_conv_non_contiguous_input():
    torch.manual_seed(5)
    base = rand(2, 9, 12)
    x = base[:, :, ::2]
    w = rand(6, 4)
    y, _ = gd.short_conv(x, w)
    torch.testing.assert_close(y, short_conv_ref(x.contiguous(), w)[0], rtol=1e-12, atol=1e-12)


def test_short_conv_update_matches_forward():
    torch.manual_seed(6)
    B, T, D, W = 3, 12, 7, 4
    x, w, b = rand(B, T, D), rand(D, W), rand(D)
    y_ref, fs_ref = short_conv_ref(x, w, b)
    y0, state = gd.short_conv(x[:, :5], w, b, output_final_state=True)
    state = state.clone()
    ys = [y0]
    for t0, t1 in [(5, 6), (6, 9), (9, 10), (10, 12)]:  # single tokens and a few at once
        ys.append(gd.short_conv_update(x[:, t0:t1], state, w, b))
    torch.testing.assert_close(torch.cat(ys, 1), y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, fs_ref, rtol=0, atol=0)
    # the module form, with an nn.Conv1d-shaped weight
    conv = gd.ShortConvolution(D, W, bias=True).double()
    st = torch.zeros(B, D, W - 1, dtype=f64)
    y_steps = torch.cat([conv.step(x[:, t:t + 1], st) for t in range(T)], 1)
    with torch.no_grad():
        torch.testing.assert_close(y_steps, conv(x)[0], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- gated RMSNorm

@pytest.mark.parametrize("gate,weight", [(True, True), (False, True), (True, False), (False, False)])
@pytest.mark.parametrize("D", [1, 7, 64])
def test_gated_rmsnorm_matches_reference(gate, weight, D):
    torch.manual_seed(D)
    x = rand(3, 5, D)
    g = rand(3, 5, D) if gate else None
    w = rand(D) if weight else None
    y = gd.gated_rmsnorm(x, g, w, eps=1e-5)
    torch.testing.assert_close(y, gated_rmsnorm_ref(x, g, w, 1e-5), rtol=1e-12, atol=1e-12)


def test_gated_rmsnorm_gradcheck():
    torch.manual_seed(7)
    x, g, w = rand(4, 3, 9, requires_grad=True), rand(4, 3, 9, requires_grad=True), rand(9, requires_grad=True)
    assert gradcheck(lambda x, g, w: gd.gated_rmsnorm(x, g, w, 1e-3), (x, g, w))
    assert gradcheck(lambda x, w: gd.gated_rmsnorm(x, None, w, 1e-3), (x, w))
    assert gradcheck(lambda x, g: gd.gated_rmsnorm(x, g, None, 1e-3), (x, g))
    # many rows: the weight gradient is summed over row blocks
    x, g, w = rand(700, 5, requires_grad=True), rand(700, 5, requires_grad=True), rand(5, requires_grad=True)
    assert gradcheck(lambda x, g, w: gd.gated_rmsnorm(x, g, w, 1e-3), (x, g, w), fast_mode=True)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1.6e-2), (torch.float16, 2e-3), (torch.float32, 1e-5)])
def test_gated_rmsnorm_low_precision_computes_in_fp32(dtype, tol):
    torch.manual_seed(8)
    x, g, w = rand(64, 128) * 30, rand(64, 128), rand(128)
    xl, gl = x.to(dtype), g.to(dtype)
    y = gd.gated_rmsnorm(xl, gl, w.float(), 1e-5)
    assert y.dtype == dtype
    ref = gated_rmsnorm_ref(xl.double(), gl.double(), w.float().double(), 1e-5)
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)
    xg, gg, wg = xl.clone().requires_grad_(), gl.clone().requires_grad_(), w.float().requires_grad_()
    gd.gated_rmsnorm(xg, gg, wg).float().pow(2).sum().backward()
    xr, gr, wr = xl.double().requires_grad_(), gl.double().requires_grad_(), w.float().double().requires_grad_()
    gated_rmsnorm_ref(xr, gr, wr, 1e-5).to(dtype).double().pow(2).sum().backward()
    assert xg.grad.dtype == dtype and wg.grad.dtype == torch.float32
    for a, b in ((xg.grad, xr.grad), (gg.grad, gr.grad), (wg.grad, wr.grad)):
        torch.testing.assert_close(a.double(), b, rtol=5 * tol, atol=5 * tol * b.abs().max().item())


# ---------------------------------------------------------------- decode step

def decode_inputs(B, T, H, HV, K, V, dtype=f64, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=f64)  # noqa: E731
    return dict(q=r(B, T, H, K).to(dtype), k=r(B, T, H, K).to(dtype), v=r(B, T, HV, V).to(dtype),
                a=r(B, T, HV).to(dtype), b=r(B, T, HV).to(dtype), A_log=r(HV) * 0.5, dt_bias=r(HV) * 0.5)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("H,HV", [(2, 2), (1, 3)])
@pytest.mark.parametrize("neg", [False, True])
def test_decode_step_matches_reference(T, H, HV, neg):
    B, K, V = 2, 8, 5
    inp = decode_inputs(B, T, H, HV, K, V, seed=T + H + HV)
    state = torch.randn(B, HV, K, V, dtype=f64)
    o_ref, s_ref = gated_delta_rule_ref(
        inp["q"], inp["k"], inp["v"], inp["a"], inp["b"], initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg,
        use_gate_in_kernel=True, A_log=inp["A_log"], dt_bias=inp["dt_bias"])
    st = state.clone()
    o = gd.decode_step(**inp, state=st, allow_neg_eigval=neg)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st, s_ref, rtol=1e-12, atol=1e-12)


def test_decode_step_fp32_and_bf16():
    B, T, H, HV, K, V = 2, 2, 2, 4, 16, 8
    inp = decode_inputs(B, T, H, HV, K, V, seed=9)
    state = torch.randn(B, HV, K, V, dtype=f64)
    o_ref, s_ref = gated_delta_rule_ref(
        inp["q"], inp["k"], inp["v"], inp["a"], inp["b"], initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
        A_log=inp["A_log"], dt_bias=inp["dt_bias"])
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        low = {n: (t.to(dtype) if n in "qkvab" else t.float()) for n, t in inp.items()}
        st = state.float()
        o = gd.decode_step(**low, state=st)
        assert o.dtype == dtype and st.dtype == torch.float32
        torch.testing.assert_close(o.double(), o_ref, rtol=tol, atol=tol)
        torch.testing.assert_close(st.double(), s_ref, rtol=tol, atol=tol)


# ---------------------------------------------------------------- opcheck

def test_opcheck_short_conv():
    torch.manual_seed(10)
    x, w, b, s0 = rand(2, 5, 3, requires_grad=True), rand(3, 4, requires_grad=True), rand(3, requires_grad=True), \
        rand(2, 3, 3, requires_grad=True)
    torch.library.opcheck(ops.short_conv_fwd, (x, w, b, s0, None, True, True))
    torch.library.opcheck(ops.short_conv_fwd, (x.detach(), w.detach(), None, None, None, False, False))
    cu = torch.tensor([0, 2, 5])
    torch.library.opcheck(ops.short_conv_fwd, (rand(1, 5, 3), rand(3, 4), None, rand(2, 3, 3), cu, True, True))
    torch.library.opcheck(ops.short_conv_bwd, (rand(2, 5, 3), rand(2, 3, 3), x.detach(), w.detach(), b.detach(),
                                               s0.detach(), None, True))
    torch.library.opcheck(ops.short_conv_bwd, (rand(2, 5, 3), None, x.detach(), w.detach(), None, None, None, True))
    torch.library.opcheck(ops.short_conv_update, (rand(2, 1, 3), rand(2, 3, 3), rand(3, 4), rand(3), True))


def test_opcheck_gated_rmsnorm():
    torch.manual_seed(11)
    x, g, w = rand(2, 3, 8, requires_grad=True), rand(2, 3, 8, requires_grad=True), rand(8, requires_grad=True)
    torch.library.opcheck(ops.gated_rmsnorm_fwd, (x, g, w, 1e-5))
    torch.library.opcheck(ops.gated_rmsnorm_fwd, (x.detach(), None, None, 1e-5))
    _, rstd = ops.gated_rmsnorm_fwd(x.detach(), g.detach(), w.detach(), 1e-5)
    torch.library.opcheck(ops.gated_rmsnorm_bwd, (rand(2, 3, 8), x.detach(), g.detach(), w.detach(), rstd, 1e-5))
    torch.library.opcheck(ops.gated_rmsnorm_bwd, (rand(2, 3, 8), x.detach(), None, None, rstd, 1e-5))


def test_opcheck_decode_step():
    inp = decode_inputs(2, 1, 2, 4, 8, 4, dtype=torch.float32)
    state = torch.randn(2, 4, 8, 4)
    torch.library.opcheck(ops.decode_step, (inp["q"], inp["k"], inp["v"], inp["a"], inp["b"], inp["A_log"].float(),
                                            inp["dt_bias"].float(), state, 0.3, False))


# ---------------------------------------------------------------- bad arguments

def test_bad_arguments_raise_clear_errors():
    x, w = rand(2, 5, 4), rand(4, 3)
    with pytest.raises(RuntimeError, match=r"x must have shape \[B, T, D\]"):
        gd.short_conv(rand(5, 4), w)
    with pytest.raises(RuntimeError, match=r"weight must have shape \[D, W\] = \[4, W\]"):
        gd.short_conv(x, rand(5, 3))
    with pytest.raises(RuntimeError, match=r"bias must have shape \[D\] = \[4\]"):
        gd.short_conv(x, w, rand(3))
    with pytest.raises(RuntimeError, match=r"initial_state must have shape \[N, D, W - 1\] = \[2, 4, 2\]"):
        gd.short_conv(x, w, initial_state=rand(2, 4, 3))
    with pytest.raises(RuntimeError, match="initial_state must have the dtype of x"):
        gd.short_conv(x, w, initial_state=rand(2, 4, 2, dtype=torch.float32))
    with pytest.raises(RuntimeError, match="weight must have the dtype of x"):
        gd.short_conv(x.float(), w.half())
    with pytest.raises(RuntimeError, match="cu_seqlens requires a packed batch with B = 1"):
        gd.short_conv(x, w, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(RuntimeError, match="cu_seqlens must end at T = 5"):
        gd.short_conv(x[:1], w, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(RuntimeError, match="cu_seqlens must be non-decreasing"):
        gd.short_conv(x[:1], w, cu_seqlens=torch.tensor([0, 3, 2, 5]))
    with pytest.raises(RuntimeError, match="cu_seqlens must be int32 or int64"):
        gd.short_conv(x[:1], w, cu_seqlens=torch.tensor([0.0, 5.0]))
    with pytest.raises(ValueError, match="activation must be one of"):
        gd.short_conv(x, w, activation="gelu")
    with pytest.raises(RuntimeError, match="conv_state must be contiguous"):
        gd.short_conv_update(x[:, :1], rand(2, 2, 4).transpose(1, 2), w)
    with pytest.raises(RuntimeError, match=r"conv_state must have shape \[B, D, W - 1\] = \[2, 4, 2\]"):
        gd.short_conv_update(x[:, :1], rand(2, 4, 3), w)

    with pytest.raises(RuntimeError, match="gate must have the shape of x"):
        gd.gated_rmsnorm(x, rand(2, 5, 3), None)
    with pytest.raises(RuntimeError, match="gate must have the dtype of x"):
        gd.gated_rmsnorm(x, x.float(), None)
    with pytest.raises(RuntimeError, match=r"weight must have shape \[D\] = \[4\]"):
        gd.gated_rmsnorm(x, None, rand(5))
    with pytest.raises(RuntimeError, match="eps must be a finite number >= 0"):
        gd.gated_rmsnorm(x, None, None, eps=-1.0)
    with pytest.raises(RuntimeError, match="x must be float64, float32, bfloat16 or float16"):
        gd.gated_rmsnorm(torch.ones(3, 4, dtype=torch.int32), None, None)

    inp = decode_inputs(2, 1, 2, 4, 8, 4)
    with pytest.raises(RuntimeError, match=r"state must have shape \[B, HV, K, V\] = \[2, 4, 8, 4\]"):
        gd.decode_step(**inp, state=torch.zeros(2, 4, 4, 8, dtype=f64))
    with pytest.raises(RuntimeError, match="state must be Double"):
        gd.decode_step(**inp, state=torch.zeros(2, 4, 8, 4))
    with pytest.raises(RuntimeError, match="state must be contiguous"):
        gd.decode_step(**inp, state=torch.zeros(2, 4, 4, 8, dtype=f64).transpose(2, 3))
    with pytest.raises(RuntimeError, match="v must have shape .* with HV a multiple of H=2"):
        gd.decode_step(**{**inp, "v": rand(2, 1, 3, 4)}, state=torch.zeros(2, 3, 8, 4, dtype=f64))
    with pytest.raises(RuntimeError, match=r"A_log must have shape \[HV\] = \[4\]"):
        gd.decode_step(**{**inp, "A_log": rand(2)}, state=torch.zeros(2, 4, 8, 4, dtype=f64))
    with pytest.raises(RuntimeError, match="k must have the dtype of q"):
        gd.decode_step(**{**inp, "k": inp["k"].float()}, state=torch.zeros(2, 4, 8, 4, dtype=f64))


# ---------------------------------------------------------------- the layer

def make_layer(seed=0, dtype=f64, **kw):
    torch.manual_seed(seed)
    opts = dict(hidden_size=24, num_heads=2, num_v_heads=4, head_dim=8, head_v_dim=6)
    opts.update(kw)
    layer = gd.GatedDeltaNet(**opts).to(dtype)
    with torch.no_grad():  # larger gates than the default init, so that the test sees the decay
        layer.dt_bias.add_(2.0)
    return layer


LAYER_VARIANTS = [
    dict(),
    dict(feature_map="relu"),
    dict(feature_map="elu", allow_neg_eigval=True),
    dict(feature_map="learnable", conv_bias=True),
    dict(use_short_conv=False, use_output_gate=False),
    dict(conv_size=2, num_v_heads=2),
]


@pytest.mark.parametrize("kw", LAYER_VARIANTS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_layer_prefill_then_decode_equals_full_forward(kw):
    layer = make_layer(**kw)
    B, T, n = 2, 9, 5
    x = torch.randn(B, T + n, 24, dtype=f64)
    with torch.no_grad():
        y_full, _ = layer(x)
        y, cache = layer(x[:, :T], use_cache=True)
        ys = [y]
        for t in range(T, T + n):
            yt, cache2 = layer(x[:, t:t + 1], cache=cache, use_cache=True)
            assert cache2 is cache  # decode updates the cache in place
            ys.append(yt)
    torch.testing.assert_close(torch.cat(ys, 1), y_full, rtol=1e-10, atol=1e-12)


def test_layer_decode_fp32_and_multi_token_steps():
    layer = make_layer(dtype=torch.float32)
    x = torch.randn(3, 16, 24)
    with torch.no_grad():
        y_full, _ = layer(x)
        y, cache = layer(x[:, :6], use_cache=True)
        ys = [y]
        for t0, t1 in [(6, 7), (7, 10), (10, 11), (11, 16)]:
            ys.append(layer(x[:, t0:t1], cache=cache, use_cache=True)[0])
    torch.testing.assert_close(torch.cat(ys, 1), y_full, rtol=1e-4, atol=1e-5)


def test_layer_decode_with_grad_enabled_takes_the_differentiable_path():
    layer = make_layer()
    x = torch.randn(2, 6, 24, dtype=f64)
    with torch.no_grad():
        y_full, _ = layer(x)
    y, cache = layer(x[:, :5], use_cache=True)
    state_before = cache.recurrent_state.detach().clone()
    y1, cache1 = layer(x[:, 5:], cache=cache, use_cache=True)
    assert cache1 is not cache and torch.equal(cache.recurrent_state, state_before)
    torch.testing.assert_close(torch.cat([y, y1], 1).detach(), y_full, rtol=1e-10, atol=1e-12)
    (y1.sum() + cache1.recurrent_state.sum()).backward()
    assert layer.q_proj.weight.grad is not None


def test_layer_varlen_prefill_equals_separate_prefills_then_decode():
    layer = make_layer(feature_map="learnable")
    lens = [4, 1, 7]
    xs = [torch.randn(1, L + 2, 24, dtype=f64) for L in lens]
    cu = torch.tensor([0, 4, 5, 12])
    with torch.no_grad():
        y, cache = layer(torch.cat([x[:, :L] for x, L in zip(xs, lens)], 1), cu_seqlens=cu, use_cache=True)
        assert cache.recurrent_state.shape == (3, 4, 8, 6)
        for i, (x, L) in enumerate(zip(xs, lens)):
            y_i, c_i = layer(x[:, :L], use_cache=True)
            torch.testing.assert_close(y[:, cu[i]:cu[i + 1]], y_i, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(cache.recurrent_state[i:i + 1], c_i.recurrent_state, rtol=1e-10, atol=1e-12)
            for a, b in zip(cache.conv_state, c_i.conv_state):
                torch.testing.assert_close(a[i:i + 1], b, rtol=1e-12, atol=1e-12)
        # decode the three sequences as one batch from the packed prefill's cache
        for t in range(2):
            step = torch.cat([x[:, L + t:L + t + 1] for x, L in zip(xs, lens)], 0)
            y_step, _ = layer(step, cache=cache, use_cache=True)
            for i, (x, L) in enumerate(zip(xs, lens)):
                torch.testing.assert_close(y_step[i:i + 1], layer(x[:, :L + t + 1])[0][:, -1:], rtol=1e-10,
                                           atol=1e-12)


@pytest.mark.parametrize("kw", LAYER_VARIANTS[:4], ids=["default", "relu", "elu", "learnable"])
def test_layer_gradients_reach_every_parameter(kw):
    layer = make_layer(**kw)
    x = torch.randn(2, 7, 24, dtype=f64, requires_grad=True)
    y, _ = layer(x)
    y.pow(2).sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert x.grad is not None


def test_layer_gradcheck_small():
    layer = make_layer(hidden_size=6, num_heads=1, num_v_heads=2, head_dim=3, head_v_dim=2, feature_map="learnable")
    x = torch.randn(1, 4, 6, dtype=f64, requires_grad=True)
    params = [p for p in layer.parameters()]
    names = [n for n, _ in layer.named_parameters()]

    def f(x, *ps):
        sd = dict(zip(names, ps))
        return torch.func.functional_call(layer, sd, (x,))[0]
    assert gradcheck(f, (x, *[p.detach().clone().requires_grad_() for p in params]))


def test_layer_parameter_names_follow_fla():
    layer = gd.GatedDeltaNet(64, 2, num_v_heads=4, head_dim=16, expand_v=2.0)
    shapes = {n: tuple(p.shape) for n, p in layer.state_dict().items()}
    assert shapes == {
        "A_log": (4,), "dt_bias": (4,),
        "q_proj.weight": (32, 64), "k_proj.weight": (32, 64), "v_proj.weight": (128, 64),
        "a_proj.weight": (4, 64), "b_proj.weight": (4, 64),
        "q_conv1d.weight": (32, 1, 4), "k_conv1d.weight": (32, 1, 4), "v_conv1d.weight": (128, 1, 4),
        "g_proj.weight": (128, 64), "o_norm.weight": (32,), "o_proj.weight": (64, 128),
    }
    assert layer.A_log._no_weight_decay and layer.dt_bias._no_weight_decay
    A = layer.A_log.exp()
    assert (A > 0).all() and (A <= 16).all()
    dt = F.softplus(layer.dt_bias)
    assert (dt >= 1e-4 - 1e-7).all() and (dt <= 0.1 + 1e-6).all()


def test_layer_learnable_feature_map_starts_orthogonal():
    layer = make_layer(feature_map="learnable")
    W = layer.qk_feature_map.weight
    eye = torch.eye(W.shape[-1], dtype=W.dtype).expand_as(W)
    torch.testing.assert_close(W.transpose(-1, -2) @ W, eye, rtol=1e-6, atol=1e-6)  # float32 init


def test_layer_bad_arguments():
    with pytest.raises(ValueError, match="num_v_heads must be a multiple of num_heads=2"):
        gd.GatedDeltaNet(16, 2, num_v_heads=3)
    with pytest.raises(ValueError, match="feature_map must be one of"):
        gd.GatedDeltaNet(16, 2, feature_map="tanh")
    with pytest.raises(ValueError, match="algorithm must be one of"):
        gd.GatedDeltaNet(16, 2, algorithm="fast")
    layer = make_layer()
    with pytest.raises(ValueError, match=r"x must have shape \[B, T, hidden_size=24\]"):
        layer(torch.randn(2, 3, 23, dtype=f64))
    with pytest.raises(ValueError, match="cu_seqlens requires a packed batch with B = 1"):
        layer(torch.randn(2, 3, 24, dtype=f64), cu_seqlens=torch.tensor([0, 3]))
    with torch.no_grad():
        _, cache = layer(torch.randn(2, 3, 24, dtype=f64), use_cache=True)
        with pytest.raises(ValueError, match="cache holds 2 sequences, but the input has 3"):
            layer(torch.randn(3, 1, 24, dtype=f64), cache=cache, use_cache=True)
