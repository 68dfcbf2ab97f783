"""GPU tests of the one-kernel forward (csrc/cuda/delta_rule/fwd_fused.cu) against the float64 token loop.

The forward runs as one warp-specialised kernel for 16-bit inputs with K = 128, V a multiple of 128 and the state
pass in 64-column tiles, except for segments shorter than 16 chunks (test_default_choice). GATED_DELTA_FUSED_FWD=1
(set per test here) takes it wherever it applies, =0 never (then prep + state_fwd, tested here too). Every case
below has enough (sequence or segment x value head x 64 columns) tiles for that on an H200, and each test checks
from the profiler which kernels ran. Marked `gpu`, skipped without CUDA.
"""
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_helpers import TOL, check_graph_replay, make_inputs, output_grads, reference, rel_err, run_ours  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def fused_forward(monkeypatch):
    monkeypatch.setenv("GATED_DELTA_FUSED_FWD", "1")


# B, T, H, HV, V, initial state, cu_seqlens
CASES = {
    "T1": (16, 1, 4, 8, 128, True, None),
    "T63_G4": (8, 63, 4, 16, 128, True, None),
    "T65_G2": (4, 65, 16, 32, 128, True, None),
    "T1000_V256": (2, 1000, 4, 32, 256, True, None),
    "T300_no_h0": (4, 300, 8, 32, 128, False, None),
    # lengths 0, 1, 63, 1, 635, 1300: empty and one-token sequences, a partial last chunk, chunks across boundaries
    "varlen": (1, 2000, 8, 32, 128, True, [0, 0, 1, 64, 65, 700, 2000]),
}

_REF = {}


def _case(name, dtype):
    if (name, dtype) not in _REF:
        B, T, H, HV, V, h0, cu = CASES[name]
        inp = make_inputs(B, T, H, HV, 128, V, dtype, h0=h0, cu_seqlens=cu, seed=100 + list(CASES).index(name))
        _REF[(name, dtype)] = (inp, reference(inp, grads=False))
    return _REF[(name, dtype)]


def _kernels(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, " ".join(e.name for e in prof.events())


@pytest.mark.parametrize("algorithm", ["chunk", "auto"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(CASES))
def test_forward_against_reference(name, dtype, algorithm):
    inp, ref = _case(name, dtype)
    ours, names = _kernels(lambda: run_ours(inp, algorithm=algorithm, grads=False))
    assert "fwd_fused_kernel" in names and "prep_kernel" not in names and "state_fwd_kernel" not in names, names
    tol = TOL[dtype][0]
    errs = {key: rel_err(ours[key], ref[key]) for key in ("o", "ht")}
    print(f"\n{name} {dtype} {algorithm}: " + " ".join(f"{k}={v:.2e}" for k, v in errs.items()))
    for key, e in errs.items():
        assert torch.isfinite(ours[key]).all(), key
        assert e <= tol, f"{key}: relative error {e:.3e} > {tol:.1e} ({errs})"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["T1", "T63_G4", "T1000_V256", "varlen"])
def test_two_kernel_forward_against_reference(name, dtype, monkeypatch):
    """GATED_DELTA_FUSED_FWD=0: the forward is prep + state_fwd (what the backward recomputes)."""
    monkeypatch.setenv("GATED_DELTA_FUSED_FWD", "0")
    inp, ref = _case(name, dtype)
    ours, names = _kernels(lambda: run_ours(inp, grads=False))
    assert "fwd_fused_kernel" not in names and "prep_kernel" in names and "state_fwd_kernel" in names, names
    tol = TOL[dtype][0]
    for key in ("o", "ht"):
        e = rel_err(ours[key], ref[key])
        assert torch.isfinite(ours[key]).all(), key
        assert e <= tol, f"{key}: relative error {e:.3e} > {tol:.1e}"


def test_default_choice(monkeypatch):
    """Without the variable: the one-kernel forward without segments and with segments of 16 chunks or more, prep +
    state_fwd with shorter ones (whose warm-up chunks it would prepare again per segment)."""
    monkeypatch.delenv("GATED_DELTA_FUSED_FWD")
    cases = [
        ((4, 300, 8, 32), True),  # no segments
        ((1, 8192, 16, 32), True),  # 128 chunks in at most 4 segments per value head: 32 chunks or more each
        ((1, 1100, 4, 16), False),  # 18 chunks in 2 or more segments of at least 8
    ]
    for (B, T, H, HV), fused in cases:
        inp = make_inputs(B, T, H, HV, 128, 128, torch.bfloat16, seed=T)
        _, names = _kernels(lambda: run_ours(inp, algorithm="auto", grads=False))
        assert ("fwd_fused_kernel" in names) == fused and ("prep_kernel" in names) != fused, (B, T, H, HV, names)


# Segments (algorithm="auto" with few sequence x value head units): B, T, H, HV, cu_seqlens, value heads without
# decay (g = 0: no warm-up is proven there, the exact fallback runs them whole)
SEG_CASES = {
    "seg_T4096": (1, 4096, 4, 16, None, 0),
    "seg_T1100_short": (1, 1100, 4, 16, None, 0),
    "seg_fallback": (1, 4096, 4, 16, None, 3),
    "seg_varlen_long_short": (1, 4200, 4, 16, [0, 100, 4000, 4001, 4200], 1),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(SEG_CASES))
def test_segments_against_reference(name, dtype):
    B, T, H, HV, cu, flat = SEG_CASES[name]
    inp = make_inputs(B, T, H, HV, 128, 128, dtype, cu_seqlens=cu, seed=200 + list(SEG_CASES).index(name))
    if flat:
        inp["g"][..., :flat] = 0.0
    ref = reference(inp, grads=False)
    ours, names = _kernels(lambda: run_ours(inp, algorithm="auto", grads=False))
    assert "fwd_fused_kernel" in names and "prep_kernel" not in names and "lnorm" not in names, names
    tol = TOL[dtype][0]
    for key in ("o", "ht"):
        e = rel_err(ours[key], ref[key])
        print(f"\n{name} {dtype} {key}={e:.2e}")
        assert torch.isfinite(ours[key]).all(), key
        assert e <= tol, f"{key}: relative error {e:.3e} > {tol:.1e}"


def test_state_v_first():
    """States [N, HV, V, K]: read and written by the kernel in that layout."""
    inp, ref = _case("T65_G2", torch.bfloat16)
    vf = dict(inp, initial_state=inp["initial_state"].transpose(-1, -2).contiguous())
    ours, names = _kernels(lambda: run_ours(vf, grads=False, state_v_first=True))
    assert "fwd_fused_kernel" in names
    assert rel_err(ours["o"], ref["o"]) <= TOL[torch.bfloat16][0]
    assert rel_err(ours["ht"].transpose(-1, -2), ref["ht"]) <= TOL[torch.bfloat16][0]


def test_backward_after_fused_forward():
    """The backward (its own kernels) from inputs whose forward ran fused: every gradient against the reference."""
    B, T, H, HV, V = 4, 130, 8, 32, 128
    inp = make_inputs(B, T, H, HV, 128, V, torch.bfloat16, seed=5)
    d_o, d_ht = output_grads(inp, B, seed=6)
    ref = reference(inp, d_o, d_ht)
    ours, names = _kernels(lambda: run_ours(inp, d_o, d_ht))
    assert "fwd_fused_kernel" in names
    tol_o, tol_g = TOL[torch.bfloat16]
    for key, r in ref.items():
        assert rel_err(ours[key], r) <= (tol_o if key in ("o", "ht") else tol_g), key


def test_deterministic_and_graph_replay():
    inp = make_inputs(2, 777, 8, 32, 128, 128, torch.bfloat16, seed=9)
    a = run_ours(inp, grads=False)
    b = run_ours(inp, grads=False)
    assert torch.equal(a["o"], b["o"]) and torch.equal(a["ht"], b["ht"])
    d_o, d_ht = output_grads(inp, 2)
    check_graph_replay(inp, d_o, d_ht, "chunk")


def test_matches_two_kernel_forward():
    """With GATED_DELTA_FUSED_FWD=0 the forward is prep + state_fwd: both forwards agree to their bf16 rounding."""
    code = (
        "import sys, torch; sys.path.insert(0, %r); from gpu_helpers import make_inputs, run_ours; "
        "inp = make_inputs(4, 300, 8, 32, 128, 128, torch.bfloat16, seed=3); r = run_ours(inp, grads=False); "
        "torch.save({k: v.cpu() for k, v in r.items()}, sys.argv[1])" % os.path.dirname(os.path.abspath(__file__)))
    outs = []
    for flag in ("1", "0"):  # (in processes of their own, as a user would set it)
        path = f"/tmp/gd_fused_{flag}_{os.getpid()}.pt"
        subprocess.run([sys.executable, "-c", code, path], check=True,
                       env=dict(os.environ, GATED_DELTA_FUSED_FWD=flag))
        outs.append(torch.load(path))
        os.remove(path)
    for key in ("o", "ht"):
        assert rel_err(outs[0][key], outs[1][key]) <= 4e-3, key
