"""The op contract: argument errors, empty inputs, the Python API, opcheck and torch.compile (CPU)."""
import pytest
import torch

import gated_delta
from gated_delta import gated_delta_rule, gated_delta_rule_ref


def make_inputs(B=1, T=9, H=2, HV=4, K=8, V=6, dtype=torch.float64, device="cpu", requires_grad=False):
    q = torch.randn(B, T, H, K, dtype=dtype, device=device)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=dtype, device=device), dim=-1)
    v = torch.randn(B, T, HV, V, dtype=dtype, device=device)
    g = -torch.rand(B, T, HV, dtype=dtype, device=device)
    beta = torch.rand(B, T, HV, dtype=dtype, device=device)
    xs = [q, k, v, g, beta]
    if requires_grad:
        xs = [x.requires_grad_() for x in xs]
    return xs


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


# ---------------------------------------------------------------- bad input

BAD_CASES = {
    "q rank": (lambda a: a.update(q=a["q"][0]), "q must have shape [B, T, H, K]"),
    # no K for the default scale K ** -0.5 (scale not given)
    "q K = 0": (lambda a: a.update(q=a["q"][..., :0], k=a["k"][..., :0]), "q must have K >= 1"),
    "k shape": (lambda a: a.update(k=a["k"][:, :, :1]), "k must have the shape of q"),
    "v shape": (lambda a: a.update(v=a["v"][:, :5]), "v must have shape [B, T, HV, V]"),
    "HV not multiple": (lambda a: a.update(v=torch.randn(1, 9, 3, 6, dtype=torch.float64)),
                        "HV a multiple of H=2, got [1, 9, 3, 6]"),
    "k dtype": (lambda a: a.update(k=a["k"].float()), "k must have the dtype of q"),
    "v int": (lambda a: a.update(v=a["v"].long()), "v must be float64, float32, bfloat16 or float16"),
    "g shape": (lambda a: a.update(g=a["g"][..., :2]), "g must have shape [B, T, HV]"),
    "beta shape": (lambda a: a.update(beta=a["beta"][:, :3]), "beta must have shape [B, T, HV]"),
    "q int": (lambda a: a.update(q=a["q"].long()), "q must be float64, float32, bfloat16 or float16"),
    "initial_state shape": (lambda a: a.update(initial_state=torch.zeros(1, 4, 8, 5, dtype=torch.float64)),
                            "initial_state must have shape [N, HV, K, V] = [1, 4, 8, 6]"),
    "initial_state dtype": (lambda a: a.update(initial_state=torch.zeros(1, 4, 8, 6, dtype=torch.int32)),
                            "initial_state must be a floating-point tensor, got Int"),
    "cu_seqlens with B != 1": (lambda a: a.update(**{k_: torch.cat([a[k_], a[k_]]) for k_ in "q k v g beta".split()},
                                                  cu_seqlens=torch.tensor([0, 4, 9])),
                               "cu_seqlens requires a packed batch with B = 1, got B = 2"),
    "cu_seqlens start": (lambda a: a.update(cu_seqlens=torch.tensor([1, 4, 9])), "cu_seqlens must start at 0"),
    "cu_seqlens decreasing": (lambda a: a.update(cu_seqlens=torch.tensor([0, 6, 4, 9])),
                              "cu_seqlens must be non-decreasing"),
    "cu_seqlens end": (lambda a: a.update(cu_seqlens=torch.tensor([0, 4, 8])), "cu_seqlens must end at T = 9"),
    "cu_seqlens beyond T": (lambda a: a.update(cu_seqlens=torch.tensor([0, 40, 9])),
                            "cu_seqlens must be non-decreasing"),
    "cu_seqlens dtype": (lambda a: a.update(cu_seqlens=torch.tensor([0.0, 9.0])), "cu_seqlens must be int32 or int64"),
    "cu_seqlens rank": (lambda a: a.update(cu_seqlens=torch.tensor([[0, 9]])), "cu_seqlens must be a 1-D tensor"),
    "algorithm": (lambda a: a.update(algorithm="fast"), "algorithm must be one of"),
    "chunk_size": (lambda a: a.update(chunk_size=0), "chunk_size must be an integer >= 1, got 0"),
    "gate without A_log": (lambda a: a.update(use_gate_in_kernel=True, dt_bias=torch.zeros(4, dtype=torch.float64)),
                           "use_gate_in_kernel=True requires A_log"),
    "A_log shape": (lambda a: a.update(use_gate_in_kernel=True, A_log=torch.zeros(3, dtype=torch.float64),
                                       dt_bias=torch.zeros(4, dtype=torch.float64)), "A_log must have shape [HV] = [4]"),
    "A_log without gate": (lambda a: a.update(A_log=torch.zeros(4, dtype=torch.float64)),
                           "A_log is only used with use_gate_in_kernel=True"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_names_the_argument(case):
    q, k, v, g, beta = make_inputs()
    args = dict(q=q, k=k, v=v, g=g, beta=beta)
    mutate, message = BAD_CASES[case]
    mutate(args)
    with pytest.raises((RuntimeError, ValueError, TypeError)) as info:
        gated_delta_rule(**args)
    assert message in str(info.value), str(info.value)


def test_bad_input_in_the_raw_op():
    q, k, v, g, beta = make_inputs()
    with pytest.raises(RuntimeError, match="chunk_size must be >= 1, got -3"):
        torch.ops.gated_delta.fwd(q, k, v, g, beta, 1.0, None, False, None, None, False, False, False, False,
                                  None, None, "chunk", -3)
    with pytest.raises(RuntimeError, match="algorithm must be one of 'auto', 'recurrent', 'chunk', 'scan', got 'x'"):
        torch.ops.gated_delta.fwd(q, k, v, g, beta, 1.0, None, False, None, None, False, False, False, False,
                                  None, None, "x", 64)


# ---------------------------------------------------------------- API behaviour

def test_final_state_only_when_asked():
    q, k, v, g, beta = make_inputs()
    o, ht = gated_delta_rule(q, k, v, g, beta)
    assert ht is None and o.shape == v.shape and o.dtype == v.dtype
    o, ht = gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    assert ht.shape == (1, 4, 8, 6) and ht.dtype == torch.float64


@pytest.mark.parametrize("algorithm", ["recurrent", "chunk", "scan", "auto"])
def test_empty_sequence(algorithm):
    q, k, v, g, beta = make_inputs(T=0)
    h0 = torch.randn(1, 4, 8, 6, dtype=torch.float64)
    o, ht = gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, algorithm=algorithm)
    assert o.shape == (1, 0, 4, 6)
    assert torch.equal(ht, h0)
    o, ht = gated_delta_rule(q, k, v, g, beta, output_final_state=True, algorithm=algorithm)
    assert torch.equal(ht, torch.zeros_like(h0))


def test_empty_sequence_gradient_reaches_initial_state():
    q, k, v, g, beta = make_inputs(T=0)
    h0 = torch.randn(1, 4, 8, 6, dtype=torch.float64, requires_grad=True)
    _, ht = gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    w = torch.randn_like(ht)
    (grad,) = torch.autograd.grad((ht * w).sum(), h0)
    assert torch.equal(grad, w)


def test_calls_without_a_graph_match_recorded_ones():
    """A call that records no graph (no_grad, or no input requiring grad) skips the autograd Function: same
    outputs, bitwise, as a recorded call, no grad_fn; a recorded call still differentiates."""
    q, k, v, g, beta = make_inputs(T=13)
    h0 = torch.randn(1, 4, 8, 6, dtype=torch.float64)
    o0, h_0 = gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o0.grad_fn is None and h_0.grad_fn is None
    qr = q.clone().requires_grad_()
    with torch.no_grad():
        o1, h_1 = gated_delta_rule(qr, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o1.grad_fn is None and not o1.requires_grad
    o2, h_2 = gated_delta_rule(qr, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o2.grad_fn is not None
    for a, b in ((o0, o2), (o1, o2), (h_0, h_2), (h_1, h_2)):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
    (dq,) = torch.autograd.grad(o2.sum(), qr)
    assert dq.shape == q.shape
    # the layer ops: short convolution and gated RMSNorm
    x = torch.randn(2, 7, 5, dtype=torch.float64)
    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    y_rec, _ = torch.ops.gated_delta.short_conv_fwd(x, w, None, None, None, False, True)
    with torch.no_grad():
        y_plain, _ = torch.ops.gated_delta.short_conv_fwd(x, w, None, None, None, False, True)
    assert y_rec.grad_fn is not None and y_plain.grad_fn is None
    torch.testing.assert_close(y_plain, y_rec.detach(), rtol=0, atol=0)
    z = torch.randn(3, 8, dtype=torch.float64)
    nw = torch.randn(8, dtype=torch.float64, requires_grad=True)
    n_rec, _ = torch.ops.gated_delta.gated_rmsnorm_fwd(z, None, nw, 1e-6)
    n_plain, _ = torch.ops.gated_delta.gated_rmsnorm_fwd(z, None, nw.detach(), 1e-6)
    assert n_rec.grad_fn is not None and n_plain.grad_fn is None
    torch.testing.assert_close(n_plain, n_rec.detach(), rtol=0, atol=0)


def test_forward_mode_tangents_are_refused():
    """A forward-mode tangent on an input reaches the autograd Function (which has no forward-mode formula) even
    under no_grad, and fails there rather than being dropped."""
    import torch.autograd.forward_ad as fwAD
    q, k, v, g, beta = make_inputs(T=5)
    with fwAD.dual_level():
        qd = fwAD.make_dual(q, torch.randn_like(q))
        for grad_mode in (True, False):
            with torch.set_grad_enabled(grad_mode), pytest.raises(RuntimeError, match="jvp is not implemented"):
                gated_delta_rule(qd, k, v, g, beta)


def test_flash_linear_attention_names():
    q, k, v, g, beta = make_inputs(T=20)
    o_ref, h_ref = gated_delta_rule_ref(q, k, v, g, beta, output_final_state=True)
    o, h = gated_delta.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    assert rel(o, o_ref) < 1e-10 and rel(h, h_ref) < 1e-10
    o, h = gated_delta.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, output_final_state=True)  # FLA order
    assert rel(o, o_ref) < 1e-10 and rel(h, h_ref) < 1e-10
    o, _ = gated_delta.fused_recurrent_gated_delta_rule(q, k, v)
    o_ref, _ = gated_delta_rule_ref(q, k, v, torch.zeros_like(g), torch.ones_like(beta))
    assert rel(o, o_ref) < 1e-10


def test_default_scale_is_inverse_sqrt_k():
    q, k, v, g, beta = make_inputs(T=5)
    o1, _ = gated_delta_rule(q, k, v, g, beta)
    o2, _ = gated_delta_rule(q, k, v, g, beta, scale=8 ** -0.5)
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)


def test_nan_propagates():
    q, k, v, g, beta = make_inputs(T=30)
    v = v.clone()
    v[0, 3, 1, 2] = float("nan")
    for algorithm in ("recurrent", "chunk", "scan"):
        o, _ = gated_delta_rule(q, k, v, g, beta, algorithm=algorithm, chunk_size=8)
        assert torch.isnan(o[0, 3:, 1]).any()
        assert not torch.isnan(o[0, :, 0]).any()


# ---------------------------------------------------------------- opcheck and torch.compile

def _op_args(requires_grad, options):
    q, k, v, g, beta = make_inputs(T=11, requires_grad=requires_grad)
    h0 = torch.randn(1, 4, 8, 6, dtype=torch.float64, requires_grad=requires_grad)
    l2, sig, neg, gate = options
    A_log = torch.randn(4, dtype=torch.float64, requires_grad=requires_grad) if gate else None
    dt_bias = torch.randn(4, dtype=torch.float64, requires_grad=requires_grad) if gate else None
    return (q, k, v, g, beta, 0.3, h0, True, None, None, l2, sig, neg, gate, A_log, dt_bias, "chunk", 4)


@pytest.mark.parametrize("options", [(False, False, False, False), (True, True, True, True)])
def test_opcheck_fwd(options):
    torch.library.opcheck(torch.ops.gated_delta.fwd.default, _op_args(True, options))
    torch.library.opcheck(torch.ops.gated_delta.fwd.default, _op_args(False, options))


@pytest.mark.parametrize("options", [(False, False, False, False), (True, True, True, True)])
def test_opcheck_fwd_with_residual(options):
    """The forward that autograd calls: fwd's outputs, bitwise, and the residual (none on the CPU); bwd takes an
    empty residual and refuses one with bytes, which only a CUDA forward keeps."""
    args = _op_args(False, options)
    torch.library.opcheck(torch.ops.gated_delta.fwd_with_residual.default, _op_args(True, options))
    torch.library.opcheck(torch.ops.gated_delta.fwd_with_residual.default, args)
    o, ht, res = torch.ops.gated_delta.fwd_with_residual(*args)
    o2, ht2 = torch.ops.gated_delta.fwd(*args)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)
    assert res.dtype == torch.uint8 and res.shape == (0,)
    bwd_args = (torch.randn_like(o), None) + args[:7] + args[8:]
    g1 = torch.ops.gated_delta.bwd(*bwd_args, residual=res)
    g2 = torch.ops.gated_delta.bwd(*bwd_args)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="residual: the CPU backend keeps none"):
        torch.ops.gated_delta.bwd(*bwd_args, residual=torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="residual must be the contiguous 1-D uint8 tensor"):
        torch.ops.gated_delta.bwd(*bwd_args, residual=torch.zeros(4, 4, dtype=torch.uint8))


@pytest.mark.parametrize("env", [None, "1", "0"])
def test_backward_residual_switch(monkeypatch, env):
    """A forward that records a graph calls fwd_with_residual, and fwd where GATED_DELTA_BACKWARD_RESIDUAL=0 (read
    per call); the gradients are the same either way on the CPU, which keeps no residual."""
    if env is None:
        monkeypatch.delenv("GATED_DELTA_BACKWARD_RESIDUAL", raising=False)
    else:
        monkeypatch.setenv("GATED_DELTA_BACKWARD_RESIDUAL", env)
    xs = make_inputs(T=9, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        o, _ = gated_delta_rule(*xs, scale=0.3, algorithm="chunk", chunk_size=4)
    names = [e.name for e in prof.events()]
    assert ("gated_delta::fwd_with_residual" in names) == (env != "0"), names
    d_o = torch.randn_like(o)
    grads = torch.autograd.grad(o, xs, d_o)
    with torch.no_grad():
        o2 = gated_delta_rule(*xs, scale=0.3, algorithm="chunk", chunk_size=4)[0]
        ref = torch.ops.gated_delta.bwd(d_o, None, *xs, 0.3, None, None, None, False, False, False, False, None,
                                        None, "chunk", 4)
    assert torch.equal(o.detach(), o2)
    for a, b in zip(grads, ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("env", [None, "0"])
def test_backward_reuses_forward_normalised_qk(monkeypatch, env):
    """With use_qk_l2norm_in_kernel a forward that records a graph normalises q and k once and keeps them for the
    backward (bwd's q_normed, k_normed), which then normalises nothing; with GATED_DELTA_BACKWARD_RESIDUAL=0 it
    keeps neither and the backward normalises again. Outputs and gradients are bitwise those of the ops without
    them."""
    if env is None:
        monkeypatch.delenv("GATED_DELTA_BACKWARD_RESIDUAL", raising=False)
    else:
        monkeypatch.setenv("GATED_DELTA_BACKWARD_RESIDUAL", env)
    xs = make_inputs(T=9, requires_grad=True)
    kw = dict(scale=0.3, algorithm="chunk", chunk_size=4, use_qk_l2norm_in_kernel=True)

    def l2norm_calls(prof):
        return sum(e.name == "gated_delta::l2norm_fwd" for e in prof.events())

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        o, _ = gated_delta_rule(*xs, **kw)
    assert l2norm_calls(prof) == 2
    d_o = torch.randn_like(o)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        grads = torch.autograd.grad(o, xs, d_o)
    assert l2norm_calls(prof) == (2 if env == "0" else 0)
    with torch.no_grad():
        o2 = gated_delta_rule(*xs, **kw)[0]
        ref = torch.ops.gated_delta.bwd(d_o, None, *xs, 0.3, None, None, None, True, False, False, False, None,
                                        None, "chunk", 4)
    assert torch.equal(o.detach(), o2)
    for a, b in zip(grads, ref):
        assert torch.equal(a, b)


def _normed_bwd_args(q, k, v, g, beta):
    d_o = torch.randn_like(v)
    return (d_o, None, q, k, v, g, beta, 0.3, None, None, None, True, False, False, False, None, None, "chunk", 4)


@pytest.mark.parametrize("dtypes", [(torch.float64, torch.float64), (torch.float32, torch.bfloat16)])
def test_bwd_q_normed_k_normed(dtypes):
    """bwd given l2norm_fwd's q and k (in the compute dtype, q's and v's promoted) returns bitwise what it returns
    normalising them itself; opcheck covers the arguments."""
    qk_dtype, v_dtype = dtypes
    q, k, v, g, beta = make_inputs(T=11)
    q, k, v = q.to(qk_dtype), k.to(qk_dtype), v.to(v_dtype)
    args = _normed_bwd_args(q, k, v, g, beta)
    xd = torch.promote_types(qk_dtype, v_dtype)
    qn = torch.ops.gated_delta.l2norm_fwd(q, 1e-6, xd)
    kn = torch.ops.gated_delta.l2norm_fwd(k, 1e-6, xd)
    g1 = torch.ops.gated_delta.bwd(*args, q_normed=qn, k_normed=kn)
    g2 = torch.ops.gated_delta.bwd(*args)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    torch.library.opcheck(torch.ops.gated_delta.bwd.default, args, {"q_normed": qn, "k_normed": kn})


def test_bwd_q_normed_k_normed_errors():
    q, k, v, g, beta = make_inputs(T=11)
    args = _normed_bwd_args(q, k, v, g, beta)
    qn = torch.ops.gated_delta.l2norm_fwd(q, 1e-6)
    kn = torch.ops.gated_delta.l2norm_fwd(k, 1e-6)
    bwd = torch.ops.gated_delta.bwd
    with pytest.raises(RuntimeError, match="q_normed and k_normed must be given together .*got q_normed only"):
        bwd(*args, q_normed=qn)
    with pytest.raises(RuntimeError, match="got k_normed only"):
        bwd(*args, k_normed=kn)
    no_option = args[:11] + (False,) + args[12:]
    with pytest.raises(RuntimeError, match="given only with use_qk_l2norm_in_kernel=True"):
        bwd(*no_option, q_normed=qn, k_normed=kn)
    with pytest.raises(RuntimeError, match=r"q_normed must have the shape of q \[1, 11, 2, 8\] and the compute "
                                           r"dtype Double, got Float of shape \[1, 11, 2, 8\]"):
        bwd(*args, q_normed=qn.float(), k_normed=kn)
    with pytest.raises(RuntimeError, match=r"k_normed must have the shape of k .*got Double of shape \[1, 10, 2, 8\]"):
        bwd(*args, q_normed=qn, k_normed=kn[:, :10])
    with pytest.raises(RuntimeError, match="k_normed must be on the same device as q"):
        bwd(*args, q_normed=qn, k_normed=kn.to("meta"))


def test_opcheck_fwd_varlen():
    q, k, v, g, beta = make_inputs(T=11)
    cu = torch.tensor([0, 3, 3, 11])
    args = (q, k, v, g, beta, 0.3, None, True, cu, None, False, False, False, False, None, None, "scan", 4)
    torch.library.opcheck(torch.ops.gated_delta.fwd.default, args)


@pytest.mark.parametrize("options", [(False, False, False, False), (True, True, False, True)])
def test_opcheck_bwd(options):
    args = _op_args(False, options)
    d_o = torch.randn_like(args[2])
    d_ht = torch.randn(1, 4, 8, 6, dtype=torch.float64)
    bwd_args = (d_o, d_ht) + args[:7] + args[8:]  # without output_final_state
    torch.library.opcheck(torch.ops.gated_delta.bwd.default, bwd_args)


def test_torch_compile_fullgraph_forward_and_backward():
    torch._dynamo.reset()

    def layer(q, k, v, g, beta, h0):
        o, ht = gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True, chunk_size=4)
        return (o * o).sum() + ht.sum()

    xs = make_inputs(T=13, requires_grad=True) + [torch.randn(1, 4, 8, 6, dtype=torch.float64, requires_grad=True)]
    compiled = torch.compile(layer, fullgraph=True)
    loss_c = compiled(*xs)
    grads_c = torch.autograd.grad(loss_c, xs)
    loss_e = layer(*xs)
    grads_e = torch.autograd.grad(loss_e, xs)
    torch.testing.assert_close(loss_c, loss_e)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b)
