"""Tests of the state-pool decode (gated_delta.decode_pool): against the float64 reference token loop, on the CPU
and (marked `gpu`) on CUDA: packed and plain batches, mixed lengths, padded rows, grouped heads, the fused gate
and beta options, per-token slots with num_accepted_tokens (speculative decoding), strided pools, bad inputs and
the kernels' guards, opcheck and CUDA-graph capture."""
import pytest
import torch

import gated_delta as gd
from gated_delta.reference import gated_delta_rule_ref
from gated_delta.testing import warm_up_for_capture

ops = torch.ops.gated_delta
f64 = torch.float64
HAS_CUDA = torch.cuda.is_available()

OPTIONS = {
    "plain": {},
    "fused": {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True},
    "fused_neg": {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True,
                  "allow_neg_eigval": True},
}


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    den = b.norm().item()
    return (a - b).norm().item() / (den if den > 0 else 1.0)


def make_call(gen, lengths=None, B=None, T=None, H=2, HV=4, K=16, V=12, num_slots=16, options="fused",
              per_token=None, accepted=False, pad_rows=()):
    """Random inputs of one decode_pool call (float64, CPU). lengths: a packed batch (cu_seqlens); else B rows
    of T tokens. per_token: S slots per row ([N, S] state_indices). pad_rows: rows given a negative start slot."""
    if lengths is not None:
        B, T = 1, sum(lengths)
        N = len(lengths)
    else:
        N = B
    r = lambda *s: torch.randn(*s, generator=gen, dtype=f64)  # noqa: E731
    opts = dict(OPTIONS[options])
    k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    kw = dict(q=r(B, T, H, K), k=k, v=r(B, T, HV, V))
    if opts.get("use_gate_in_kernel"):
        kw["g"], kw["beta"] = r(B, T, HV), r(B, T, HV)
        opts["A_log"], opts["dt_bias"] = r(HV) * 0.5, r(HV) * 0.5
    else:
        kw["g"] = -torch.rand(B, T, HV, generator=gen, dtype=f64)
        kw["beta"] = torch.rand(B, T, HV, generator=gen, dtype=f64)
    S = per_token or 1
    slots = torch.randperm(num_slots, generator=gen)[: N * S]
    assert slots.numel() == N * S, "pool too small for the call"
    idx = slots.view(N, S) if per_token else slots.view(N)
    acc = None
    if accepted:
        acc = torch.randint(1, S + 1, (N,), generator=gen)
    for n in pad_rows:
        col = 0 if acc is None else int(acc[n]) - 1
        if per_token:
            idx[n, col] = -1 - n  # any negative number pads
        else:
            idx[n] = -1 - n
    kw["state_pool"] = r(num_slots, HV, K, V) * 0.3
    kw["state_indices"] = idx
    if lengths is not None:
        kw["cu_seqlens"] = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    if acc is not None:
        kw["num_accepted_tokens"] = acc
    kw.update(opts)
    return kw


def pool_ref(q, k, v, g, beta, state_pool, state_indices, cu_seqlens=None, num_accepted_tokens=None, scale=None,
             **opts):
    """The float64 reference loop, one token at a time: returns o and the pool after the call (new tensors)."""
    opts.pop("check_slots", None)
    pool = state_pool.detach().double().clone()
    B, T = q.shape[:2]
    o = torch.zeros(v.shape, dtype=f64)
    if cu_seqlens is None:
        bounds = [(n, n * T, n * T + T) for n in range(B)]
    else:
        cu = cu_seqlens.tolist()
        bounds = [(n, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    flat = lambda x: x.reshape(1, B * T, *x.shape[2:]).double()  # noqa: E731
    qf, kf, vf, gf, bf = (flat(x) for x in (q, k, v, g, beta))
    of = o.view(1, B * T, *o.shape[2:])
    idx = state_indices.long()
    for n, s, e in bounds:
        if e == s:
            continue
        col = 0 if num_accepted_tokens is None else int(num_accepted_tokens[n]) - 1
        r = int(idx[n, col]) if idx.dim() == 2 else int(idx[n])
        if r < 0:
            continue
        S = pool[r].clone()
        for t in range(s, e):
            sl = slice(t, t + 1)
            o_t, S = gated_delta_rule_ref(qf[:, sl], kf[:, sl], vf[:, sl], gf[:, sl], bf[:, sl], scale=scale,
                                          initial_state=S[None], output_final_state=True, **opts)
            S = S[0]
            of[:, sl] = o_t
            if idx.dim() == 2 and int(idx[n, t - s]) >= 0:
                pool[int(idx[n, t - s])] = S
        if idx.dim() == 1:
            pool[r] = S
    return o, pool


def run_pool(kw, device="cpu", dtype=f64, **extra):
    """decode_pool on a copy of kw's tensors (q, k, v, g, beta in dtype; the pool in its state dtype)."""
    sd = f64 if dtype == f64 else torch.float32
    args = {}
    for n, t in kw.items():
        if not isinstance(t, torch.Tensor):
            args[n] = t
        elif n in ("q", "k", "v", "g", "beta"):
            args[n] = t.to(device=device, dtype=dtype)
        elif n == "state_pool":
            args[n] = t.to(device=device, dtype=sd).clone()
        elif n in ("A_log", "dt_bias"):
            args[n] = t.to(device=device, dtype=sd)
        else:
            args[n] = t.to(device)
    o = gd.decode_pool(**args, **extra)
    return o, args["state_pool"]


def check_against_ref(kw, o, pool, tol):
    o_ref, pool_ref_ = pool_ref(**kw)
    assert rel(o, o_ref) <= tol, f"o: relative error {rel(o, o_ref):.2e} > {tol:.0e}"
    assert rel(pool, pool_ref_) <= tol, f"pool: relative error {rel(pool, pool_ref_):.2e} > {tol:.0e}"
    return o_ref, pool_ref_


# ---------------------------------------------------------------- CPU, against the reference

@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("H,HV", [(2, 2), (1, 3), (2, 4)])
def test_packed_mixed_lengths_match_reference(options, H, HV):
    gen = torch.Generator().manual_seed(sum(map(ord, options)) + 10 * H + HV)
    kw = make_call(gen, lengths=[1, 3, 17, 0, 1, 5], H=H, HV=HV, options=options, pad_rows=(4,))
    o, pool = run_pool(kw)
    o_ref, _ = check_against_ref(kw, o, pool, 1e-12)
    # the padded row (one token, at 21) has zero outputs; its pool slot and every unused slot are untouched
    assert o[0, 21].abs().max() == 0
    used = {int(s) for s in kw["state_indices"] if s >= 0}
    for s in set(range(kw["state_pool"].shape[0])) - used:
        assert torch.equal(pool[s], kw["state_pool"][s])
    assert o_ref.abs().sum() > 0


@pytest.mark.parametrize("T", [1, 3])
def test_plain_batch_matches_reference(T):
    gen = torch.Generator().manual_seed(10 + T)
    kw = make_call(gen, B=5, T=T, H=2, HV=4, pad_rows=(1,))
    o, pool = run_pool(kw)
    check_against_ref(kw, o, pool, 1e-12)
    assert o[1].abs().max() == 0


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_low_precision_inputs(dtype, tol):
    gen = torch.Generator().manual_seed(20)
    kw = make_call(gen, lengths=[2, 1, 9], H=2, HV=4, K=32, V=16)
    # the reference sees the inputs rounded to dtype, so only the arithmetic is compared
    kw.update({n: kw[n].to(dtype).double() for n in ("q", "k", "v", "g", "beta")})
    o, pool = run_pool(kw, dtype=dtype)
    assert o.dtype == dtype and pool.dtype == torch.float32
    check_against_ref(kw, o, pool, tol)


def test_per_token_slots_and_num_accepted_tokens():
    gen = torch.Generator().manual_seed(30)
    S = 4
    kw = make_call(gen, lengths=[4, 2, 4, 1, 3], H=2, HV=4, num_slots=24, per_token=S, accepted=True,
                   pad_rows=(3,))
    o, pool = run_pool(kw)
    check_against_ref(kw, o, pool, 1e-12)
    # every written slot holds the state after its token: check one row directly with the reference
    idx, acc, cu = kw["state_indices"], kw["num_accepted_tokens"], kw["cu_seqlens"]
    n = 0
    start = kw["state_pool"][int(idx[n, int(acc[n]) - 1])]
    for t in range(4):
        sl = slice(int(cu[n]), int(cu[n]) + t + 1)
        _, st = gated_delta_rule_ref(kw["q"][:, sl], kw["k"][:, sl], kw["v"][:, sl], kw["g"][:, sl],
                                     kw["beta"][:, sl], initial_state=start[None], output_final_state=True,
                                     **{o_: kw[o_] for o_ in OPTIONS["fused"]}, A_log=kw["A_log"],
                                     dt_bias=kw["dt_bias"])
        torch.testing.assert_close(pool[int(idx[n, t])], st[0], rtol=1e-12, atol=1e-12)


def test_speculative_decoding_continues_from_the_last_accepted_token():
    """Two calls: 3 draft tokens per sequence, then the verifier accepts a of them and the next call continues from
    the state after token a. Equals one reference run over the accepted tokens and the next call's tokens."""
    gen = torch.Generator().manual_seed(31)
    S, N, H, HV, K, V = 3, 3, 1, 2, 8, 8
    first = make_call(gen, B=N, T=S, H=H, HV=HV, K=K, V=V, num_slots=N * S, per_token=S)
    _, pool = run_pool(first)
    accepted = torch.tensor([1, 3, 2])
    second = make_call(gen, B=N, T=2, H=H, HV=HV, K=K, V=V, num_slots=N * S, per_token=S)
    second.update(state_pool=pool, state_indices=first["state_indices"], num_accepted_tokens=accepted)
    o2, pool2 = run_pool(second)
    fused = {n: first[n] for n in OPTIONS["fused"]}
    for n in range(N):
        a = int(accepted[n])
        # the state after the a accepted draft tokens, then the second call's tokens (with its own A_log, dt_bias)
        _, s_mid = gated_delta_rule_ref(first["q"][n:n + 1, :a], first["k"][n:n + 1, :a], first["v"][n:n + 1, :a],
                                        first["g"][n:n + 1, :a], first["beta"][n:n + 1, :a],
                                        initial_state=first["state_pool"][int(first["state_indices"][n, 0])][None],
                                        output_final_state=True, A_log=first["A_log"], dt_bias=first["dt_bias"],
                                        **fused)
        o_ref, s_ref = gated_delta_rule_ref(second["q"][n:n + 1], second["k"][n:n + 1], second["v"][n:n + 1],
                                            second["g"][n:n + 1], second["beta"][n:n + 1], initial_state=s_mid,
                                            output_final_state=True, A_log=second["A_log"],
                                            dt_bias=second["dt_bias"], **fused)
        torch.testing.assert_close(o2[n:n + 1], o_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(pool2[int(second["state_indices"][n, 1])], s_ref[0], rtol=1e-12, atol=1e-12)


def test_strided_pool_view_and_int32_int64_indices():
    gen = torch.Generator().manual_seed(40)
    kw = make_call(gen, lengths=[2, 5, 1], num_slots=8)
    big = torch.randn(8, 3, 4, 16, 12, dtype=f64)  # a larger cache; the pool is one of its layers
    big[:, 1] = kw["state_pool"]
    view = big[:, 1]
    assert not view.is_contiguous()
    o_ref, pool_ref_ = pool_ref(**kw)
    for idx_dtype in (torch.int32, torch.int64):
        b = big.clone()
        args = dict(kw, state_pool=b[:, 1], state_indices=kw["state_indices"].to(idx_dtype))
        o = gd.decode_pool(**args)
        assert rel(o, o_ref) < 1e-12 and rel(b[:, 1], pool_ref_) < 1e-12
        assert torch.equal(b[:, 0], big[:, 0]) and torch.equal(b[:, 2], big[:, 2])


def test_reruns_are_bitwise_identical():
    gen = torch.Generator().manual_seed(41)
    kw = make_call(gen, lengths=[3, 1, 7], K=32, V=32)
    o1, p1 = run_pool(kw, dtype=torch.float32)
    o2, p2 = run_pool(kw, dtype=torch.float32)
    assert torch.equal(o1, o2) and torch.equal(p1, p2)


def test_dt_bias_optional():
    gen = torch.Generator().manual_seed(42)
    kw = make_call(gen, lengths=[2, 3])
    kw.pop("dt_bias")
    o, pool = run_pool(kw)
    check_against_ref(dict(kw, dt_bias=torch.zeros(4, dtype=f64)), o, pool, 1e-12)


def test_opcheck():
    gen = torch.Generator().manual_seed(50)
    for kw in (make_call(gen, lengths=[1, 3, 2], K=8, V=4, pad_rows=(1,)),
               make_call(gen, B=2, T=2, K=8, V=4, options="plain"),
               make_call(gen, B=3, T=2, K=8, V=4, per_token=2, accepted=True, num_slots=8)):
        args = {n: (t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in kw.items()}
        ops_args = (args["q"], args["k"], args["v"], args["g"], args["beta"], args["state_pool"],
                    args["state_indices"], args.get("cu_seqlens"), args.get("num_accepted_tokens"), 0.4,
                    args.get("use_qk_l2norm_in_kernel", False), args.get("use_gate_in_kernel", False),
                    args.get("A_log"), args.get("dt_bias"), args.get("use_beta_sigmoid_in_kernel", False),
                    args.get("allow_neg_eigval", False), True)
        torch.library.opcheck(ops.decode_pool, ops_args)


# ---------------------------------------------------------------- bad inputs and the kernels' guards

def test_bad_arguments_raise_clear_errors():
    gen = torch.Generator().manual_seed(60)
    kw = make_call(gen, lengths=[2, 1, 3], num_slots=6)

    def call(**over):
        return gd.decode_pool(**{**kw, **{n: (t.clone() if isinstance(t, torch.Tensor) else t)
                                         for n, t in over.items()}})

    with pytest.raises(RuntimeError, match="must not share a slot between rows: slot 4 is used by rows 0 and 2"):
        call(state_indices=torch.tensor([4, 1, 4]))
    with pytest.raises(RuntimeError, match=r"state_indices must be < num_slots = 6 .* got 6 for row 1"):
        call(state_indices=torch.tensor([0, 6, 2]))
    with pytest.raises(RuntimeError, match=r"state_indices must have shape \[N\] or \[N, S\] with N = 3"):
        call(state_indices=torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="state_indices must be int32 or int64, got Float"):
        call(state_indices=torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(RuntimeError, match="state_pool must be Double"):
        call(state_pool=kw["state_pool"].float())
    with pytest.raises(RuntimeError, match=r"state_pool must have shape \[num_slots, HV, K, V\] = \[num_slots, 4, 16"):
        call(state_pool=kw["state_pool"].transpose(2, 3))
    with pytest.raises(RuntimeError, match="state_pool must have each slot's .* block contiguous"):
        call(state_pool=torch.zeros(6, 4, 12, 16, dtype=f64).transpose(2, 3))
    with pytest.raises(RuntimeError, match="cu_seqlens must end at T = 6"):
        call(cu_seqlens=torch.tensor([0, 2, 3, 5]))
    with pytest.raises(RuntimeError, match="cu_seqlens requires a packed batch with B = 1"):
        call(**{n: kw[n].expand(2, *kw[n].shape[1:]) for n in ("q", "k", "v", "g", "beta")})
    with pytest.raises(RuntimeError, match=r"num_accepted_tokens needs state_indices of shape \[N, S\]"):
        call(num_accepted_tokens=torch.tensor([1, 1, 1]))
    with pytest.raises(RuntimeError, match="k must have the dtype of q"):
        call(k=kw["k"].float())
    with pytest.raises(RuntimeError, match=r"g must have shape \[B, T, HV\] = \[1, 6, 4\]"):
        call(g=kw["g"][..., :2])
    with pytest.raises(RuntimeError, match="A_log is only used with use_gate_in_kernel=True"):
        call(use_gate_in_kernel=False)
    with pytest.raises(RuntimeError, match="use_gate_in_kernel=True requires A_log"):
        call(A_log=None)
    with pytest.raises(TypeError, match="check_slots must be a bool"):
        call(check_slots=1)

    spec = make_call(gen, lengths=[2, 3], num_slots=8, per_token=3, accepted=True)
    with pytest.raises(RuntimeError, match=r"num_accepted_tokens must be in \[1, S = 3\].* got num_accepted_tokens\[1\] = 4"):
        gd.decode_pool(**{**spec, "num_accepted_tokens": torch.tensor([1, 4])})
    with pytest.raises(RuntimeError, match="needs a slot for every token: row 1 has 3 tokens but S = 2"):
        gd.decode_pool(**{**spec, "state_indices": spec["state_indices"][:, :2].clone(),
                          "num_accepted_tokens": torch.tensor([1, 1])})
    with pytest.raises(RuntimeError, match="must not share a slot between rows: slot 7 is used by rows 0 and 1"):
        gd.decode_pool(**{**spec, "state_indices": torch.tensor([[0, 7, 1], [2, 3, 7]]),
                          "num_accepted_tokens": torch.tensor([1, 1])})
    with pytest.raises(RuntimeError, match=r"state_indices must be < num_slots = 8 \(or negative to skip a write\)"):
        gd.decode_pool(**{**spec, "state_indices": torch.tensor([[0, 9, 1], [2, 3, 4]]),
                          "num_accepted_tokens": torch.tensor([1, 1])})


def test_unchecked_out_of_range_rows_are_skipped_with_nan_outputs():
    """check_slots=False: no validation, but the kernel never leaves the pool: a row with an out-of-range start
    slot or num_accepted_tokens gets NaN outputs and touches nothing; out-of-range write slots are skipped."""
    gen = torch.Generator().manual_seed(70)
    kw = make_call(gen, lengths=[2, 1, 3], num_slots=6)
    pool = kw["state_pool"].clone()
    idx = torch.tensor([1, 1000, 3])
    o = gd.decode_pool(**{**kw, "state_pool": pool, "state_indices": idx}, check_slots=False)
    assert o[0, 2].isnan().all() and not o[0, :2].isnan().any() and not o[0, 3:].isnan().any()
    o_ref, pool_ref_ = pool_ref(**{**kw, "state_indices": torch.tensor([1, -1, 3])})
    assert rel(o[0, [0, 1, 3, 4, 5]], o_ref[0, [0, 1, 3, 4, 5]]) < 1e-12 and rel(pool, pool_ref_) < 1e-12

    spec = make_call(gen, lengths=[2, 3], num_slots=8, per_token=3, accepted=True)
    pool = spec["state_pool"].clone()
    o = gd.decode_pool(**{**spec, "state_pool": pool, "state_indices": torch.tensor([[0, 5, 1], [2, 99, 4]]),
                          "num_accepted_tokens": torch.tensor([0, 1])}, check_slots=False)
    assert o[0, :2].isnan().all() and not o[0, 2:].isnan().any()
    changed = [s for s in range(8) if not torch.equal(pool[s], spec["state_pool"][s])]
    assert changed == [2, 4]  # row 1 writes tokens 0 and 2; its token 1 names slot 99, skipped


# ---------------------------------------------------------------- CUDA

@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("K,V", [(16, 8), (64, 36), (128, 128), (256, 64)])
@pytest.mark.parametrize("options", ["plain", "fused_neg"])
def test_cuda_packed_matches_reference(K, V, options):
    gen = torch.Generator().manual_seed(K + V)
    kw = make_call(gen, lengths=[1, 3, 17, 0, 1, 65], H=2, HV=4, K=K, V=V, num_slots=10, options=options,
                   pad_rows=(4,))
    o, pool = run_pool(kw, device="cuda", dtype=torch.float32)
    check_against_ref(kw, o, pool, 2e-5)
    assert o[0, 21].abs().max().item() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_cuda_low_precision_plain_batch(dtype, tol):
    gen = torch.Generator().manual_seed(80)
    kw = make_call(gen, B=6, T=2, H=4, HV=8, K=128, V=128, num_slots=32, pad_rows=(2,))
    kw.update({n: kw[n].to(dtype).double() for n in ("q", "k", "v", "g", "beta")})
    o, pool = run_pool(kw, device="cuda", dtype=dtype)
    assert o.dtype == dtype
    check_against_ref(kw, o, pool, tol)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_per_token_slots_strided_pool_and_guards():
    gen = torch.Generator().manual_seed(81)
    kw = make_call(gen, lengths=[4, 2, 4, 1, 3], H=2, HV=4, K=64, V=64, num_slots=24, per_token=4, accepted=True,
                   pad_rows=(3,))
    o, pool = run_pool(kw, device="cuda", dtype=torch.float32)
    check_against_ref(kw, o, pool, 2e-5)
    # a strided view of a larger cache
    big = torch.zeros(24, 2, 4, 64, 64, device="cuda")
    big[:, 1] = kw["state_pool"].float().cuda()
    args = {n: (t.float().cuda() if isinstance(t, torch.Tensor) and t.is_floating_point() else
                t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    o2 = gd.decode_pool(**{**args, "state_pool": big[:, 1]})
    assert torch.equal(o2, o) and torch.equal(big[:, 1], pool) and big[:, 0].abs().max().item() == 0
    # unchecked out-of-range values: NaN rows, nothing written outside the pool
    p3 = args["state_pool"].clone()
    bad_idx = args["state_indices"].clone()
    bad_idx[0, int(kw["num_accepted_tokens"][0]) - 1] = 10 ** 6
    bad_idx[1, 1] = 10 ** 6
    o3 = gd.decode_pool(**{**args, "state_pool": p3, "state_indices": bad_idx}, check_slots=False)
    assert o3[0, :4].isnan().all() and not o3[0, 4:].isnan().any()
    with pytest.raises(RuntimeError, match="state_indices must be < num_slots = 24"):
        gd.decode_pool(**{**args, "state_pool": p3, "state_indices": bad_idx})
    dup = args["state_indices"].clone()
    dup[1, 0] = dup[0, 0]
    with pytest.raises(RuntimeError, match="must not share a slot between rows"):
        gd.decode_pool(**{**args, "state_indices": dup, "num_accepted_tokens": torch.ones(5, dtype=torch.long,
                                                                                            device="cuda")})


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")  # the capture that the check_slots error aborts
def test_cuda_graph_capture_and_replay():
    gen = torch.Generator().manual_seed(82)
    kw = make_call(gen, B=4, T=1, H=2, HV=4, K=128, V=128, num_slots=16, pad_rows=(3,))
    args = {n: (t.float().cuda() if isinstance(t, torch.Tensor) and t.is_floating_point() else
                t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    ref_pool = args["state_pool"].clone()
    refs = [gd.decode_pool(**{**args, "state_pool": ref_pool}) for _ in range(3)]
    pool = args["state_pool"].clone()
    run = lambda: gd.decode_pool(**{**args, "state_pool": pool}, check_slots=False)  # noqa: E731
    warm_up_for_capture(run, 1)
    pool.copy_(args["state_pool"])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for r in refs:
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, r)
    assert torch.equal(pool, ref_pool)
    # the host checks synchronise the stream, which capture does not allow: a clear error instead
    with pytest.raises(RuntimeError, match="check_slots=True .* pass check_slots=False under capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            gd.decode_pool(**{**args, "state_pool": pool})
