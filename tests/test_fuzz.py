"""Property-based fuzzing of the op: random shapes, options and packed batches against the float64 reference loop,
bitwise determinism, NaN inputs, and random malformed arguments (each must raise an error naming the argument)."""
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gated_delta import ALGORITHMS, gated_delta_rule
from gated_delta.testing import bitwise_repeat_mismatches
from gated_delta.reference import gated_delta_rule_ref

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
ERRORS = (RuntimeError, ValueError, TypeError)
TENSOR_ARGS = ("q", "k", "v", "g", "beta")


def fuzz(examples):
    """Hypothesis settings of this file: `examples` cases, no per-case deadline (the machine may be busy)."""
    return settings(max_examples=examples, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------- random valid calls

# Head dims of the fuzzed calls: any small size on the CPU; the sizes the CUDA kernels take on CUDA.
HEAD_DIMS = {"cpu": st.integers(1, 12), "cuda": st.sampled_from([64, 128])}


@st.composite
def calls(draw, dtype=torch.float64, device="cpu", max_T=48):
    """A valid call: (tensor arguments, options). Small sizes, every option, and awkward values: g from 0 (no decay)
    down to -1e4 (a full reset), beta up to 2, lengths 0 and 1, odd chunk sizes, non-contiguous inputs."""
    H = draw(st.integers(1, 3))
    HV = H * draw(st.integers(1, 3))
    K = draw(HEAD_DIMS[device])
    V = draw(HEAD_DIMS[device])
    packed = draw(st.booleans())
    if packed:
        lengths = draw(st.lists(st.integers(0, 20), min_size=1, max_size=4))
        B, T = 1, sum(lengths)
    else:
        B = draw(st.integers(1, 3))
        T = draw(st.one_of(st.sampled_from([0, 1, 2, 3, 15, 16, 17, 33]), st.integers(0, max_T)))
    flags = draw(st.fixed_dictionaries({
        "use_qk_l2norm_in_kernel": st.booleans(), "use_beta_sigmoid_in_kernel": st.booleans(),
        "allow_neg_eigval": st.booleans(), "use_gate_in_kernel": st.booleans()}))
    options = dict(flags, algorithm=draw(st.sampled_from(ALGORITHMS)),
                   chunk_size=draw(st.one_of(st.sampled_from([1, 2, 3, 7, 16, 64]), st.integers(1, 70))),
                   output_final_state=draw(st.booleans()),
                   scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0))))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    real = torch.float64 if dtype == torch.float64 else torch.float32

    def randn(*size):
        return torch.randn(*size, generator=gen, dtype=real)

    def rand(*size):
        return torch.rand(*size, generator=gen, dtype=real)

    q = randn(B, T, H, K) * draw(st.sampled_from([1.0, 30.0]))
    k = randn(B, T, H, K)
    if not flags["use_qk_l2norm_in_kernel"]:  # |k| <= 1 keeps the eigenvalues of I - beta k k^T in [-1, 1]
        k = F.normalize(k, dim=-1) * (0.3 + 0.7 * rand(B, T, H, 1))
    v = randn(B, T, HV, V)
    pick = rand(B, T, HV)
    if flags["use_gate_in_kernel"]:  # g_raw: softplus far in its tails on both sides
        g = torch.where(pick < 0.15, 1e4, torch.where(pick < 0.3, -40.0, 3 * randn(B, T, HV)))
        tensors = dict(A_log=randn(HV), dt_bias=randn(HV))
    else:
        g = torch.where(pick < 0.15, 0.0, torch.where(pick < 0.3, -1e4, -5 * rand(B, T, HV)))
        tensors = {}
    beta = 4 * randn(B, T, HV) if flags["use_beta_sigmoid_in_kernel"] else 2 * rand(B, T, HV)
    tensors.update(q=q, k=k, v=v, g=g, beta=beta)
    N = B
    if packed:
        bounds = torch.tensor([0] + lengths).cumsum(0)
        options["cu_seqlens"] = bounds.to(draw(st.sampled_from([torch.int32, torch.int64])))
        if draw(st.booleans()):
            options["cu_seqlens_cpu"] = options["cu_seqlens"].clone()
        N = len(lengths)
    if draw(st.booleans()):
        tensors["initial_state"] = randn(N, HV, K, V)
    for name in ("q", "k", "v"):
        tensors[name] = tensors[name].to(dtype)
        if draw(st.booleans()):  # the same values with heads-major strides
            x = tensors[name]
            tensors[name] = x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    tensors = {n: x.to(device) for n, x in tensors.items()}
    if "cu_seqlens" in options:
        options["cu_seqlens"] = options["cu_seqlens"].to(device)
    return tensors, options


def reference(tensors, options):
    """The float64 reference loop on the CPU, with the same (rounded) inputs."""
    ref_tensors = {n: x.detach().double().cpu() for n, x in tensors.items()}
    ref_options = {n: (x.cpu() if isinstance(x, torch.Tensor) else x) for n, x in options.items()
                   if n not in ("algorithm", "chunk_size", "cu_seqlens_cpu")}
    return ref_tensors, ref_options


def assert_close(x, ref, rtol, name):
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    assert bool(torch.isfinite(x).all()), f"{name} is not finite"
    atol = rtol * max(1.0, ref.abs().max().item() if ref.numel() else 1.0)
    torch.testing.assert_close(x, ref, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------- agreement with the reference

@fuzz(60)
@given(call=calls())
def test_forward_matches_reference_float64(call):
    tensors, options = call
    o, ht = gated_delta_rule(**tensors, **options)
    ref_tensors, ref_options = reference(tensors, options)
    ref_o, ref_ht = gated_delta_rule_ref(**ref_tensors, **ref_options)
    assert o.shape == tensors["v"].shape and o.dtype == tensors["v"].dtype
    assert_close(o, ref_o, 1e-9, "o")
    if options["output_final_state"]:
        assert_close(ht, ref_ht, 1e-9, "final_state")
    else:
        assert ht is None


def _grads(fn, tensors, options, cotangent_seed):
    tensors = {n: x.detach().clone().requires_grad_(True) for n, x in tensors.items()}
    o, ht = fn(**tensors, **options)
    gen = torch.Generator().manual_seed(cotangent_seed)
    pairs = [(x, torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x)) for x in (o, ht) if x is not None]
    pairs = [(x, c) for x, c in pairs if x.requires_grad]
    if not pairs:  # nothing depends on the inputs (the reference loop on T = 0 without an initial state)
        return dict.fromkeys(tensors)
    outs, cots = zip(*pairs)
    grads = torch.autograd.grad(outs, list(tensors.values()), cots, allow_unused=True)
    return dict(zip(tensors, grads))


@fuzz(30)
@given(call=calls(max_T=24), seed=st.integers(0, 1000))
def test_gradients_match_reference_float64(call, seed):
    tensors, options = call
    grads = _grads(gated_delta_rule, tensors, options, seed)
    ref_grads = _grads(gated_delta_rule_ref, *reference(tensors, options), seed)
    for name, ref in ref_grads.items():
        got = grads[name]
        if ref is None:  # no path from this input to the outputs (T = 0 and no final state)
            assert got is None or not got.abs().sum() > 0, name
            continue
        assert got is not None and got.shape == tensors[name].shape, f"d{name} shape"
        assert got.dtype == tensors[name].dtype, f"d{name} dtype"
        assert_close(got, ref, 1e-8, f"d{name}")


# Tolerance (relative to the largest reference value) of lower-precision outputs. The CUDA kernels multiply fp32
# inputs as split bf16 pairs (about 16 bits of mantissa), hence a looser fp32 bound there.
LOW_PRECISION_RTOL = {("cpu", torch.float32): 2e-4, ("cuda", torch.float32): 1e-3,
                      ("cpu", torch.bfloat16): 3e-2, ("cuda", torch.bfloat16): 3e-2}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@fuzz(20)
@given(data=st.data())
def test_lower_precision_is_finite_and_close(device, dtype, data):
    rtol = LOW_PRECISION_RTOL[device, dtype]
    tensors, options = data.draw(calls(dtype=dtype, device=device))
    o, ht = gated_delta_rule(**tensors, **options)
    ref_tensors, ref_options = reference(tensors, options)
    ref_o, ref_ht = gated_delta_rule_ref(**ref_tensors, **ref_options)
    assert o.dtype == dtype
    assert_close(o, ref_o, rtol, "o")
    if ht is not None:
        assert ht.dtype == torch.float32
        assert_close(ht, ref_ht, rtol, "final_state")


# ---------------------------------------------------------------- determinism

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@fuzz(8)
@given(data=st.data())
def test_repeated_runs_are_bitwise_equal(device, algorithm, data):
    tensors, options = data.draw(calls(dtype=torch.float32, device=device))
    options = dict(options, algorithm=algorithm)

    def make():
        return {n: x.clone().requires_grad_(x.is_floating_point()) for n, x in tensors.items()}, options

    assert bitwise_repeat_mismatches(make) == []


# ---------------------------------------------------------------- NaN inputs

@fuzz(30)
@given(call=calls(), data=st.data())
def test_nan_input_raises_or_shows_in_the_outputs(call, data):
    """A NaN never crashes the op and never vanishes: the call raises an error naming the argument, or the NaN
    reaches the output or the final state."""
    tensors, options = call
    assume(tensors["v"].shape[1] > 0)
    options = dict(options, output_final_state=True)
    name = data.draw(st.sampled_from(sorted(tensors)))
    x = tensors[name].contiguous().clone()
    x.view(-1)[data.draw(st.integers(0, x.numel() - 1))] = float("nan")
    tensors[name] = x
    try:
        o, ht = gated_delta_rule(**tensors, **options)
    except ERRORS as err:
        assert re.search(rf"\b{name}\b", str(err)), str(err)
        return
    assert bool(torch.isnan(o).any()) or bool(torch.isnan(ht).any()), f"a NaN in {name} vanished"


# ---------------------------------------------------------------- malformed arguments

def _wrong_sizes(draw, shape, dims=None):
    """A shape of a different rank, or of the same rank with one of `dims` (default all) changed."""
    if draw(st.booleans()):
        rank = draw(st.integers(0, 5).filter(lambda r: r != len(shape)))
        return tuple(draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank)))
    i = draw(st.sampled_from(dims if dims is not None else range(len(shape))))
    size = draw(st.integers(0, 6).filter(lambda s: s != shape[i]))
    return tuple(shape[:i]) + (size,) + tuple(shape[i + 1:])


# The argument an error must name, for a wrong shape or dtype of each tensor argument. q sets B, T, H and K, so a
# q of the right rank with other sizes is reported against k; v sets HV, so its other HV is reported against g.
_NAMED = {"q": r"\bq\b|\bk\b", "k": r"\bk\b", "v": r"\bv\b|\bg\b", "g": r"\bg\b", "beta": r"\bbeta\b",
          "initial_state": r"\binitial_state\b"}


@st.composite
def malformed_calls(draw):
    """A valid packed or padded call with one argument corrupted: (tensors, options, a regex the error must match,
    naming the argument)."""
    tensors, options = draw(calls(max_T=12))
    B, T, H, K = tensors["q"].shape
    HV, V = tensors["v"].shape[2:]
    N = len(options["cu_seqlens"]) - 1 if "cu_seqlens" in options else B
    kind = draw(st.sampled_from(["shape", "dtype", "hv_group", "algorithm", "chunk_size", "gate", "cu_seqlens"]))
    if kind == "shape":
        name = draw(st.sampled_from(sorted(_NAMED)))
        expected = {"q": (B, T, H, K), "k": (B, T, H, K), "v": (B, T, HV, V), "g": (B, T, HV), "beta": (B, T, HV),
                    "initial_state": (N, HV, K, V)}[name]
        # V only has to agree with the initial state, and is not changed alone
        tensors[name] = torch.randn(_wrong_sizes(draw, expected, dims=(0, 1, 2) if name == "v" else None),
                                    dtype=torch.float64)
        return tensors, options, _NAMED[name]
    if kind == "dtype":
        name = draw(st.sampled_from(sorted(_NAMED)))
        dtype = draw(st.sampled_from([torch.int32, torch.int64, torch.bool, torch.complex64, torch.float32,
                                      torch.float16, torch.bfloat16]))
        # g, beta and initial_state take any float dtype, v any float dtype (it may differ from q's)
        assume(not (name in ("g", "beta", "initial_state", "v") and dtype.is_floating_point))
        x = tensors.get(name, torch.zeros(N, HV, K, V, dtype=torch.float64))
        tensors[name] = x.to(dtype) if not dtype.is_complex else torch.complex(x, x).to(dtype)
        return tensors, options, _NAMED[name]
    if kind == "hv_group":
        assume(H > 1)
        tensors["v"] = torch.randn(B, T, draw(st.integers(1, 3 * H).filter(lambda n: n % H != 0)), V,
                                   dtype=torch.float64)
        return tensors, options, r"\bv\b"
    if kind == "algorithm":
        options["algorithm"] = draw(st.text(max_size=8).filter(lambda s: s not in ALGORITHMS))
        return tensors, options, r"\balgorithm\b"
    if kind == "chunk_size":
        options["chunk_size"] = draw(st.one_of(st.integers(-100, 0), st.floats(0.5, 64.0), st.just(True)))
        return tensors, options, r"\bchunk_size\b"
    if kind == "gate":
        options["use_gate_in_kernel"] = True
        tensors.setdefault("A_log", torch.randn(HV, dtype=torch.float64))
        tensors.setdefault("dt_bias", torch.randn(HV, dtype=torch.float64))
        name = draw(st.sampled_from(["A_log", "dt_bias"]))
        how = draw(st.sampled_from(["missing", "shape", "dtype"]))
        assume(not (name == "dt_bias" and how == "missing"))  # dt_bias is optional
        if how == "missing":
            del tensors[name]
        elif how == "shape":
            tensors[name] = torch.randn(_wrong_sizes(draw, (HV,)), dtype=torch.float64)
        else:
            tensors[name] = tensors[name].to(draw(st.sampled_from([torch.int64, torch.bool])))
        return tensors, options, rf"\b{name}\b"
    # cu_seqlens: the initial state is dropped, as a changed number of sequences would be reported against it
    tensors.pop("initial_state", None)
    options.pop("cu_seqlens_cpu", None)
    how = draw(st.sampled_from(["B", "start", "decreasing", "end", "outside", "dtype", "rank", "empty", "cpu_copy"]))
    if how == "B":
        assume(B > 1)
        options["cu_seqlens"] = torch.tensor([0, T])
        return tensors, options, r"\bcu_seqlens\b"
    if "cu_seqlens" in options:
        bounds = options["cu_seqlens"].tolist()
    else:  # pack the first sequence alone
        tensors = {n: (x[:1] if n in TENSOR_ARGS else x) for n, x in tensors.items()}
        bounds = [0, T]
    dtype = torch.int64
    name = "cu_seqlens"
    if how == "start":
        bounds[0] = draw(st.integers(1, T + 3))
    elif how == "decreasing":
        bounds = bounds[:-1] + [T + draw(st.integers(1, 5)), T]
    elif how == "end":
        bounds[-1] = draw(st.integers(-3, T + 5).filter(lambda e: e != T))
    elif how == "outside":  # a value below 0 or above T between a valid start and end
        bounds = [0, draw(st.sampled_from([-5, -1, T + 1, T + 100, 2 ** 40])), T]
    elif how == "dtype":
        dtype = draw(st.sampled_from([torch.float32, torch.int16, torch.uint8, torch.bool]))
    elif how == "rank":
        bounds = [bounds]
    elif how == "empty":
        bounds = draw(st.sampled_from([[], [0]]))
    else:  # a host copy of another length
        options["cu_seqlens_cpu"] = torch.tensor(bounds + [T])
        name = "cu_seqlens_cpu"
    options["cu_seqlens"] = torch.tensor(bounds, dtype=dtype)
    return tensors, options, rf"\b{name}\b"


@fuzz(250)
@given(case=malformed_calls())
def test_malformed_arguments_raise_an_error_naming_the_argument(case):
    tensors, options, name_pattern = case
    with pytest.raises(ERRORS) as info:
        gated_delta_rule(**tensors, **options)
    assert re.search(name_pattern, str(info.value)), f"expected /{name_pattern}/ in: {info.value}"


def test_mismatched_device_on_the_meta_device_raises():
    """A meta tensor mixed into a CPU call."""
    base = dict(q=torch.randn(1, 4, 1, 2), k=torch.randn(1, 4, 1, 2), v=torch.randn(1, 4, 1, 2),
                g=-torch.rand(1, 4, 1), beta=torch.rand(1, 4, 1))
    for name in TENSOR_ARGS:
        args = dict(base, **{name: base[name].to("meta")})
        with pytest.raises(ERRORS, match=rf"\b{name}\b"):
            gated_delta_rule(**args)


@pytest.mark.gpu
def test_mismatched_device_cuda_and_cpu_raises():
    base = dict(q=torch.randn(1, 4, 1, 2), k=torch.randn(1, 4, 1, 2), v=torch.randn(1, 4, 1, 2),
                g=-torch.rand(1, 4, 1), beta=torch.rand(1, 4, 1))
    for where in ("cpu", "cuda"):
        other = "cuda" if where == "cpu" else "cpu"
        for name in TENSOR_ARGS[1:]:
            args = {n: x.to(where) for n, x in base.items()}
            args[name] = args[name].to(other)
            with pytest.raises(ERRORS, match=rf"\b{name}\b"):
                gated_delta_rule(**args)
        args = {n: x.to(where) for n, x in base.items()}
        with pytest.raises(ERRORS, match=r"\binitial_state\b"):
            gated_delta_rule(**args, initial_state=torch.zeros(1, 1, 2, 2, device=other))
