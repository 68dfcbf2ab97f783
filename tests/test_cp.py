"""Context parallelism over torch.distributed (gloo, on the CPU): the op and the layer, with the token dimension split
over 2, 3 and 4 processes, equal the single-process run (outputs, final states and every gradient: float64 to
1e-10, float32 to its rounding, bfloat16 within the single process's own error against float64); bad input raises a
clear error on every rank, never a hang.

Four processes are spawned once (starting them is the slow part) and run every case, on subgroups for 2 and 3
ranks; each worker returns rows (case, quantity, error, tolerance) that the tests check."""
import datetime
import json
import os
import re
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist

import gated_delta
from gated_delta.checklist.common import spawn_with_deadline
from helpers import OPTION_SETS, make_inputs, rel

TIMEOUT_S = 60  # of each collective
WORKERS_DEADLINE_S = 1200  # of the whole run of the workers
WORLD = 4
PER_TOKEN = ("q", "k", "v", "g", "beta")
REPLICATED = ("initial_state", "A_log", "dt_bias")
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}

# (name, sequence lengths (None: an equal-length batch), slice lengths per rank, B, options, algorithm)
LAYOUTS = {
    2: [
        ("one sequence crosses", [70, 150, 33], [130, 123], 1, "all", "chunk"),
        ("equal-length batch", None, [50, 77], 2, "plain", "chunk"),
        ("short slice of whole sequences, one empty", [30, 0, 20], [30, 20], 1, "gate", "recurrent"),
    ],
    3: [
        ("a sequence spans three ranks", [40, 300, 20, 25], [100, 150, 135], 1, "all", "chunk"),
        ("only whole sequences", [50, 20, 30, 80], [50, 50, 80], 1, "l2norm", "chunk"),
        ("an empty slice inside a sequence", [60, 90], [70, 0, 80], 1, "neg_eigval", "scan"),
        ("equal-length batch, a slice shorter than a chunk", None, [40, 30, 57], 2, "all", "chunk"),
    ],
    4: [
        ("mixed", [10, 20, 150, 30, 40, 7], [60, 25, 100, 72], 1, "all", "chunk"),
        ("equal-length batch", None, [20, 90, 5, 40], 3, "beta_sigmoid", "chunk"),
    ],
}

# (name, sequence lengths, slice lengths, B) of the layer cases
LAYER_LAYOUTS = {
    2: [("layer, varlen", [70, 50, 33], [100, 53], 1), ("layer, equal-length batch", None, [30, 41], 2)],
    3: [("layer, halo over a 2-token slice", [30, 100], [40, 2, 88], 1),
        ("layer, a sequence spans three ranks", [20, 150, 9], [60, 70, 49], 1)],
    4: [("layer, mixed", [10, 20, 90, 30], [35, 3, 80, 32], 1)],
}


def _bounds(slices, rank):
    s = sum(slices[:rank])
    return s, s + slices[rank]


def _all_reduce(t, group):
    """The sum over the ranks, in float64 (the shares of replicated tensors' gradients)."""
    t = t.double()
    dist.all_reduce(t, group=group)
    return t


def _op_grads(inputs, d_o, d_ht, group=None):
    """(o, final_state, {name: gradient}) of <o, d_o> + <final_state, d_ht>."""
    inputs = dict(inputs)
    names = [n for n in PER_TOKEN + REPLICATED if isinstance(inputs.get(n), torch.Tensor)]
    for n in names:
        inputs[n] = inputs[n].detach().clone().requires_grad_(True)
    o, ht = gated_delta.gated_delta_rule(**inputs, output_final_state=True, cp_group=group)
    loss = (o.double() * d_o).sum() + (ht.double() * d_ht).sum()
    grads = torch.autograd.grad(loss, [inputs[n] for n in names])
    return o.detach(), ht.detach(), dict(zip(names, grads))


def _local(inputs, s, e):
    return {n: (t[:, s:e] if n in PER_TOKEN else t) for n, t in inputs.items()}


def _op_case(rows, group, name, slices, lengths, B, options, algorithm, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    T = sum(slices)
    inputs = make_inputs(gen, T, B=B, dtype=dtype, lengths=lengths, options=OPTION_SETS[options])
    inputs.update(algorithm=algorithm, chunk_size=64)
    d_o = torch.randn(inputs["v"].shape, generator=gen, dtype=torch.float64)
    d_ht = torch.randn(inputs["initial_state"].shape, generator=gen, dtype=torch.float64)
    o1, ht1, g1 = _op_grads(inputs, d_o, d_ht)
    s, e = _bounds(slices, dist.get_rank(group))
    o, ht, g = _op_grads(_local(inputs, s, e), d_o[:, s:e], d_ht, group)
    got = {"o": o, "final_state": _all_reduce(ht, group)}
    want = {"o": o1[:, s:e], "final_state": ht1}
    for n in g:
        got["d" + n] = _all_reduce(g[n], group) if n in REPLICATED else g[n]
        want["d" + n] = g1[n] if n in REPLICATED else g1[n][:, s:e]
    label = f"{name} [{dtype}, {options}, {algorithm}]"
    if dtype in TOL:
        for q in got:
            rows.append((label, q, rel(got[q], want[q]), TOL[dtype]))
        return
    # 16-bit: the error against float64 within the single process's own (same rounded inputs, float64 reference)
    o64, ht64, g64 = _op_grads({n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
                                for n, t in inputs.items()}, d_o, d_ht)
    ref = {"o": o64[:, s:e], "final_state": ht64,
           **{"d" + n: (g64[n] if n in REPLICATED else g64[n][:, s:e]) for n in g64}}
    for q in got:
        # A replicated tensor's gradient is a sum over the ranks of shares each rounded to 16 bits: one more rounding
        # (unit roundoff u) per rank.
        u = torch.finfo(dtype).eps / 2
        slack = u * dist.get_world_size(group) if q[1:] in REPLICATED else 0.0
        rows.append((label, q + f" (error vs float64, against one process's error {rel(want[q], ref[q]):.3g}"
                     f" x 1.1 + {slack:.3g})", rel(got[q], ref[q]), 1.1 * rel(want[q], ref[q]) + slack))


def _determinism_case(rows, group):
    name, lengths, slices, B, options, algorithm = LAYOUTS[dist.get_world_size(group)][0]
    gen = torch.Generator().manual_seed(7)
    inputs = make_inputs(gen, sum(slices), B=B, dtype=torch.float32, lengths=lengths, options=OPTION_SETS[options])
    s, e = _bounds(slices, dist.get_rank(group))
    d_o = torch.randn(inputs["v"].shape, generator=gen, dtype=torch.float64)[:, s:e]
    d_ht = torch.randn(inputs["initial_state"].shape, generator=gen, dtype=torch.float64)
    runs = [_op_grads(_local(inputs, s, e), d_o, d_ht, group) for _ in range(2)]
    (o_a, h_a, g_a), (o_b, h_b, g_b) = runs
    same = torch.equal(o_a, o_b) and torch.equal(h_a, h_b) and all(torch.equal(g_a[n], g_b[n]) for n in g_a)
    rows.append((f"{name}: rerun", "bitwise identical", 0.0 if same else 1.0, 0.0))


def _layer_case(rows, group, name, slices, lengths, B, seed):
    torch.manual_seed(seed)
    kw = dict(hidden_size=32, num_heads=2, num_v_heads=4, head_dim=8, conv_size=4, conv_bias=True,
              dtype=torch.float64)
    layer = gated_delta.GatedDeltaNet(**kw)
    cp_layer = gated_delta.GatedDeltaNet(**kw, cp_group=group)
    cp_layer.load_state_dict(layer.state_dict())
    gen = torch.Generator().manual_seed(seed)
    T = sum(slices)
    x = torch.randn(B, T, 32, generator=gen, dtype=torch.float64)
    dy = torch.randn(B, T, 32, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist()) if lengths is not None else None
    s, e = _bounds(slices, dist.get_rank(group))

    def run(mod, x, dy):
        x = x.clone().requires_grad_(True)
        y, _ = mod(x, cu_seqlens=cu)
        (y * dy).sum().backward()
        return y.detach(), x.grad, {n: p.grad for n, p in mod.named_parameters()}

    y1, dx1, gp1 = run(layer, x, dy)
    y, dx, gp = run(cp_layer, x[:, s:e], dy[:, s:e])
    rows.append((name, "y", rel(y, y1[:, s:e]), 1e-10))
    rows.append((name, "dx", rel(dx, dx1[:, s:e]), 1e-10))
    for n in gp1:  # A_log and dt_bias are float32 parameters
        rows.append((name, "d" + n, rel(_all_reduce(gp[n], group), gp1[n]), TOL[gp1[n].dtype]))


def _compile_case(rows, group):
    """torch.compile of a function around the CP layer (graph breaks at the collectives) equals eager."""
    torch.manual_seed(5)
    layer = gated_delta.GatedDeltaNet(32, 2, dtype=torch.float64, cp_group=group)
    _, lengths, slices, _ = LAYER_LAYOUTS[dist.get_world_size(group)][0]
    x = torch.randn(1, sum(slices), 32, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    s, e = _bounds(slices, dist.get_rank(group))

    def step(fn):
        xs = x[:, s:e].clone().requires_grad_(True)
        y = fn(xs)
        y.square().sum().backward()
        return y.detach(), xs.grad

    def f(x):
        return layer(x, cu_seqlens=cu)[0]

    (y0, dx0), (y1, dx1) = step(f), step(torch.compile(f, backend="aot_eager"))
    rows.append(("torch.compile (aot_eager) of the CP layer", "y", rel(y1, y0), 1e-12))
    rows.append(("torch.compile (aot_eager) of the CP layer", "dx", rel(dx1, dx0), 1e-12))


def _expect_error(rows, name, exc_type, words, fn):
    try:
        fn()
    except exc_type as exc:
        ok = all(w in str(exc) for w in words)
        rows.append((name, f"raises {exc_type.__name__} naming {words}" + ("" if ok else f"; got: {exc}"),
                     0.0 if ok else 1.0, 0.0))
        return
    except Exception as exc:  # noqa: BLE001 (reported as a failure row)
        rows.append((name, f"raises {exc_type.__name__}; got {type(exc).__name__}: {exc}", 1.0, 0.0))
        return
    rows.append((name, f"raises {exc_type.__name__}; nothing raised", 1.0, 0.0))


def _bad_input_cases(rows, group, singles):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    gen = torch.Generator().manual_seed(3)
    lengths, slices = [40, 60, 30], [70, 60] + [0] * (world - 2)
    inputs = make_inputs(gen, 130, lengths=lengths, dtype=torch.float64)
    s, e = _bounds(slices, rank)
    local = _local(inputs, s, e)
    last = 1  # a rank with tokens (the last may hold none)

    def call(**over):
        return gated_delta.gated_delta_rule(**{**local, **over}, output_final_state=True, cp_group=group)

    bad_v = local["v"][..., :12] if rank == last else local["v"]
    _expect_error(rows, "V differs on one rank", ValueError, ["same V"],
                  lambda: call(v=bad_v, initial_state=local["initial_state"][..., :bad_v.shape[-1]]))
    _expect_error(rows, "an option differs on one rank", ValueError, ["use_qk_l2norm_in_kernel"],
                  lambda: call(use_qk_l2norm_in_kernel=rank == 0))
    _expect_error(rows, "cu_seqlens differ", ValueError, ["cu_seqlens"],
                  lambda: call(cu_seqlens=torch.tensor([0, 40, 100, 130]) if rank == 0
                               else torch.tensor([0, 50, 100, 130])))
    _expect_error(rows, "cu_seqlens do not cover the slices", ValueError, ["cu_seqlens[-1]"],
                  lambda: call(cu_seqlens=torch.tensor([0, 40, 100, 131])))
    bad_g = local["g"][..., :3] if rank == last else local["g"]
    expected = ["g must have shape"] if rank == last else [f"rank(s) [{last}]", "failed"]
    _expect_error(rows, "g has a bad shape on one rank (the op's own check)", RuntimeError, expected,
                  lambda: call(g=bad_g))
    bad_h0 = local["initial_state"][:2] if rank == 0 else local["initial_state"]
    expected = ["initial_state must have shape"] if rank == 0 else ["rank(s) [0]", "failed"]
    _expect_error(rows, "initial_state has a bad shape on rank 0", ValueError if rank == 0 else RuntimeError,
                  expected, lambda: call(initial_state=bad_h0))
    _expect_error(rows, "gradients needed on one rank only", ValueError, ["need for gradients"],
                  lambda: call(q=local["q"].clone().requires_grad_(rank == 0)))
    layer = gated_delta.GatedDeltaNet(32, 2, dtype=torch.float64, cp_group=group)
    _expect_error(rows, "the layer with a cache", ValueError, ["without a cache"],
                  lambda: layer(torch.zeros(1, 4, 32, dtype=torch.float64), use_cache=True))

    # The group is still usable after every error above, and a group of one is the plain op.
    o1, ht1 = gated_delta.gated_delta_rule(**inputs, output_final_state=True)
    o, ht = gated_delta.gated_delta_rule(**inputs, output_final_state=True, cp_group=singles[rank])
    rows.append(("a group of one", "o", rel(o, o1), 1e-12))
    rows.append(("a group of one", "final_state", rel(ht, ht1), 1e-12))


def _cases(rows, group, singles):
    world = dist.get_world_size(group)
    for i, (name, lengths, slices, B, options, algorithm) in enumerate(LAYOUTS[world]):
        _op_case(rows, group, name, slices, lengths, B, options, algorithm, torch.float64, 100 * world + i)
    name, lengths, slices, B, options, algorithm = LAYOUTS[world][0]
    for dtype in (torch.float32, torch.bfloat16):
        _op_case(rows, group, name, slices, lengths, B, options, algorithm, dtype, 100 * world + 50)
    _determinism_case(rows, group)
    for i, (name, lengths, slices, B) in enumerate(LAYER_LAYOUTS[world]):
        _layer_case(rows, group, name, slices, lengths, B, 100 * world + 70 + i)
    if world == 2:
        _compile_case(rows, group)
    if world <= 3:
        _bad_input_cases(rows, group, singles)


def _worker(rank, store_file, out_dir):
    """One of WORLD processes: the cases of 2 and 3 ranks on subgroups of the first ranks, then those of 4 on the
    whole group, then two CP groups of 2 side by side (context parallelism inside data parallelism)."""
    torch.set_num_threads(1)
    # rendezvous through a file in the test's directory: no TCP port to pick and lose to another process
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    groups = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2]), 4: dist.group.WORLD}
    singles = [dist.new_group([r]) for r in range(WORLD)]
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    rows = []
    for world, group in groups.items():
        if rank < world:
            try:
                _cases(rows, group, singles)
            except Exception:  # noqa: BLE001 (reported to the test)
                rows.append((world, "worker", "exception:\n" + traceback.format_exc(), 1.0, 0.0))
        rows = [r if len(r) == 5 else (world, *r) for r in rows]
        dist.barrier()
    try:  # data parallel over the pairs: each pair runs its own layer case on its own data
        name, lengths, slices, B = LAYER_LAYOUTS[2][0]
        pair_rows = []
        _layer_case(pair_rows, pairs[rank // 2], f"{name}, CP pair {rank // 2} of two", slices, lengths, B,
                    1000 + rank // 2)
        rows += [("dp", *r) for r in pair_rows]
    except Exception:  # noqa: BLE001
        rows.append(("dp", "worker", "exception:\n" + traceback.format_exc(), 1.0, 0.0))
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)


@pytest.mark.parametrize("options", ["plain", "all"])
def test_map_pass_is_the_affine_map(options):
    """The map pass of a piece (joined and as two calls) gives [B | A] and o_lin with, for any entering state X:
    final state = A X + B and o(X) = o(0) + X^T o_lin, as the op run from X."""
    from gated_delta.cp import _map_pass, _Options

    gen = torch.Generator().manual_seed(11)
    inputs = make_inputs(gen, 150, B=2, options=OPTION_SETS[options], initial_state=False)
    q, k, v, g, beta = (inputs.pop(n) for n in PER_TOKEN)
    M, T, HV, V = v.shape
    K = q.shape[-1]
    opt = _Options(K ** -0.5, *(bool(inputs.get(n, False)) for n in (
        "use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "use_gate_in_kernel")),
        "chunk", 64)
    A_log, dt_bias = inputs.get("A_log"), inputs.get("dt_bias")
    eye = torch.eye(K, dtype=torch.float64).expand(M, HV, K, K)
    X = torch.randn(M, HV, K, V, generator=gen, dtype=torch.float64)
    o_x, h_x = gated_delta.gated_delta_rule(q, k, v, g, beta, initial_state=X, output_final_state=True,
                                            algorithm="chunk", **{n: t for n, t in inputs.items()})
    for joined in (True, False):
        o0, o_lin, state = _map_pass(opt, q, k, v, g, beta, A_log, dt_bias, eye, joined)
        B, A = state[..., :V], state[..., V:]
        assert rel(A @ X + B, h_x) < 1e-12
        assert rel(o0 + (o_lin.transpose(1, 2) @ X).transpose(1, 2), o_x) < 1e-12


@pytest.fixture(scope="module")
def cp_rows():
    """Every row of every worker: (world or "dp", rank, case, quantity, error, tolerance)."""
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_with_deadline(_worker, (os.path.join(out_dir, "store"), out_dir), WORLD, WORKERS_DEADLINE_S)
        rows = []
        for r in range(WORLD):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                rows += [(w, r, *row) for w, *row in json.load(f)]
    return rows


def _check(rows, min_rows):
    assert len(rows) >= min_rows
    bad = [f"rank {r}: {case}: {what}: {err:.3g} > {tol:.3g}" for _, r, case, what, err, tol in rows
           if not err <= tol]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_cp_equals_one_process(cp_rows, world):
    _check([row for row in cp_rows if row[0] == world], 20 * world)


def test_cp_groups_side_by_side(cp_rows):
    _check([row for row in cp_rows if row[0] == "dp"], 4 * 10)


@pytest.mark.parametrize("extra, message", [
    ({"gk": "K"}, "gk and gv (per-key / per-value decays) are not supported with cp_group"),
    ({"gv": "V"}, "gk and gv (per-key / per-value decays) are not supported with cp_group"),
    ({"state_v_first": True}, "state_v_first=True is not supported with cp_group"),
])
def test_cp_rejects_what_it_cannot_compose(extra, message):
    """Options the context-parallel run does not compose raise before any collective: no process group is needed
    to see the error, and nothing is silently dropped."""
    x = make_inputs(torch.Generator().manual_seed(3), T=9)
    B, T, HV = x["v"].shape[:3]
    sizes = {"K": x["q"].shape[-1], "V": x["v"].shape[-1]}
    extra = {k: (torch.zeros(B, T, HV, sizes[v]) if isinstance(v, str) else v) for k, v in extra.items()}
    if "state_v_first" in extra:
        x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
    with pytest.raises(ValueError, match=re.escape(message)):
        gated_delta.gated_delta_rule(**x, cp_group=object(), **extra)
