"""The CPU algorithms (recurrent, chunk, scan), forward and backward, against the float64 reference loop.

Errors are relative L2 norms against `gated_delta_rule_ref` run in float64 on the SAME inputs (for bf16/fp16/fp32
the inputs are rounded to that dtype first and the reference sees them upcast, so the error measured is the
kernel's own accumulation and output rounding). Tolerances below are about 3x the worst error observed.
"""
import contextlib
import os
import subprocess
import sys
import zlib

import pytest
import torch

import gated_delta
from helpers import (OPTION_SETS, cotangents, diff_inputs, grads_of, make_inputs, ref_grads, rel, run_ours, run_ref,
                     single_thread, upcast)

ALGORITHMS = ("recurrent", "chunk", "scan")

# float64: every algorithm agrees with the reference to this relative L2 error (observed ~1e-13 with beta <= 2).
FP64_TOL = 1e-10

# Lower precision: relative L2 error against the float64 reference on the same rounded inputs, for
#   "rounded": results returned in the input dtype (o, dq, dk, dv, dbeta): dominated by the final rounding,
#   "fp32":    results returned in float32 (final state, d initial_state, dg for a float32 g): accumulation only.
# Observed worst cases (4 seeds, 3 algorithms, T=243 varlen, K=V=32): fp32 2.1e-7; bf16 1.7e-3 / 2.1e-7;
# fp16 2.2e-4 / 2.1e-7. The tolerances are about 3x those.
LOW_PRECISION_TOL = {
    torch.float32: {"rounded": 1e-6, "fp32": 1e-6},
    torch.bfloat16: {"rounded": 5e-3, "fp32": 1e-6},
    torch.float16: {"rounded": 7e-4, "fp32": 1e-6},
}


def _gen(*key) -> torch.Generator:
    # a fixed seed per test case (reproducible), different across cases
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _check_close(ours, ref, tol, what):
    err = rel(ours, ref)
    assert err < tol, f"{what}: relative L2 error {err:.3e} >= {tol:.1e}"


def _check_algorithms_fp64(inputs, d_o, d_ht, ref, chunk_size):
    """Every algorithm's output, final state and gradients against the float64 reference's (ref_grads)."""
    ro, rh, rg = ref
    for algo in ALGORITHMS:
        o, ht, gg = grads_of(lambda kw: run_ours(kw, algo, chunk_size), inputs, d_o, d_ht)
        _check_close(o, ro, FP64_TOL, f"{algo} o")
        _check_close(ht, rh, FP64_TOL, f"{algo} final_state")
        for name in rg:
            _check_close(gg[name], rg[name], FP64_TOL, f"{algo} d{name}")


# ---------------------------------------------------------------------------------------------------------------
# float64 forward


@pytest.mark.parametrize("chunk_size", [1, 16, 64])
@pytest.mark.parametrize("T", [1, 2, 63, 64, 65, 200])
def test_forward_fp64(T, chunk_size):
    gen = _gen("fwd", T, chunk_size)
    for initial_state in (True, False):
        inputs = make_inputs(gen, T, B=2, H=2, HV=4, K=16, V=24, initial_state=initial_state, beta_max=2.0)
        ro, rh = run_ref(inputs)
        for algo in ALGORITHMS:
            o, ht = run_ours(inputs, algo, chunk_size)
            assert o.dtype == torch.float64 and o.shape == ro.shape and o.is_contiguous()
            _check_close(o, ro, FP64_TOL, f"{algo} o")
            _check_close(ht, rh, FP64_TOL, f"{algo} final_state")
            o2, none = run_ours(inputs, algo, chunk_size, output_final_state=False)
            assert none is None
            assert torch.equal(o2, o)


@pytest.mark.parametrize("initial_state", [True, False])
@pytest.mark.parametrize("chunk_size", [1, 16, 64])
def test_varlen_fp64(chunk_size, initial_state):
    gen = _gen("varlen", chunk_size, initial_state)
    lengths = [37, 0, 1, 130, 64, 0, 5]
    perm = torch.randperm(len(lengths), generator=gen).tolist()
    lengths = [lengths[i] for i in perm]
    inputs = make_inputs(gen, 0, lengths=lengths, initial_state=initial_state, beta_max=2.0)
    ro, rh = run_ref(inputs)
    for algo in ALGORITHMS:
        o, ht = run_ours(inputs, algo, chunk_size)
        _check_close(o, ro, FP64_TOL, f"{algo} o")
        _check_close(ht, rh, FP64_TOL, f"{algo} final_state")
        # a sequence of length 0 keeps its initial state
        for n, length in enumerate(lengths):
            if length == 0:
                expect = inputs["initial_state"][n] if initial_state else torch.zeros_like(ht[n])
                assert torch.equal(ht[n], expect)


@pytest.mark.parametrize("options", list(OPTION_SETS))
def test_options_fp64(options):
    gen = _gen("options", options)
    inputs = make_inputs(gen, 0, lengths=[70, 1, 0, 45], options=OPTION_SETS[options], beta_max=2.0)
    inputs["scale"] = 0.37  # not the default K ** -0.5
    ro, rh = run_ref(inputs)
    for algo in ALGORITHMS:
        for chunk_size in (16, 64):
            o, ht = run_ours(inputs, algo, chunk_size)
            _check_close(o, ro, FP64_TOL, f"{algo}/{chunk_size} o")
            _check_close(ht, rh, FP64_TOL, f"{algo}/{chunk_size} final_state")


@pytest.mark.parametrize("K,V", [(1, 1), (3, 1), (1, 5), (7, 3)])
def test_tiny_head_dims_fp64(K, V):
    gen = _gen("dims", K, V)
    inputs = make_inputs(gen, 23, B=2, H=1, HV=3, K=K, V=V, beta_max=2.0)
    ro, rh = run_ref(inputs)
    d_o, d_ht = cotangents(gen, inputs)
    _, _, rg = ref_grads(inputs, d_o, d_ht)
    for algo in ALGORITHMS:
        for chunk_size in (1, 4, 64):
            o, ht, gg = grads_of(lambda kw: run_ours(kw, algo, chunk_size), inputs, d_o, d_ht)
            _check_close(o, ro, FP64_TOL, f"{algo} o")
            _check_close(ht, rh, FP64_TOL, f"{algo} final_state")
            for name in rg:
                _check_close(gg[name], rg[name], FP64_TOL, f"{algo} d{name}")


def test_auto_matches_reference():
    # decode (recurrent), one long sequence with one head (scan when there are >= 2 threads), the usual (chunk)
    gen = _gen("auto")
    cases = [
        make_inputs(gen, 1, B=3, H=1, HV=2, K=8, V=8),
        make_inputs(gen, 2, B=2, H=1, HV=2, K=8, V=8),
        make_inputs(gen, 300, B=1, H=1, HV=1, K=8, V=8),
        make_inputs(gen, 0, lengths=[50, 20], H=1, HV=2, K=8, V=8),
        make_inputs(gen, 40, B=2, H=2, HV=2, K=8, V=4),  # no grouping (H == HV)
    ]
    for inputs in cases:
        d_o, d_ht = cotangents(gen, inputs)
        ro, rh, rg = ref_grads(inputs, d_o, d_ht)
        o, ht, gg = grads_of(lambda kw: run_ours(kw, "auto", 16), inputs, d_o, d_ht)
        _check_close(o, ro, FP64_TOL, "auto o")
        _check_close(ht, rh, FP64_TOL, "auto final_state")
        for name in rg:
            _check_close(gg[name], rg[name], FP64_TOL, f"auto d{name}")


# ---------------------------------------------------------------------------------------------------------------
# float64 gradients


@pytest.mark.parametrize("options", list(OPTION_SETS))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_gradcheck(algorithm, options):
    gen = _gen("gradcheck", algorithm, options)
    T = int(torch.randint(7, 21, (1,), generator=gen))
    K = int(torch.randint(4, 7, (1,), generator=gen))
    V = int(torch.randint(4, 7, (1,), generator=gen))
    if options in ("plain", "gate"):
        lengths = [T // 2, 0, T - T // 2]
        inputs = make_inputs(gen, 0, lengths=lengths, H=1, HV=2, K=K, V=V, options=OPTION_SETS[options],
                             beta_max=2.0)
    else:
        inputs = make_inputs(gen, T, B=2, H=1, HV=2, K=K, V=V, options=OPTION_SETS[options], beta_max=2.0)
    names = diff_inputs(inputs)
    assert "initial_state" in names

    def fn(*tensors):
        kw = dict(inputs)
        kw.update(zip(names, tensors))
        return gated_delta.gated_delta_rule(**kw, output_final_state=True, algorithm=algorithm, chunk_size=4)

    args = tuple(inputs[n].detach().clone().requires_grad_(True) for n in names)
    # one thread: ~1500 calls of tiny ops (the multi-threaded kernel paths are covered by the tests above)
    with single_thread():
        assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("options", ["plain", "all"])
def test_grads_vs_reference_fp64(options, chunk_size):
    gen = _gen("grads", options, chunk_size)
    lengths = [65, 0, 1, 130, 17]
    inputs = make_inputs(gen, 0, lengths=lengths, H=2, HV=4, K=16, V=24, options=OPTION_SETS[options],
                         beta_max=2.0)
    d_o, d_ht = cotangents(gen, inputs)
    _check_algorithms_fp64(inputs, d_o, d_ht, ref_grads(inputs, d_o, d_ht), chunk_size)


def test_gate_without_dt_bias_fp64():
    """use_gate_in_kernel without dt_bias (g = -exp(A_log) softplus(g_raw)), beside the other options: the output and
    every gradient, dA_log included, against the float64 reference."""
    gen = _gen("gate without dt_bias")
    inputs = make_inputs(gen, 0, lengths=[65, 1, 30], options=OPTION_SETS["all"], beta_max=2.0)
    del inputs["dt_bias"]
    d_o, d_ht = cotangents(gen, inputs)
    ro, rh, rg = ref_grads(inputs, d_o, d_ht)
    assert set(rg) == {"q", "k", "v", "g", "beta", "initial_state", "A_log"}
    _check_algorithms_fp64(inputs, d_o, d_ht, (ro, rh, rg), 16)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_grads_without_final_state_grad(algorithm):
    # only o feeds the loss: the final state's gradient is undefined and counts as zero
    gen = _gen("no_dht", algorithm)
    inputs = make_inputs(gen, 0, lengths=[40, 0, 29], H=2, HV=4, K=8, V=8)
    d_o, _ = cotangents(gen, inputs)
    ref = {}
    for name, fn in (("ref", lambda kw: run_ref(kw, output_final_state=False)),
                     ("ours", lambda kw: run_ours(kw, algorithm, 16, output_final_state=False))):
        kw = dict(inputs)
        names = diff_inputs(kw)
        for n in names:
            kw[n] = kw[n].detach().clone().requires_grad_(True)
        with single_thread() if name == "ref" else contextlib.nullcontext():
            o, _ = fn(kw)
            ref[name] = dict(zip(names, torch.autograd.grad((o * d_o).sum(), [kw[n] for n in names])))
    for n in ref["ref"]:
        _check_close(ref["ours"][n], ref["ref"][n], FP64_TOL, f"{algorithm} d{n}")


# ---------------------------------------------------------------------------------------------------------------
# lower precision


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_low_precision(dtype, algorithm):
    gen = _gen("lowp", str(dtype), algorithm)
    inputs = make_inputs(gen, 0, lengths=[150, 3, 0, 90], H=2, HV=4, K=32, V=32, dtype=dtype)
    d_o, d_ht = cotangents(gen, inputs)
    d_o = d_o.to(dtype).double()  # the cotangent as the rounded output will see it
    d_ht = d_ht.float().double()
    ro, rh, rg = ref_grads(upcast(inputs), d_o, d_ht)
    o, ht, gg = grads_of(lambda kw: run_ours(kw, algorithm, 32), inputs, d_o, d_ht)
    tol = LOW_PRECISION_TOL[dtype]
    assert o.dtype == dtype and ht.dtype == torch.float32
    _check_close(o, ro, tol["rounded"], f"{dtype} {algorithm} o")
    _check_close(ht, rh, tol["fp32"], f"{dtype} {algorithm} final_state")
    for name in rg:
        assert gg[name].dtype == inputs[name].dtype
        kind = "fp32" if gg[name].dtype == torch.float32 else "rounded"
        _check_close(gg[name], rg[name], tol[kind], f"{dtype} {algorithm} d{name}")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_fp32_resets_and_no_decay(algorithm):
    # long runs of g = 0 and resets g = -1e4 in float32: finite, and as accurate as elsewhere
    gen = _gen("resets", algorithm)
    inputs = make_inputs(gen, 200, B=1, H=1, HV=2, K=16, V=16, dtype=torch.float32)
    g = inputs["g"]
    g[:, 10:80] = 0.0
    g[:, 33] = -1e4
    g[:, 100:110] = -1e4
    ro, rh = run_ref(upcast(inputs))
    o, ht = run_ours(inputs, algorithm, 64)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    _check_close(o, ro, LOW_PRECISION_TOL[torch.float32]["fp32"], "o")
    _check_close(ht, rh, LOW_PRECISION_TOL[torch.float32]["fp32"], "final_state")


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_hard_resets_minus_inf_fp64(chunk_size):
    """g = -inf (a hard reset: e^g = 0) inside chunks, twice in a row, at a chunk's first and last token: the chunk
    algorithms read every g as max(g, -40) (e^-40 is below double resolution), so that the differences of the
    cumulative decay stay finite; the output, the final state and every gradient against the float64 reference
    (which applies e^g token by token)."""
    gen = _gen("minus_inf", chunk_size)
    inputs = make_inputs(gen, 0, lengths=[150, 1, 70], H=2, HV=4, K=16, V=24, beta_max=2.0)
    g = inputs["g"]
    for t, hv in ((5, 0), (33, 1), (34, 1), (63, 3), (64, 0), (100, 2), (151, 3), (200, 1)):
        g[0, t, hv] = -float("inf")
    g[0, 120, :] = -float("inf")  # (tokens 33 and 34: twice in a row; 63 and 64: a chunk's last and first)
    d_o, d_ht = cotangents(gen, inputs)
    ro, rh, rg = ref_grads(inputs, d_o, d_ht)
    assert all(torch.isfinite(x).all() for x in (ro, rh, *rg.values()))
    _check_algorithms_fp64(inputs, d_o, d_ht, (ro, rh, rg), chunk_size)


# ---------------------------------------------------------------------------------------------------------------
# layouts, NaN, determinism, the portable matrix product


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_noncontiguous_inputs(dtype, algorithm):
    gen = _gen("strides", str(dtype), algorithm)
    B, T, H, HV, K, V = 2, 50, 2, 4, 8, 12
    sd = torch.float32
    q = torch.randn(B, H, T, K, generator=gen).to(dtype).transpose(1, 2)             # transposed
    k = torch.nn.functional.normalize(torch.randn(B, T, H, 2 * K, generator=gen), dim=-1).to(dtype)[..., ::2]
    v = torch.randn(B, T + 3, HV, V, generator=gen).to(dtype)[:, 3:]                  # sliced
    g = (-torch.rand(B, HV, T, generator=gen) * 0.3).transpose(1, 2)
    beta = torch.rand(T, B, HV, generator=gen).to(dtype).permute(1, 0, 2)
    h0 = torch.randn(B, HV, V, K, generator=gen, dtype=sd).transpose(-1, -2)
    strided = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)
    assert not any(t.is_contiguous() for t in strided.values())
    dense = {n: t.contiguous() for n, t in strided.items()}
    d_o, d_ht = cotangents(gen, dense)
    o1, h1, g1 = grads_of(lambda kw: run_ours(kw, algorithm, 16), strided, d_o, d_ht)
    o2, h2, g2 = grads_of(lambda kw: run_ours(kw, algorithm, 16), dense, d_o, d_ht)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)
    for n in g1:
        assert torch.equal(g1[n], g2[n]), n


@pytest.mark.parametrize("where", ["q", "k", "v", "g", "beta", "initial_state"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_nan_propagates(algorithm, where):
    gen = _gen("nan", algorithm, where)
    T, C = 40, 8
    inputs = make_inputs(gen, T, B=2, H=1, HV=2, K=8, V=8, special_gates=False)
    t = 21
    x = inputs[where]
    if where == "initial_state":
        x[1, 0, 3, 2] = float("nan")
    elif x.dim() == 4:
        x[1, t, 0, 1] = float("nan")
    else:
        x[1, t, 0] = float("nan")
    d_o, d_ht = cotangents(gen, inputs)
    o, ht, gg = grads_of(lambda kw: run_ours(kw, algorithm, C), inputs, d_o, d_ht)
    assert torch.isnan(o[1]).any()
    assert torch.isfinite(o[0]).all() and torch.isfinite(ht[0]).all()  # the other sequence is untouched
    if where != "initial_state":
        first = (t // C) * C if algorithm != "recurrent" else t  # a chunk may mix within itself, never backwards
        assert torch.isfinite(o[1, :first]).all()
    if where != "q":
        assert torch.isnan(ht[1]).any()
    assert any(torch.isnan(gr).any() for gr in gg.values())


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_deterministic(algorithm):
    gen = _gen("det", algorithm)
    inputs = make_inputs(gen, 0, lengths=[100, 7, 60], H=1, HV=4, K=16, V=16, dtype=torch.float32)
    d_o, d_ht = cotangents(gen, inputs)
    first = grads_of(lambda kw: run_ours(kw, algorithm, 16), inputs, d_o, d_ht)
    for _ in range(2):
        again = grads_of(lambda kw: run_ours(kw, algorithm, 16), inputs, d_o, d_ht)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
        for n in first[2]:
            assert torch.equal(first[2][n], again[2][n]), n


def test_portable_code_paths():
    # GATED_DELTA_CPU_BLAS=0: the small matrix products run on portable loops instead of the BLAS;
    # GATED_DELTA_CPU_ISA=base: the recurrent loops run in their baseline-instruction-set build (not AVX2)
    code = r"""
import torch, sys
sys.path.insert(0, %r)
from helpers import make_inputs, cotangents, grads_of, ref_grads, run_ours, rel
gen = torch.Generator().manual_seed(7)
inputs = make_inputs(gen, 0, lengths=[70, 0, 33], H=2, HV=4, K=8, V=12, beta_max=2.0)
d_o, d_ht = cotangents(gen, inputs)
ro, rh, rg = ref_grads(inputs, d_o, d_ht)
for algo in ("recurrent", "chunk", "scan"):
    o, ht, gg = grads_of(lambda kw: run_ours(kw, algo, 16), inputs, d_o, d_ht)
    errs = [rel(o, ro), rel(ht, rh)] + [rel(gg[n], rg[n]) for n in rg]
    assert max(errs) < 1e-10, (algo, errs)
print("ok")
""" % os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, GATED_DELTA_CPU_BLAS="0", GATED_DELTA_CPU_ISA="base")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr
