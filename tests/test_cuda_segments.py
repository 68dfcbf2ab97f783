"""GPU tests of the segments with a proven warm-up (csrc/cuda/warmup.cuh), which algorithm="auto" takes when one
CTA per (sequence, value head, 64 columns) would keep fewer than half of the SMs busy.

With B x HV x V / 64 small, a sequence of 16 or more chunks is cut into segments of max(8, chunks / segments)
chunks; on an H200 (132 SMs) the shapes below get segments of 8 chunks (512 tokens) and warm-ups of at most 16.
Typical gates (g = logsigmoid(N(0, 1) + 3), about -4.5 per chunk) prove a start after about 6 chunks; g = 0 proves
nothing, so those segments fall back to the exact sequential pass; so do keys with beta |k|^2 > 2 everywhere.
Everything is compared with the float64 token loop at the tolerances of the other GPU tests (gpu_helpers.TOL).
"""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from gpu_helpers import (TOL, check_graph_replay, make_inputs, output_grads, reference, rel_err,  # noqa: E402
                         run_ours)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

def _no_decay(inp, heads=None, tokens=None):
    """g = 0 (no decay) on the given value heads (all by default) and tokens (all by default)."""
    g = inp["g"].clone()
    hs = slice(None) if heads is None else heads
    ts = slice(None) if tokens is None else tokens
    g[:, ts, hs] = 0.0
    inp["g"] = g
    return inp


def _no_decay_batch1(inp):
    """g = 0 in the second sequence of an equal-length batch (its segments fall back, the first's do not)."""
    g = inp["g"].clone()
    g[1] = 0.0
    inp["g"] = g
    return inp


def _big_keys(inp):
    """|k| = 1.3 and beta in [1.2, 2]: beta |k|^2 > 2 on every token, so no warm-up is proven (the dynamics stay
    stable: the decay outweighs the stretch along one random direction per token)."""
    k = inp["k"].float()
    inp["k"] = (1.3 * F.normalize(k, dim=-1)).to(inp["k"].dtype)
    gen = torch.Generator(device="cpu").manual_seed(11)
    beta = 1.2 + 0.8 * torch.rand(inp["beta"].shape, generator=gen)
    inp["beta"] = beta.to(inp["beta"].device, inp["beta"].dtype)
    return inp


def _long_keys(inp):
    """|k| = 1.2 with beta in (0, 1): beta |k|^2 <= 1.44 < 2, still a contraction, so the warm-up is proven."""
    k = inp["k"].float()
    inp["k"] = (1.2 * F.normalize(k, dim=-1)).to(inp["k"].dtype)
    return inp


# name: (B, T, H, HV, K, V, initial state, cu_seqlens, input transform, in-kernel options)
CASES = {
    # 33 chunks (the last one partial): segments 0..3 of 8 chunks and a last one of 1
    "proven": (1, 2100, 1, 2, 64, 64, True, None, None, False),
    "proven_K128": (1, 2100, 1, 2, 128, 128, True, None, None, False),
    "proven_gqa_K256_V64": (1, 1500, 1, 2, 256, 64, True, None, None, False),
    "proven_K64_V256": (1, 1100, 1, 1, 64, 256, False, None, None, False),
    "no_decay": (1, 2100, 1, 2, 64, 64, True, None, _no_decay, False),
    "mixed_heads": (1, 2100, 2, 4, 64, 64, True, None, lambda x: _no_decay(x, heads=[1, 2]), False),
    # a stretch without decay in the middle: the segments right after it fall back, the heads' others not
    "no_decay_window": (1, 2100, 1, 2, 64, 64, True, None, lambda x: _no_decay(x, tokens=slice(700, 1500)), False),
    "big_keys": (1, 2100, 1, 2, 64, 64, True, None, _big_keys, False),
    "long_keys": (1, 2100, 1, 2, 64, 64, True, None, _long_keys, False),
    # an equal-length batch: segments of two sequences, the second without decay
    "batch2": (2, 1700, 1, 2, 64, 64, True, None, _no_decay_batch1, False),
    # in-kernel q/k L2 norm, beta sigmoid with negative eigenvalues (beta in (0, 2)), gate from A_log / dt_bias
    "options": (1, 2100, 2, 4, 64, 64, True, None, None, True),
    # long and short sequences (shorter than a segment, one empty), one of them without decay
    "varlen": (1, 4200, 1, 2, 64, 64, True, [0, 100, 100, 2700, 2760, 4200], None, False),
    "varlen_no_decay": (1, 4200, 1, 2, 64, 64, True, [0, 100, 100, 2700, 2760, 4200],
                        lambda x: _no_decay(x, tokens=slice(100, 2700)), False),
}

_REF = {}


def _case(name, dtype):
    key = (name, dtype)
    if key not in _REF:
        B, T, H, HV, K, V, h0, cu, tf, opts = CASES[name]
        inp = make_inputs(B, T, H, HV, K, V, dtype, h0=h0, cu_seqlens=cu, options=opts,
                          seed=100 + list(CASES).index(name))
        if tf is not None:
            inp = tf(inp)
        N = B if cu is None else len(cu) - 1
        d_o, d_ht = output_grads(inp, N)
        _REF[key] = (inp, d_o, d_ht, reference(inp, d_o, d_ht))
    return _REF[key]


def _assert_close(label, ours, ref, dtype):
    """Every output and gradient of `ours` finite and within the GPU tests' tolerance of the float64 `ref`."""
    tol_o, tol_g = TOL[dtype]
    errs = {k: rel_err(ours[k], r) for k, r in ref.items()}
    print(f"\n{label} {dtype}: " + " ".join(f"{k}={v:.2e}" for k, v in errs.items()))
    for k, e in errs.items():
        assert torch.isfinite(ours[k]).all(), k
        tol = tol_o if k in ("o", "ht") else tol_g
        assert e <= tol, f"{k}: relative error {e:.3e} > {tol:.1e} ({errs})"


def _check(name, dtype):
    inp, d_o, d_ht, ref = _case(name, dtype)
    ours = run_ours(inp, d_o, d_ht, algorithm="auto")
    _assert_close(name, ours, ref, dtype)
    return ours


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_proven_segments(dtype):
    _check("proven", dtype)


@pytest.mark.parametrize("name", [n for n in CASES if n != "proven"])
def test_segments_bf16(name):
    _check(name, torch.bfloat16)


@pytest.mark.parametrize("name", ["no_decay", "mixed_heads", "big_keys", "varlen_no_decay"])
def test_fallback_fp32(name):
    _check(name, torch.float32)


def _profiled(fn):
    """fn's result and how many launches of each state kernel it made."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        r = fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = ("fwd_fused_kernel", "state_fwd_kernel", "state_rev_kernel", "combine_kernel")
    return r, {k: sum(k in n for n in names) for k in kernels}


def _kernel_counts(fn):
    return _profiled(fn)[1]


def test_auto_takes_segments_scan_and_chunk_do_not():
    inp, d_o, d_ht, _ = _case("proven", torch.bfloat16)
    seg = _kernel_counts(lambda: run_ours(inp, d_o, d_ht, algorithm="auto"))
    # forward: segments + fallback; backward: the same for both state passes; no composition of maps
    assert seg == {"fwd_fused_kernel": 0, "state_fwd_kernel": 4, "state_rev_kernel": 2, "combine_kernel": 0}, seg
    scan = _kernel_counts(lambda: run_ours(inp, d_o, d_ht, algorithm="scan"))
    assert scan["combine_kernel"] == 3, scan
    chunk = _kernel_counts(lambda: run_ours(inp, d_o, d_ht, algorithm="chunk"))
    assert chunk == {"fwd_fused_kernel": 0, "state_fwd_kernel": 2, "state_rev_kernel": 1, "combine_kernel": 0}, chunk


def test_segments_deterministic():
    inp, d_o, d_ht, _ = _case("varlen_no_decay", torch.bfloat16)
    a = run_ours(inp, d_o, d_ht, algorithm="auto")
    b = run_ours(inp, d_o, d_ht, algorithm="auto")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_segments_graph_replay_matches_eager():
    inp, d_o, d_ht, _ = _case("mixed_heads", torch.bfloat16)
    check_graph_replay(inp, d_o, d_ht, "auto")


@pytest.mark.parametrize("V", [64, 128])
def test_segment_slots_forward_and_backward(V):
    """The warpgroup state passes count two 64-column tiles per SM: the forward's always, the backward's where V
    holds an even number of tiles (one CTA of two warpgroups). A batch of one sequence with as many tiles as SMs is
    cut into segments (segments + fallback pass) where its pass counts two slots per SM and walked whole where it
    counts one: with V = 64 the backward walks it whole, with V = 128 both directions cut it. Its segments are
    shorter than 16 chunks, so the forward is prep + state_fwd, not the one-kernel forward. Against the float64
    loop."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    HV = sms * 64 // V  # sms tiles per sequence
    H = HV // 2 if HV % 2 == 0 else HV
    inp = make_inputs(1, 1100, H, HV, 128, V, torch.bfloat16, seed=5)
    d_o, d_ht = output_grads(inp, 1)
    out, counts = _profiled(lambda: run_ours(inp, d_o, d_ht, algorithm="auto"))
    if V == 64:  # forward: segments + fallback; backward: one state_fwd (states of every chunk), one state_rev
        want = {"fwd_fused_kernel": 0, "state_fwd_kernel": 3, "state_rev_kernel": 1, "combine_kernel": 0}
    else:  # both: segments + fallback
        want = {"fwd_fused_kernel": 0, "state_fwd_kernel": 4, "state_rev_kernel": 2, "combine_kernel": 0}
    assert counts == want, counts
    _assert_close(f"segment slots, V = {V}", out, reference(inp, d_o, d_ht), torch.bfloat16)
