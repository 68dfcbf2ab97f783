"""GPU tests of the CUDA kernels against the float64 token loop (run on the GPU in float64).

Every test is marked `gpu` and skipped without CUDA.
"""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from gpu_helpers import TOL, check_graph_replay, make_inputs, output_grads, reference, rel_err, run_ours  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# B, T, H, HV, K, V, initial state, cu_seqlens, in-kernel options
CASES = {
    "T63_K64_V128_gqa": (2, 63, 2, 4, 64, 128, True, None, False),
    "T1": (3, 1, 2, 4, 128, 64, False, None, False),
    "T65_K128": (2, 65, 2, 2, 128, 128, True, None, False),
    "T1000": (1, 1000, 1, 2, 128, 128, True, None, False),
    "K256_V64": (1, 130, 1, 2, 256, 64, True, None, False),
    "K64_V256_noh0": (2, 100, 1, 1, 64, 256, False, None, False),
    "varlen": (1, 200, 2, 4, 128, 64, True, [0, 5, 5, 70, 200], False),
    "varlen_empty_ends": (1, 130, 1, 2, 64, 64, True, [0, 0, 65, 130, 130], False),
    "options": (2, 90, 2, 4, 128, 128, True, None, True),
    # enough (sequence x value head x 64 columns) CTAs, 256, for the state passes to take their 64-column tiles
    # (smaller grids, like every case above on an H200, take 32-column ones)
    "wide_grid": (2, 130, 8, 64, 128, 128, True, None, False),
    # the preparation walks several value heads per CTA when the grid stays at two or more CTAs per SM: on an
    # H200 (132 SMs) all of a group here (18 chunks x 16 q/k heads), half a group in the next case (14 x 10)
    "prep_whole_group": (2, 530, 16, 32, 128, 128, True, None, False),
    "prep_half_group": (2, 400, 10, 40, 64, 64, False, None, True),
    # 64-column tiles take the warpgroup (wgmma) products for 16-bit inputs: K = 64 with V = 128 (256 CTAs), and a
    # varlen batch of lengths 1, 63, 1, 235, 700 (5 sequences x 8 value heads x 2 tiles = 80 CTAs)
    "wg_K64_V128": (2, 65, 4, 32, 64, 128, True, None, False),
    "wg_varlen": (1, 1000, 2, 8, 128, 128, True, [0, 1, 64, 65, 300, 1000], False),
    # V = 256 in 64-column tiles (2 x 16 value heads x 4 tiles = 128 CTAs): the passes that hold two tiles per CTA
    # run two CTAs per value head
    "wg_V256": (2, 130, 8, 16, 64, 256, True, None, False),
    # grad_qk work items (chunk x q/k head x 64-wide block of K) in several waves, with short pipelines of steps: a
    # varlen batch (50 chunks x 4 heads x 2 blocks = 400 items, 4 steps each), one value head per group with V = 128
    # (2 steps per item) and with V = 64 (1 step)
    "qk_items_varlen": (1, 3000, 4, 8, 128, 128, True, [0, 1, 64, 1000, 1001, 3000], False),
    "qk_items_G1_V128": (1, 2000, 4, 4, 128, 128, False, None, False),
    "qk_items_G1_V64": (1, 2000, 8, 8, 64, 64, True, None, False),
    # grad_qk's 16-bit kernel runs at most one CTA per SM, each walking its items as one pipeline: 65 chunks x 8 q/k
    # heads x 2 blocks = 1040 items, about 8 per CTA on an H200, one step each (so that the steps in flight reach
    # two items past the one computed, and every slot of q / k and of a head's A and gam is refilled)
    "qk_items_persistent": (1, 4100, 8, 8, 128, 64, True, None, False),
    # 16-bit inputs with K = 128 take grad_qk's three-warpgroup kernel, whose items are (chunk, q/k head) with both
    # blocks of K: 66 chunks x 4 q/k heads = 264 items, two per CTA on an H200, each a pipeline of 2 value heads x
    # 4 V tiles; and with the in-kernel options (the L2 norm's chain rule of dq in that kernel) 2 value heads x 2
    # V tiles per item
    "wg3_V256_G2": (1, 4200, 4, 8, 128, 256, True, None, False),
    "wg3_options_G2": (1, 4200, 4, 8, 128, 128, True, [0, 63, 64, 2100, 4200], True),
    # V above 256 runs as slices of v's columns, each a call of its own: two of 256 (K = 256, as FLA's Gated DeltaNet
    # layer by default); three of 128 on a grid that takes the one-kernel forward and keeps its residual, which
    # every slice's backward reads; five of 64 where V is no multiple of 64 (the last slice zero-padded), with K
    # padded, grouped heads, varlen and the in-kernel options
    "V512_K256": (1, 130, 1, 2, 256, 512, True, None, False),
    "V384_fused": (2, 130, 8, 32, 128, 384, True, None, False),
    "V300_K100_varlen": (1, 200, 2, 4, 100, 300, True, [0, 1, 65, 200], True),
    # use_qk_l2norm_in_kernel: grad_wy applies the L2 norm's chain rule to dk for K <= 128 (varlen with odd lengths
    # here), the op layer for K = 256
    "options_varlen_K64": (1, 1000, 2, 4, 64, 128, True, [0, 1, 63, 65, 1000], True),
    "options_K256": (2, 200, 2, 4, 256, 64, True, None, True),
    # ... through grad_qk's persistent CTAs, about 8 items each of one step, and a varlen batch with one-token
    # sequences (grad_wy's chain rule on rows of every length), four steps per item
    "options_qk_walk": (1, 4100, 8, 8, 128, 64, True, None, True),
    "options_qk_varlen": (1, 3000, 4, 8, 128, 128, True, [0, 1, 64, 1000, 1001, 3000], True),
}

_REF_CACHE = {}


def _case(name, dtype):
    key = (name, dtype)
    if key not in _REF_CACHE:
        B, T, H, HV, K, V, h0, cu, opts = CASES[name]
        inp = make_inputs(B, T, H, HV, K, V, dtype, h0=h0, cu_seqlens=cu, options=opts, seed=list(CASES).index(name))
        N = B if cu is None else len(cu) - 1
        d_o, d_ht = output_grads(inp, N, seed=7)
        ref = reference(inp, d_o, d_ht)
        _REF_CACHE[key] = (inp, d_o, d_ht, ref)
    return _REF_CACHE[key]


@pytest.mark.parametrize("algorithm", ["chunk", "scan"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("name", list(CASES))
def test_against_reference(name, dtype, algorithm):
    inp, d_o, d_ht, ref = _case(name, dtype)
    ours = run_ours(inp, d_o, d_ht, algorithm=algorithm)
    tol_o, tol_g = TOL[dtype]
    errs = {}
    for key, r in ref.items():
        assert torch.isfinite(ours[key]).all(), f"{key} has non-finite values"
        assert ours[key].device.type == "cuda"
        errs[key] = rel_err(ours[key], r)
    print(f"\n{name} {dtype} {algorithm}: " + " ".join(f"{k}={v:.2e}" for k, v in errs.items()))
    for key, e in errs.items():
        tol = tol_o if key in ("o", "ht") else tol_g
        assert e <= tol, f"{key}: relative error {e:.3e} > {tol:.1e} ({errs})"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_chunk_and_scan_agree(dtype):
    """The two algorithms on the same inputs: fp32 to 1e-4; 16-bit within the tolerance each has against the float64
    loop (their outputs and gradients are rounded to bf16 along different paths)."""
    inp = make_inputs(2, 3000, 1, 2, 128, 128, dtype)
    d_o, d_ht = output_grads(inp, 2, seed=11)
    a = run_ours(inp, d_o, d_ht, algorithm="chunk")
    b = run_ours(inp, d_o, d_ht, algorithm="scan")
    for key in a:
        tol = 1e-4 if dtype == torch.float32 else TOL[dtype][0 if key in ("o", "ht") else 1]
        e = rel_err(b[key], a[key])
        print(f"\n{dtype} {key}: {e:.2e}")
        assert e <= tol, f"{key}: {e:.3e} > {tol:.1e}"


def test_auto_and_recurrent_run():
    inp = make_inputs(1, 4096, 1, 1, 128, 128, torch.bfloat16)
    ref = reference(inp, grads=False)
    for algo in ("auto", "recurrent"):
        r = run_ours(inp, algorithm=algo, grads=False)
        assert rel_err(r["o"], ref["o"]) < 5e-3


@pytest.mark.parametrize("options", [False, True], ids=["plain", "options"])
def test_deterministic(options):
    inp = make_inputs(1, 777, 2, 8, 128, 128, torch.bfloat16, cu_seqlens=[0, 100, 500, 777], options=options)
    d_o, d_ht = output_grads(inp, 3)
    for algo in ("chunk", "scan"):
        a = run_ours(inp, d_o, d_ht, algorithm=algo)
        b = run_ours(inp, d_o, d_ht, algorithm=algo)
        for key in a:
            assert torch.equal(a[key], b[key]), (algo, key)


def test_beta_dtype_is_read_in_place():
    """beta is read in its own dtype (no cast kernel) and dbeta comes back in it: the same beta values in any dtype
    give bitwise the same output and gradients, and dbeta is the fp32 one rounded to beta's dtype (fp64, not a
    kernel dtype, is read and written as fp32)."""
    inp = make_inputs(2, 130, 2, 4, 128, 128, torch.bfloat16, seed=11)
    d_o, d_ht = output_grads(inp, 2)
    runs = {dt: run_ours(dict(inp, beta=inp["beta"].to(dt)), d_o, d_ht)  # (bf16 values fit in each dtype)
            for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}
    wide = runs[torch.float32]
    for dt, r in runs.items():
        assert r["dbeta"].dtype == dt
        assert torch.equal(r["dbeta"], wide["dbeta"].to(dt)), dt
        for key in wide:
            if key != "dbeta":
                assert torch.equal(r[key], wide[key]), (dt, key)


def test_cuda_graph_replay_matches_eager():
    B, T, H, HV, K, V = 2, 200, 2, 4, 128, 128
    inp = make_inputs(B, T, H, HV, K, V, torch.bfloat16)
    d_o, d_ht = output_grads(inp, B)
    check_graph_replay(inp, d_o, d_ht, "chunk")


@pytest.mark.parametrize("K,V", [(512, 64), (300, 512)])
def test_unsupported_head_dims_raise(K, V):
    inp = make_inputs(1, 8, 1, 1, K, V, torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"head dim K up to 256 \(V any\), got K = %d, V = %d" % (K, V)):
        run_ours(inp, grads=False)


def test_v_slices_are_calls_on_column_slices():
    """V = 512 runs as two calls on v's column halves: o, the final state, dv and the initial state's gradient are
    those calls' bitwise, and dq, dk, dg, dbeta their sums (added in fp32, then rounded once)."""
    B, T, H, HV, K, V = 2, 150, 2, 4, 128, 512
    inp = make_inputs(B, T, H, HV, K, V, torch.bfloat16, seed=5)
    d_o, d_ht = output_grads(inp, B, seed=6)
    whole = run_ours(inp, d_o, d_ht)
    halves = []
    for j in range(2):
        cols = slice(256 * j, 256 * (j + 1))
        part = dict(inp, v=inp["v"][..., cols].contiguous(), initial_state=inp["initial_state"][..., cols].contiguous())
        halves.append(run_ours(part, d_o[..., cols].contiguous(), d_ht[..., cols].contiguous()))
    for key, dim in (("o", -1), ("ht", -1), ("dv", -1), ("dinitial_state", -1)):
        assert torch.equal(whole[key], torch.cat([h[key] for h in halves], dim)), key
    # dg is fp32 in every call: the sum of the halves' bitwise
    assert torch.equal(whole["dg"], halves[0]["dg"] + halves[1]["dg"])
    for key in ("dq", "dk", "dbeta"):
        # each half rounds its part to bf16; the whole call rounds the sum of the fp32 parts once
        e = rel_err(whole[key], halves[0][key].float() + halves[1][key].float())
        assert whole[key].dtype == torch.bfloat16 and e <= 1e-2, (key, e)


def _strided_view(x, layout, off):
    """x [B, T, HV, V] as a non-contiguous view holding the same values:
    - "cols": columns off .. off + V of rows of V + 128 (a slice of a wider tensor's columns);
    - "fused": elements off .. off + HV V of each token's row of a [B, T, off + HV V + 64] tensor, as v split from
      the output of a fused q | k | v projection (tokens further apart than HV V).
    An off that is no multiple of 8 leaves the rows not 16-byte aligned."""
    B, T, HV, V = x.shape
    if layout == "cols":
        wide = torch.randn(B, T, HV, V + 128, device=x.device).to(x.dtype)
        wide[..., off:off + V] = x
        return wide[..., off:off + V]
    fused = torch.randn(B, T, off + HV * V + 64, device=x.device).to(x.dtype)
    fused[..., off:off + HV * V] = x.reshape(B, T, HV * V)
    return fused[..., off:off + HV * V].unflatten(-1, (HV, V))


# B, T, H, HV, K, V, dtype, cu_seqlens: the one-kernel forward and the warpgroup backward from its residual; the
# mma.sync kernels in fp32 and with K = 256; a varlen batch with V = 256 in fp16
STRIDED = {
    "fused_bf16": (2, 130, 8, 32, 128, 128, torch.bfloat16, None),
    "fp32_K64": (2, 65, 2, 4, 64, 64, torch.float32, None),
    "K256_bf16": (1, 130, 1, 2, 256, 64, torch.bfloat16, None),
    "varlen_V256_fp16": (1, 300, 2, 8, 64, 256, torch.float16, [0, 1, 100, 300]),
}


@pytest.mark.parametrize("case", list(STRIDED))
@pytest.mark.parametrize("algorithm", ["chunk", "scan"])
def test_strided_v_and_d_o_are_read_in_place(case, algorithm):
    """v and d_o given as strided views (a slice of wider rows' columns, a split of a fused projection's output) run
    as the contiguous call does: every output and gradient bitwise equal (read in place where their rows are 16-byte
    aligned, copied first where not)."""
    B, T, H, HV, K, V, dtype, cu = STRIDED[case]
    inp = make_inputs(B, T, H, HV, K, V, dtype, cu_seqlens=cu, seed=11)
    N = B if cu is None else len(cu) - 1
    d_o, d_ht = output_grads(inp, N, seed=12)
    cu_t = inp.get("cu_seqlens")

    def call(v, do):
        args = (inp["q"], inp["k"], v, inp["g"], inp["beta"], K ** -0.5, inp["initial_state"])
        rest = (cu_t, None, False, False, False, False, None, None, algorithm, 64)
        o, ht, res = torch.ops.gated_delta.fwd_with_residual(*args, True, *rest)
        grads = torch.ops.gated_delta.bwd(do, d_ht, *args, *rest, residual=res)
        return (o, ht) + tuple(grads[:6])

    ref = call(inp["v"], d_o)
    for layout, off in (("cols", 0), ("cols", 64), ("cols", 5), ("fused", 2 * H * K), ("fused", 3)):
        v, do = _strided_view(inp["v"], layout, off), _strided_view(d_o, layout, off)
        assert not v.is_contiguous() and torch.equal(v, inp["v"])
        for a, b in zip(ref, call(v, do)):
            assert torch.equal(a, b), (layout, off)


def test_v_slices_graph_replay_and_determinism():
    inp = make_inputs(1, 200, 1, 2, 64, 320, torch.bfloat16, seed=9)
    d_o, d_ht = output_grads(inp, 1)
    check_graph_replay(inp, d_o, d_ht, "chunk")
    a = run_ours(inp, d_o, d_ht)
    b = run_ours(inp, d_o, d_ht)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_runs_cuda_kernels():
    inp = make_inputs(1, 100, 1, 1, 64, 64, torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        r = run_ours(inp, grads=False)
        torch.cuda.synchronize()
    names = " ".join(e.name for e in prof.events())
    assert "state_fwd_kernel" in names and "prep_kernel" in names
    assert r["o"].device.type == "cuda"


def test_varlen_host_copy_matches():
    cu = [0, 10, 150, 151, 300]
    inp = make_inputs(1, 300, 1, 2, 64, 64, torch.bfloat16, cu_seqlens=cu)
    a = run_ours(inp, grads=False)
    b = run_ours(inp, grads=False, cu_seqlens_cpu=torch.tensor(cu))
    assert torch.equal(a["o"], b["o"]) and torch.equal(a["ht"], b["ht"])


def test_bad_cu_seqlens_raise():
    inp = make_inputs(1, 100, 1, 1, 64, 64, torch.bfloat16, cu_seqlens=[0, 60, 40, 100])
    with pytest.raises(RuntimeError, match="non-decreasing"):
        run_ours(inp, grads=False)
    inp = make_inputs(1, 100, 1, 1, 64, 64, torch.bfloat16, cu_seqlens=[0, 60, 90])
    with pytest.raises(RuntimeError, match="must end at T"):
        run_ours(inp, grads=False)


def test_strided_inputs():
    B, T, H, HV, K, V = 1, 100, 2, 2, 64, 64
    inp = make_inputs(B, T, H, HV, K, V, torch.bfloat16)
    ref = run_ours(inp, grads=False)
    st = dict(inp)
    st["q"] = inp["q"].transpose(1, 2).contiguous().transpose(1, 2)
    st["v"] = torch.cat([inp["v"], inp["v"]], dim=-1)[..., :V]
    out = run_ours(st, grads=False)
    assert torch.equal(out["o"], ref["o"])


@pytest.mark.parametrize("K", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_l2norm_option_chain_rule_placement(K, dtype):
    """use_qk_l2norm_in_kernel: for K <= 128 grad_wy applies the L2 norm's chain rule to dk, and for 16-bit inputs
    with K = 128 grad_qk (one CTA holds a chunk's rows of dq whole) applies it to dq, so the backward runs
    `l2norm_bwd` for dq alone where K = 64 or the inputs are fp32, for neither with 16-bit inputs and K = 128, and
    for both with K = 256."""
    inp = make_inputs(1, 200, 2, 4, K, 64, dtype, options=True)
    d_o, d_ht = output_grads(inp, 1)
    run_ours(inp, d_o, d_ht)  # (warm)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run_ours(inp, d_o, d_ht)
    calls = sum(e.name == "gated_delta::l2norm_bwd" for e in prof.events())
    expected = 2 if K == 256 else 0 if (K == 128 and dtype != torch.float32) else 1
    assert calls == expected, (K, dtype, calls)


@pytest.mark.parametrize("algorithm", ["chunk", "scan", "auto"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_full_resets_inside_chunks(dtype, algorithm):
    """Gates of -40, -1e4, -2e5 and -inf (a full reset) in the middle of chunks, two in one chunk: the kernels form each
    chunk's cumulative log decay in fp32 and take its differences, which lose an ulp of the running sum, so they read
    every g as max(g, -32) (e^-32 is below fp32 resolution). fp32 within 1e-4 of float64 (unfloored: about 1e-3 at
    -1e4 and 1e-2 at -2e5). One sequence of two value heads takes segments under "auto"."""
    inp = make_inputs(1, 2000, 1, 2, 128, 128, dtype, seed=21)
    g = inp["g"].clone()
    for t, val in ((70, -1e4), (100, -40.0), (200, -1e4), (641, -2e5), (1300, -2e5), (1310, -2e5), (1777, -40.0),
                   (900, -float("inf")), (901, -float("inf")), (1023, -float("inf"))):
        g[0, t, t % 2] = val
    inp["g"] = g
    d_o, d_ht = output_grads(inp, 1, seed=9)
    ref = reference(inp, d_o, d_ht)
    ours = run_ours(inp, d_o, d_ht, algorithm=algorithm)
    errs = {key: rel_err(ours[key], r) for key, r in ref.items()}
    print(f"\n{dtype} {algorithm}: " + " ".join(f"{k}={v:.2e}" for k, v in errs.items()))
    for key, e in errs.items():
        tol = 1e-4 if dtype == torch.float32 else TOL[dtype][0 if key in ("o", "ht") else 1]
        assert e <= tol, f"{key}: relative error {e:.3e} > {tol:.1e} ({errs})"


@pytest.mark.parametrize("combo", ["beta_sigmoid", "gate_no_dt_bias", "gate_bf16_params", "both_bf16_inputs",
                                   "g_fp64"])
def test_gate_and_beta_options(combo):
    """use_gate_in_kernel and use_beta_sigmoid_in_kernel (one CUDA kernel forward, two backward, for g, beta and the
    parameters' gradients) alone and together, in the dtypes a model passes: against float64, every gradient in its
    input's dtype, and bitwise the same when run again. 2100 tokens of 4 heads are five blocks of the backward's
    first kernel, the last one partial; a g in float64 takes the op layer's ATen expressions."""
    gen = torch.Generator().manual_seed(len(combo))
    inp = make_inputs(3, 700, 2, 4, 64, 64, torch.float32, options=True, seed=len(combo))  # (q, k: L2-normalised)
    if combo == "beta_sigmoid":
        inp.update(use_gate_in_kernel=False, A_log=None, dt_bias=None, allow_neg_eigval=False)
        inp["g"] = F.logsigmoid(torch.randn(3, 700, 4, generator=gen) + 3.0).cuda()
    elif combo == "gate_no_dt_bias":
        inp.update(use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, dt_bias=None)
        inp["beta"] = torch.sigmoid(inp["beta"])
    elif combo == "gate_bf16_params":
        inp["A_log"], inp["dt_bias"] = inp["A_log"].bfloat16(), inp["dt_bias"].bfloat16()
    elif combo == "both_bf16_inputs":
        inp["g"], inp["beta"] = inp["g"].bfloat16(), inp["beta"].bfloat16()
    elif combo == "g_fp64":
        inp["g"] = inp["g"].double()
    d_o, d_ht = output_grads(inp, 3, seed=5)
    ref = reference(inp, d_o, d_ht)
    a = run_ours(inp, d_o, d_ht)
    b = run_ours(inp, d_o, d_ht)
    for key in a:
        assert torch.equal(a[key], b[key]), key
        if key[1:] in inp and isinstance(inp[key[1:]], torch.Tensor):
            assert a[key].dtype == inp[key[1:]].dtype, (key, a[key].dtype)
    errs = {key: rel_err(a[key], r) for key, r in ref.items()}
    print(f"\n{combo}: " + " ".join(f"{k}={v:.2e}" for k, v in errs.items()))
    for key, e in errs.items():
        x = inp.get(key[1:])
        tol = TOL[x.dtype if isinstance(x, torch.Tensor) and x.dtype != torch.float64 else torch.float32][1]
        assert e <= tol, f"{key}: relative error {e:.3e} ({errs})"


@pytest.mark.parametrize("option", ["use_beta_sigmoid_in_kernel", "use_gate_in_kernel"])
def test_one_option_with_the_other_tensor_strided(option):
    """With one in-kernel option, g or beta (the tensor the option does not read) may come as a strided view, as a
    heads-first layout transposed: the option's kernels take it as it is and the core reads it; output and every
    gradient (the view's included) bitwise those of the same call on dense copies."""
    from gated_delta import gated_delta_rule

    gen = torch.Generator().manual_seed(7)
    inp = make_inputs(2, 300, 2, 4, 64, 64, torch.bfloat16, options=True, seed=7)
    other = "g" if option == "use_beta_sigmoid_in_kernel" else "beta"
    if option == "use_beta_sigmoid_in_kernel":
        inp.update(use_gate_in_kernel=False, A_log=None, dt_bias=None, allow_neg_eigval=False)
        heads_first = F.logsigmoid(torch.randn(2, 4, 300, generator=gen) + 3.0)
    else:
        inp.update(use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False)
        heads_first = torch.sigmoid(torch.randn(2, 4, 300, generator=gen))
    d_o, d_ht = output_grads(inp, 2, seed=4)
    outs = []
    for strided in (True, False):
        leaf = heads_first.cuda().requires_grad_()
        x = leaf.transpose(1, 2)  # [B, T, HV], strides (T HV, 1, T)
        if not strided:
            x = x.contiguous()
        assert x.is_contiguous() != strided
        xs = {n: (t.detach().clone().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point()
                  else t) for n, t in inp.items() if n != other}
        o, ht = gated_delta_rule(**xs, **{other: x}, output_final_state=True)
        loss = (o.float() * d_o.float()).sum() + (ht * d_ht).sum()
        names = [n for n, t in xs.items() if isinstance(t, torch.Tensor) and t.requires_grad]
        grads = torch.autograd.grad(loss, [xs[n] for n in names] + [leaf])
        outs.append([o, ht, *grads])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def _qk_layout(x, where):
    """x [B, T, H, K] through differentiable ops into the layout a model passes: "proj" a slice of a fused q | k | v
    projection's rows after q's columns (_strided_view's "fused"), "heads" the heads-first layout [B, H, T, K]
    transposed (the op reads a dense copy), "dense" x itself."""
    if where == "proj":
        return _strided_view(x, "fused", x.shape[2] * x.shape[3])
    if where == "heads":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    return x


@pytest.mark.parametrize("K", [64, 128, 256])
@pytest.mark.parametrize("layout", ["dense", "proj", "heads"])
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                    (torch.float32, torch.bfloat16), (torch.float32, torch.float32)],
                         ids=["bf16", "qk_bf16_v_fp32", "qk_fp32_v_bf16", "fp32"])
def test_l2norm_option_gradients(K, layout, dtypes):
    """use_qk_l2norm_in_kernel: every gradient against float64, for q and k in the layouts a model passes (k read in
    place by grad_wy's chain rule, K <= 128), q / k and v of different dtypes (the kernels compute in the promoted
    one; the caller's k is read in its own) and K = 256 (the op layer's chain rule)."""
    from gated_delta import gated_delta_rule
    from gpu_helpers import _leaves

    qk_dtype, v_dtype = dtypes
    inp = make_inputs(2, 130, 2, 4, K, 64, v_dtype, options=True, seed=K)
    inp["q"], inp["k"] = inp["q"].to(qk_dtype), inp["k"].to(qk_dtype)
    d_o, d_ht = output_grads(inp, 2, seed=7)
    ref = reference(inp, d_o, d_ht)
    names, xs = _leaves(inp, True, torch.Tensor.clone)
    call = dict(xs, q=_qk_layout(xs["q"], layout), k=_qk_layout(xs["k"], layout))
    if layout != "dense":
        assert not call["k"].is_contiguous()
    o, ht = gated_delta_rule(**call, output_final_state=True)
    grads = torch.autograd.grad((o.float() * d_o.float()).sum() + (ht * d_ht).sum(), [xs[n] for n in names])
    ours = dict(o=o.detach(), ht=ht.detach(), **{"d" + n: g for n, g in zip(names, grads)})
    errs = {key: rel_err(ours[key], r) for key, r in ref.items()}
    print(f"\nK={K} {layout} {dtypes}: " + " ".join(f"{k}={v:.2e}" for k, v in errs.items()))
    assert ours["dk"].dtype == qk_dtype and ours["dq"].dtype == qk_dtype and ours["dv"].dtype == v_dtype
    compute = torch.promote_types(qk_dtype, v_dtype)
    for key, e in errs.items():
        # the compute dtype's tolerance, or a 16-bit result's (rounded once at the end)
        tol_o, tol_g = TOL[ours[key].dtype if ours[key].element_size() == 2 else compute]
        assert e <= (tol_o if key in ("o", "ht") else tol_g), f"{key}: relative error {e:.3e} ({errs})"
