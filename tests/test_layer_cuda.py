"""GPU tests of the layer ops and the GatedDeltaNet module: CUDA results against the CPU in float64.
Marked `gpu`; skipped without a CUDA device."""
import copy

import pytest
import torch

import gated_delta as gd

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ops = torch.ops.gated_delta
f64 = torch.float64
DEV = "cuda"


def close(a, b, tol):
    """max |a - b| <= tol * max(1, max |b|), in float64 on the CPU."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    err = (a - b).abs().max().item() if a.numel() else 0.0
    ref = max(1.0, b.abs().max().item() if b.numel() else 0.0)
    assert err <= tol * ref, f"max error {err:.3e} > {tol:.1e} * {ref:.3e}"


def leaf(t, device=DEV, dtype=None):
    return t.detach().to(device=device, dtype=dtype or t.dtype).requires_grad_()


# ---------------------------------------------------------------- short convolution

@pytest.mark.parametrize("W", [2, 4, 8])
@pytest.mark.parametrize("T", [1, 17, 129, 300])
def test_short_conv_cuda_matches_cpu(W, T):
    torch.manual_seed(W * 1000 + T)
    B, D = 3, 200
    x, w, b, h0 = torch.randn(B, T, D, dtype=f64), torch.randn(D, W, dtype=f64), torch.randn(D, dtype=f64), \
        torch.randn(B, D, W - 1, dtype=f64)
    dy, dfs = torch.randn(B, T, D, dtype=f64), torch.randn(B, D, W - 1, dtype=f64)
    ins_cpu = [leaf(t, "cpu") for t in (x, w, b, h0)]
    y_c, fs_c = gd.short_conv(*ins_cpu[:3], initial_state=ins_cpu[3], output_final_state=True)
    torch.autograd.backward([y_c, fs_c], [dy, dfs])
    ins = [leaf(t, dtype=torch.float32) for t in (x, w, b, h0)]
    y, fs = gd.short_conv(*ins[:3], initial_state=ins[3], output_final_state=True)
    torch.autograd.backward([y, fs], [dy.float().to(DEV), dfs.float().to(DEV)])
    close(y, y_c, 1e-5)
    close(fs, fs_c.float(), 0)  # a copy of the fp32 inputs
    for g, gc in zip((t.grad for t in ins), (t.grad for t in ins_cpu)):
        close(g, gc, 1e-4)


def test_short_conv_cuda_varlen_with_empty_sequences():
    torch.manual_seed(1)
    cu = torch.tensor([0, 3, 3, 40, 41, 170])
    D, W = 96, 4
    x, w, b, h0 = torch.randn(1, 170, D, dtype=f64), torch.randn(D, W, dtype=f64), torch.randn(D, dtype=f64), \
        torch.randn(5, D, W - 1, dtype=f64)
    dy, dfs = torch.randn(1, 170, D, dtype=f64), torch.randn(5, D, W - 1, dtype=f64)
    ins_cpu = [leaf(t, "cpu") for t in (x, w, b, h0)]
    y_c, fs_c = gd.short_conv(*ins_cpu[:3], initial_state=ins_cpu[3], output_final_state=True, cu_seqlens=cu)
    torch.autograd.backward([y_c, fs_c], [dy, dfs])
    for cu_dev in (cu.to(DEV), cu.int().to(DEV)):
        ins = [leaf(t, dtype=torch.float32) for t in (x, w, b, h0)]
        y, fs = gd.short_conv(*ins[:3], initial_state=ins[3], output_final_state=True, cu_seqlens=cu_dev)
        torch.autograd.backward([y, fs], [dy.float().to(DEV), dfs.float().to(DEV)])
        close(y, y_c, 1e-5)
        close(fs, fs_c.float(), 0)  # a copy of the fp32 inputs
        for g, gc in zip((t.grad for t in ins), (t.grad for t in ins_cpu)):
            close(g, gc, 1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wdtype", ["same", torch.float32])
def test_short_conv_cuda_low_precision(dtype, wdtype):
    torch.manual_seed(2)
    wd = dtype if wdtype == "same" else wdtype
    x = torch.randn(2, 77, 64).to(dtype)
    w, b = (torch.randn(64, 4) * 0.5).to(wd), torch.randn(64).to(wd)
    y_ref, _ = gd.short_conv(x.double(), w.double(), b.double())
    y, _ = gd.short_conv(x.to(DEV), w.to(DEV), b.to(DEV))
    assert y.dtype == dtype
    close(y, y_ref, 1e-2 if dtype == torch.bfloat16 else 2e-3)
    xg, wg = leaf(x), leaf(w)
    gd.short_conv(xg, wg)[0].float().sum().backward()
    assert xg.grad.dtype == dtype and wg.grad.dtype == wd


def test_short_conv_update_cuda_matches_cpu():
    torch.manual_seed(3)
    B, D, W = 4, 160, 4
    x, w, b = torch.randn(B, 6, D), torch.randn(D, W), torch.randn(D)
    st_c = torch.randn(B, D, W - 1)
    st = st_c.clone().to(DEV)
    for t0, t1 in [(0, 1), (1, 4), (4, 5), (5, 6)]:
        y_c = gd.short_conv_update(x[:, t0:t1], st_c, w, b)
        y = gd.short_conv_update(x[:, t0:t1].to(DEV), st, w.to(DEV), b.to(DEV))
        close(y, y_c, 1e-6)
        close(st, st_c, 0)


# ---------------------------------------------------------------- gated RMSNorm

@pytest.mark.parametrize("D", [1, 100, 128, 2048])
@pytest.mark.parametrize("gate,weight", [(True, True), (False, True), (True, False)])
def test_gated_rmsnorm_cuda_matches_cpu(D, gate, weight):
    torch.manual_seed(D)
    x = torch.randn(5, 37, D, dtype=f64)
    g = torch.randn(5, 37, D, dtype=f64) if gate else None
    w = torch.randn(D, dtype=f64) if weight else None
    dy = torch.randn(5, 37, D, dtype=f64)
    cpu = [leaf(t, "cpu") if t is not None else None for t in (x, g, w)]
    gd.gated_rmsnorm(*cpu).backward(dy)
    dev = [leaf(t, dtype=torch.float32) if t is not None else None for t in (x, g, w)]
    y = gd.gated_rmsnorm(*dev)
    y.backward(dy.float().to(DEV))
    close(y, gd.gated_rmsnorm(x, g, w), 1e-5)
    for a, c in zip(dev, cpu):
        if a is not None:
            close(a.grad, c.grad, 1e-4)


def test_gated_rmsnorm_cuda_bf16_with_fp32_weight():
    torch.manual_seed(4)
    x, g, w = torch.randn(64, 16, 128).bfloat16(), torch.randn(64, 16, 128).bfloat16(), torch.randn(128)
    y = gd.gated_rmsnorm(x.to(DEV), g.to(DEV), w.to(DEV))
    assert y.dtype == torch.bfloat16
    close(y, gd.gated_rmsnorm(x.double(), g.double(), w.double()), 1.6e-2)


# ---------------------------------------------------------------- decode step

def decode_inputs(B, T, H, HV, K, V, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=f64)  # noqa: E731
    return dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), a=r(B, T, HV), b=r(B, T, HV),
                A_log=r(HV) * 0.5, dt_bias=r(HV) * 0.5)


@pytest.mark.parametrize("K,V", [(16, 4), (64, 36), (128, 128), (128, 100), (256, 64)])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("H,HV,neg", [(2, 2, False), (1, 4, True)])
def test_decode_step_cuda_matches_cpu(K, V, T, H, HV, neg):
    inp = decode_inputs(3, T, H, HV, K, V, seed=K + V + T)
    state = torch.randn(3, HV, K, V, dtype=f64)
    st_ref = state.clone()
    o_ref = gd.decode_step(**inp, state=st_ref, allow_neg_eigval=neg)
    st = state.float().to(DEV)
    o = gd.decode_step(**{n: t.float().to(DEV) for n, t in inp.items()}, state=st, allow_neg_eigval=neg)
    close(o, o_ref, 2e-5)
    close(st, st_ref, 2e-5)


def test_decode_step_cuda_bf16_inputs_mixed_param_dtypes():
    inp = decode_inputs(4, 1, 4, 8, 128, 128, seed=5)
    state = torch.randn(4, 8, 128, 128, dtype=f64)
    st_ref = state.clone()
    low = {n: t.bfloat16() for n, t in inp.items()}
    low["A_log"] = inp["A_log"].float()  # parameters in fp32, activations in bf16
    o_ref = gd.decode_step(**{n: t.double() for n, t in low.items()}, state=st_ref)
    st = state.float().to(DEV)
    o = gd.decode_step(**{n: t.to(DEV) for n, t in low.items()}, state=st)
    assert o.dtype == torch.bfloat16
    close(o, o_ref, 1e-2)
    close(st, st_ref, 1e-4)


def test_decode_step_cuda_graph_replay():
    inp = {n: t.float().to(DEV) for n, t in decode_inputs(2, 1, 2, 4, 128, 128, seed=6).items()}
    state = torch.randn(2, 4, 128, 128, device=DEV)
    ref_state = state.clone()
    ref = [gd.decode_step(**inp, state=ref_state) for _ in range(3)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gd.decode_step(**inp, state=state.clone())  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gd.decode_step(**inp, state=state)
    for r in ref:
        graph.replay()
        close(out, r, 1e-6)
    close(state, ref_state, 1e-6)


# ---------------------------------------------------------------- opcheck, devices, limits

def test_opcheck_cuda():
    x, w, b, h0 = (torch.randn(2, 9, 16, device=DEV, requires_grad=True), torch.randn(16, 4, device=DEV,
                   requires_grad=True), torch.randn(16, device=DEV, requires_grad=True),
                   torch.randn(2, 16, 3, device=DEV, requires_grad=True))
    torch.library.opcheck(ops.short_conv_fwd, (x, w, b, h0, None, True, True))
    torch.library.opcheck(ops.short_conv_update, (x.detach()[:, :1], h0.detach().clone(), w.detach(), None, True))
    xn, gn, wn = (torch.randn(*s, device=DEV, requires_grad=True) for s in ((3, 4, 32), (3, 4, 32), (32,)))
    torch.library.opcheck(ops.gated_rmsnorm_fwd, (xn, gn, wn, 1e-5))
    inp = {n: t.float().to(DEV) for n, t in decode_inputs(2, 1, 2, 4, 64, 32, seed=7).items()}
    torch.library.opcheck(ops.decode_step, (inp["q"], inp["k"], inp["v"], inp["a"], inp["b"], inp["A_log"],
                                            inp["dt_bias"], torch.randn(2, 4, 64, 32, device=DEV), 0.125, False))


def test_cuda_device_mix_and_limits_raise_clear_errors():
    x = torch.randn(2, 5, 8, device=DEV)
    with pytest.raises(RuntimeError, match="weight must be on the same device as x"):
        gd.short_conv(x, torch.randn(8, 4))
    with pytest.raises(RuntimeError, match="weight must be on the same device as x"):
        gd.short_conv(x.cpu(), torch.randn(8, 4, device=DEV))
    with pytest.raises(RuntimeError, match="gate must be on the same device as x"):
        gd.gated_rmsnorm(x, x.cpu(), None)
    with pytest.raises(RuntimeError, match=r"W <= 8 on CUDA"):
        gd.short_conv(x, torch.randn(8, 9, device=DEV))
    with pytest.raises(RuntimeError, match="supported on the CPU only"):
        gd.short_conv(x.double(), torch.randn(8, 4, device=DEV, dtype=f64))
    inp = {n: t.float().to(DEV) for n, t in decode_inputs(2, 1, 2, 4, 64, 32, seed=8).items()}
    with pytest.raises(RuntimeError, match="state must be on the same device as q"):
        gd.decode_step(**inp, state=torch.zeros(2, 4, 64, 32))
    with pytest.raises(RuntimeError, match="K in \\{16, 32, 64, 128, 256\\}"):
        bad = decode_inputs(2, 1, 2, 4, 48, 32, seed=9)
        gd.decode_step(**{n: t.float().to(DEV) for n, t in bad.items()}, state=torch.zeros(2, 4, 48, 32, device=DEV))
    with pytest.raises(RuntimeError, match="V a multiple of 4"):
        bad = decode_inputs(2, 1, 2, 4, 64, 30, seed=10)
        gd.decode_step(**{n: t.float().to(DEV) for n, t in bad.items()}, state=torch.zeros(2, 4, 64, 30, device=DEV))


# ---------------------------------------------------------------- the layer

def make_layer(**kw):
    torch.manual_seed(0)
    opts = dict(hidden_size=256, num_heads=2, num_v_heads=4, head_dim=64, head_v_dim=64)
    opts.update(kw)
    layer = gd.GatedDeltaNet(**opts).double()
    with torch.no_grad():
        layer.dt_bias.add_(2.0)
    return layer


def check_against_cpu_float64(cpu, x):
    """The float64 CPU layer `cpu` and its fp32 copy on the GPU, on input x (float64, CPU): output to 1e-4, the input's
    and every parameter's gradient to 1e-3. Returns the GPU layer."""
    dev = copy.deepcopy(cpu).float().to(DEV)
    xc, xd = leaf(x, "cpu"), leaf(x, dtype=torch.float32)
    y_c, _ = cpu(xc)
    y_d, _ = dev(xd)
    close(y_d, y_c, 1e-4)
    dy = torch.randn_like(x)
    y_c.backward(dy)
    y_d.backward(dy.float().to(DEV))
    close(xd.grad, xc.grad, 1e-3)
    for pc, pd in zip(cpu.parameters(), dev.parameters()):
        close(pd.grad, pc.grad, 1e-3)
    return dev


def check_prefill_then_decode(layer, x, prefill):
    """A prefill of x's first `prefill` tokens with a cache, then decode steps one token each, against the full
    forward (to 1e-4)."""
    with torch.no_grad():
        y_full, _ = layer(x)
        y, cache = layer(x[:, :prefill], use_cache=True)
        ys = [y] + [layer(x[:, t:t + 1], cache=cache, use_cache=True)[0] for t in range(prefill, x.shape[1])]
    close(torch.cat(ys, 1), y_full, 1e-4)


@pytest.mark.parametrize("kw", [dict(), dict(feature_map="learnable", allow_neg_eigval=True, conv_bias=True)])
def test_layer_cuda_matches_cpu_float64_forward_and_grads(kw):
    check_against_cpu_float64(make_layer(**kw), torch.randn(2, 100, 256, dtype=f64))


def test_layer_cuda_fla_default_head_dims():
    """FLA's Gated DeltaNet layer defaults to head_dim = 256 and expand_v = 2: K = 256, V = 512, which the CUDA op
    runs as two slices of v's columns. Forward and every gradient against the float64 CPU layer, then a prefill
    followed by decode steps against the full forward."""
    cpu = make_layer(hidden_size=512, num_heads=2, num_v_heads=2, head_dim=256, head_v_dim=None, expand_v=2.0)
    assert cpu.head_v_dim == 512
    x = torch.randn(2, 70, 512, dtype=f64)
    dev = check_against_cpu_float64(cpu, x)
    check_prefill_then_decode(dev, x.float().to(DEV), 66)


def test_layer_cuda_prefill_then_decode_equals_full_forward():
    check_prefill_then_decode(make_layer().float().to(DEV), torch.randn(3, 40, 256, device=DEV), 33)


def test_layer_cuda_varlen_prefill_equals_separate():
    layer = make_layer().float().to(DEV)
    lens = [17, 1, 90]
    xs = [torch.randn(1, L, 256, device=DEV) for L in lens]
    cu = torch.tensor([0, 17, 18, 108], device=DEV)
    with torch.no_grad():
        y, cache = layer(torch.cat(xs, 1), cu_seqlens=cu, use_cache=True)
        for i, x in enumerate(xs):
            y_i, c_i = layer(x, use_cache=True)
            close(y[:, cu[i]:cu[i + 1]], y_i, 1e-4)
            close(cache.recurrent_state[i:i + 1], c_i.recurrent_state, 1e-4)


def test_layer_cuda_bf16_autocast_trains():
    layer = make_layer().float().to(DEV)
    x = torch.randn(2, 64, 256, device=DEV, requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, _ = layer(x)
    y.float().pow(2).mean().backward()
    for n, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
