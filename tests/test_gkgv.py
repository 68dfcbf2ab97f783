"""Per-key / per-value log decays (gk [B, T, HV, K], gv [B, T, HV, V]) of the recurrent algorithm: forward and
every gradient (dgk and dgv included) against autograd through the float64 token loop (gated_delta.reference), on
the CPU and, marked `gpu`, on CUDA.

Errors are relative L2 norms against the reference run in float64 on the same inputs rounded to the tested dtype.
Tolerances per dtype:
  float64 (CPU): 1e-10;
  float32: 1e-5 on the CPU, 1e-4 on CUDA (fast-math exp);
  bf16 / fp16: results in the input dtype (o, dq, dk, dv, dbeta) carry its final rounding: 1e-2 / 2e-3;
  results kept in float32 (final state, d initial_state, dg, dgk, dgv for float32 decays): 1e-5 (CPU), 1e-4 (CUDA).
Observed on the CPU (T=40, K=16, V=24): fp32 <= 1.5e-7 everywhere; bf16 1.7e-3 rounded / 1.7e-7 fp32; fp16 2.4e-4
rounded / 1.4e-7 fp32.
"""
import zlib

import pytest
import torch
import torch.nn.functional as F

import gated_delta
from helpers import make_inputs, rel, single_thread

TOL = {
    torch.float64: {"rounded": 1e-10, "fp32": 1e-10},
    torch.float32: {"rounded": 1e-5, "fp32": 1e-5},
    torch.bfloat16: {"rounded": 1e-2, "fp32": 1e-5},
    torch.float16: {"rounded": 2e-3, "fp32": 1e-5},
}
CUDA_FP32_TOL = 1e-4
NAMES = ("q", "k", "v", "g", "beta", "initial_state", "gk", "gv")
# gradients returned in the dtype of their input (q, k, v, beta: the input dtype); the rest stay float32
ROUNDED = ("o", "q", "k", "v", "beta")
GATES = {"gk": ("gk",), "gv": ("gv",), "gkgv": ("gk", "gv")}


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def gated_inputs(gen, gates, T=17, dtype=torch.float64, device="cpu", **kw):
    """make_inputs plus gk / gv: log decays in [-0.4, 0], some exactly 0, one a full reset (-1e4) when T > 8."""
    inputs = make_inputs(gen, T, dtype=dtype, **kw)
    B, T, HV, V = inputs["v"].shape
    K = inputs["q"].shape[-1]
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for name, D in (("gk", K), ("gv", V)):
        if name in gates:
            x = F.logsigmoid(torch.randn(B, T, HV, D, generator=gen, dtype=torch.float64) + 3.0)
            x.view(-1)[torch.randperm(x.numel(), generator=gen)[: max(1, x.numel() // 10)]] = 0.0
            if T > 8:
                x[0, T // 2, 0, 0] = -1e4
            inputs[name] = x.to(state_dtype)
    return {key: (val.to(device) if isinstance(val, torch.Tensor) else val) for key, val in inputs.items()}


def to_ref(inputs):
    """The reference's view: every float tensor upcast to float64, on the CPU."""
    return {key: (val.detach().cpu().double() if isinstance(val, torch.Tensor) and val.is_floating_point()
                  else val.cpu() if isinstance(val, torch.Tensor) else val)
            for key, val in inputs.items() if key != "cu_seqlens_cpu"}


def forward_backward(fn, inputs, d_o, d_ht):
    """o, final_state and {name: gradient} of <o, d_o> + <final_state, d_ht> through fn(inputs)."""
    inputs = dict(inputs)
    names = [n for n in NAMES if isinstance(inputs.get(n), torch.Tensor)]
    for n in names:
        inputs[n] = inputs[n].detach().clone().requires_grad_(True)
    o, ht = fn(inputs)
    loss = (o.double() * d_o.to(o.device)).sum() + (ht.double() * d_ht.to(ht.device)).sum()
    grads = torch.autograd.grad(loss, [inputs[n] for n in names])
    return o.detach(), ht.detach(), dict(zip(names, grads))


def ours(inputs, algorithm="recurrent"):
    return gated_delta.gated_delta_rule(**inputs, output_final_state=True, algorithm=algorithm)


def reference(inputs):
    with single_thread():
        return gated_delta.gated_delta_rule_ref(**inputs, output_final_state=True)


def check_against_reference(inputs, dtype, fp32_tol=None, algorithm="recurrent"):
    gen = _gen("cotangents", tuple(inputs["v"].shape))
    o_shape, N = inputs["v"].shape, (len(inputs["cu_seqlens"]) - 1 if "cu_seqlens" in inputs else inputs["v"].shape[0])
    HV, K, V = inputs["v"].shape[2], inputs["q"].shape[3], inputs["v"].shape[3]
    # (rounded to the output's dtype: autograd hands the backward d_o in that dtype)
    d_o = torch.randn(*o_shape, generator=gen, dtype=torch.float64).to(inputs["v"].dtype).double()
    d_ht = torch.randn(N, HV, K, V, generator=gen, dtype=torch.float64)
    o, ht, grads = forward_backward(lambda x: ours(x, algorithm), inputs, d_o, d_ht)
    o_r, ht_r, grads_r = forward_backward(reference, to_ref(inputs), d_o, d_ht)
    tol = dict(TOL[dtype])
    if fp32_tol is not None and dtype != torch.float64:
        tol = {kind: max(val, fp32_tol) for kind, val in tol.items()}
    results = {"o": (o, o_r), "final_state": (ht, ht_r)}
    results.update({name: (grads[name], grads_r[name]) for name in grads})
    assert set(grads) >= {"gk"} & set(inputs) and set(grads) >= {"gv"} & set(inputs)
    for name, (a, b) in results.items():
        assert a.shape == b.shape, name
        assert torch.isfinite(a).all(), name
        limit = tol["rounded" if name in ROUNDED else "fp32"]
        assert rel(a.cpu(), b) < limit, (name, rel(a.cpu(), b), limit)


# ---------------------------------------------------------------------------------------------------- CPU

@pytest.mark.parametrize("gates", list(GATES))
@pytest.mark.parametrize("T", [1, 63, 65])
def test_cpu_float64_every_gradient(gates, T):
    inputs = gated_inputs(_gen("cpu64", gates, T), GATES[gates], T=T, B=2, K=8, V=6)
    check_against_reference(inputs, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_cpu_low_precision(dtype):
    inputs = gated_inputs(_gen("cpulow", dtype), GATES["gkgv"], T=40, dtype=dtype, B=2, K=16, V=24)
    check_against_reference(inputs, dtype)


def test_cpu_varlen_with_empty_sequence_and_gqa():
    inputs = gated_inputs(_gen("cpuvarlen"), GATES["gkgv"], lengths=[5, 0, 33, 1], H=1, HV=3, K=8, V=6)
    check_against_reference(inputs, torch.float64)


def test_cpu_without_initial_state_and_with_auto():
    inputs = gated_inputs(_gen("cpunoh0"), GATES["gk"], T=20, initial_state=False, K=8, V=6)
    check_against_reference(inputs, torch.float64, algorithm="auto")


def test_gradcheck_float64():
    gen = _gen("gradcheck")
    inputs = gated_inputs(gen, GATES["gkgv"], T=5, H=1, HV=2, K=3, V=4)
    names = [n for n in NAMES if n in inputs]

    def fn(*xs):
        kw = dict(inputs)
        kw.update(zip(names, xs))
        o, ht = gated_delta.gated_delta_rule(**kw, output_final_state=True, algorithm="recurrent")
        return o, ht

    xs = [inputs[n].detach().clone().requires_grad_(True) for n in names]
    assert torch.autograd.gradcheck(fn, xs, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_fused_recurrent_keyword_order_of_fla():
    # flash-linear-attention's order: q, k, v, g, gk, gv, beta, scale, initial_state, output_final_state, ...
    inputs = gated_inputs(_gen("order"), GATES["gkgv"], T=9, K=8, V=6)
    i = inputs
    o, ht = gated_delta.fused_recurrent_gated_delta_rule(i["q"], i["k"], i["v"], i["g"], i["gk"], i["gv"], i["beta"],
                                                         None, i["initial_state"], True)
    o_r, ht_r = reference(to_ref(inputs))
    assert rel(o, o_r) < 1e-12 and rel(ht, ht_r) < 1e-12
    # g and beta may be left out (no scalar decay, beta = 1), as in flash-linear-attention
    o, _ = gated_delta.fused_recurrent_gated_delta_rule(i["q"], i["k"], i["v"], gv=i["gv"])
    ref_in = dict(to_ref(inputs), g=torch.zeros_like(i["g"]), beta=torch.ones_like(i["beta"]), initial_state=None)
    del ref_in["gk"]
    assert rel(o, reference(ref_in)[0]) < 1e-12


def test_gk_gv_differ_from_no_gates():
    # the decays are applied: without them the result differs (a test that could not fail otherwise)
    inputs = gated_inputs(_gen("differ"), GATES["gkgv"], T=12, K=8, V=6)
    o, _ = ours(inputs)
    plain = {k: v for k, v in inputs.items() if k not in ("gk", "gv")}
    o_plain, _ = ours(plain)
    assert rel(o, o_plain) > 1e-3


def test_errors():
    inputs = gated_inputs(_gen("errors"), GATES["gkgv"], T=6, K=8, V=6)
    for algorithm in ("chunk", "scan"):
        with pytest.raises(RuntimeError, match=rf"gk and gv .*'recurrent'.*got algorithm '{algorithm}'"):
            ours(inputs, algorithm)
    only_gk = {k: v for k, v in inputs.items() if k != "gv"}
    with pytest.raises(RuntimeError, match=r"gk \(per-key / per-value decays\) are supported by algorithm "):
        ours(only_gk, "chunk")
    bad = dict(inputs, gk=inputs["gk"][..., :-1])
    with pytest.raises(RuntimeError, match=r"gk must have shape \[B, T, HV, K\] = \[1, 6, 4, 8\], got \[1, 6, 4, 7\]"):
        ours(bad)
    bad = dict(inputs, gv=inputs["gv"].transpose(2, 3))
    with pytest.raises(RuntimeError, match=r"gv must have shape \[B, T, HV, V\]"):
        ours(bad)
    bad = dict(inputs, gk=inputs["gk"].to(torch.int32))
    with pytest.raises(RuntimeError, match=r"gk must be a floating-point tensor, got Int"):
        ours(bad)
    bad = dict(inputs, gv=inputs["gv"].to("meta"))
    with pytest.raises(RuntimeError, match=r"gv must be on the same device as q"):
        ours(bad)


def test_opcheck_with_gates():
    inputs = gated_inputs(_gen("opcheck"), GATES["gkgv"], T=7, K=8, V=6)
    i = {k: (v.detach().requires_grad_(True) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
         for k, v in inputs.items()}
    args = (i["q"], i["k"], i["v"], i["g"], i["beta"], 0.3, i["initial_state"], True, None, None, False, False,
            False, False, None, None, "recurrent", 64)
    torch.library.opcheck(torch.ops.gated_delta.fwd.default, args, {"gk": i["gk"], "gv": i["gv"]})
    d_o = torch.randn_like(inputs["v"])
    d_ht = torch.randn_like(inputs["initial_state"])
    plain = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    bwd_args = (d_o, d_ht) + plain[:7] + plain[8:]
    torch.library.opcheck(torch.ops.gated_delta.bwd.default, bwd_args,
                          {"gk": inputs["gk"], "gv": inputs["gv"]})


# ---------------------------------------------------------------------------------------------------- CUDA

cuda = pytest.mark.gpu


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("gates", list(GATES))
@pytest.mark.parametrize("T", [1, 63, 65, 130])
def test_cuda_against_reference(dtype, gates, T):
    inputs = gated_inputs(_gen("cuda", dtype, gates, T), GATES[gates], T=T, dtype=dtype, device="cuda", B=2, K=64,
                          V=64)
    check_against_reference(inputs, dtype, fp32_tol=CUDA_FP32_TOL)


@cuda
@pytest.mark.parametrize("K,V", [(16, 24), (100, 40), (128, 128), (256, 256), (32, 200), (64, 300), (32, 512)])
def test_cuda_head_dims(K, V):
    inputs = gated_inputs(_gen("cudadims", K, V), GATES["gkgv"], T=70, dtype=torch.float32, device="cuda", K=K, V=V)
    check_against_reference(inputs, torch.float32, fp32_tol=CUDA_FP32_TOL)


@cuda
@pytest.mark.parametrize("with_host_copy", [False, True])
def test_cuda_varlen_with_empty_sequence_and_gqa(with_host_copy):
    inputs = gated_inputs(_gen("cudavarlen"), GATES["gkgv"], lengths=[5, 0, 130, 1, 64], H=2, HV=6, K=32, V=48,
                          dtype=torch.bfloat16, device="cuda")
    if with_host_copy:
        inputs["cu_seqlens_cpu"] = inputs["cu_seqlens"].cpu()
    check_against_reference(inputs, torch.bfloat16, fp32_tol=CUDA_FP32_TOL)


@cuda
def test_cuda_without_initial_state_gv_only():
    inputs = gated_inputs(_gen("cudanoh0"), GATES["gv"], T=90, initial_state=False, dtype=torch.float32,
                          device="cuda", K=64, V=64)
    check_against_reference(inputs, torch.float32, fp32_tol=CUDA_FP32_TOL, algorithm="auto")


@cuda
def test_cuda_deterministic():
    inputs = gated_inputs(_gen("cudadet"), GATES["gkgv"], T=150, B=2, H=1, HV=4, K=128, V=96,
                          dtype=torch.bfloat16, device="cuda")
    d_o = torch.randn(inputs["v"].shape, dtype=torch.float64)
    d_ht = torch.randn(2, 4, 128, 96, dtype=torch.float64)
    first = forward_backward(ours, inputs, d_o, d_ht)
    second = forward_backward(ours, inputs, d_o, d_ht)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for name in first[2]:
        assert torch.equal(first[2][name], second[2][name]), name


@cuda
def test_cuda_matches_cpu_fp32():
    inputs = gated_inputs(_gen("cudacpu"), GATES["gkgv"], T=33, dtype=torch.float32, K=16, V=24)
    o_c, ht_c = ours(inputs)
    o_g, ht_g = ours({k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()})
    assert o_g.is_cuda and rel(o_g.cpu(), o_c) < 1e-5 and rel(ht_g.cpu(), ht_c) < 1e-5


@cuda
def test_cuda_errors():
    inputs = gated_inputs(_gen("cudaerr"), GATES["gk"], T=4, dtype=torch.float32, device="cuda", K=300, V=8)
    with pytest.raises(RuntimeError, match=r"with gk / gv the head dim K must be at most 256 \(V any\), got K = 300"):
        ours(inputs)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_state_v_first_with_gates(device):
    """With gk / gv, state_v_first=True takes and returns the states transposed ([N, HV, V, K]): the same results
    as the [K, V] layout, and the initial state's gradient comes back in the caller's layout."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    inputs = gated_inputs(_gen("v-first", device), ("gk", "gv"), T=37, dtype=dtype, device=device, K=24, V=40)
    d_o = torch.randn(inputs["v"].shape, dtype=dtype, device=device)
    d_ht = torch.randn(inputs["initial_state"].shape, dtype=inputs["initial_state"].dtype, device=device)

    def run(x, v_first):
        h0 = x["initial_state"].transpose(-1, -2).contiguous() if v_first else x["initial_state"]
        h0 = h0.detach().requires_grad_(True)
        leaves = {n: x[n].detach().requires_grad_(True) for n in ("q", "k", "v", "gk", "gv")}
        o, ht = gated_delta.fused_recurrent_gated_delta_rule(
            leaves["q"], leaves["k"], leaves["v"], x["g"], gk=leaves["gk"], gv=leaves["gv"], beta=x["beta"],
            initial_state=h0, output_final_state=True, state_v_first=v_first)
        ht_k = ht.transpose(-1, -2) if v_first else ht
        ((o * d_o).sum() + (ht_k * d_ht).sum()).backward()
        dh0 = h0.grad.transpose(-1, -2) if v_first else h0.grad
        return [o, ht_k, dh0] + [leaves[n].grad for n in ("q", "k", "v", "gk", "gv")]

    tol = 1e-12 if dtype == torch.float64 else 1e-6
    for a, b in zip(run(inputs, True), run(inputs, False)):
        assert rel(a, b) < tol
