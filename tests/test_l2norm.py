"""The L2 normalisation ops (l2norm_fwd, l2norm_bwd) that the gated delta rule applies to q and k with
use_qk_l2norm_in_kernel: values and gradients against the float64 formula, strided inputs, dtypes, errors. CPU tests
run everywhere; the CUDA ones are marked `gpu`.

Tolerances, relative L2 error against float64 (for dx relative to r dy, the size of the terms it is the difference
of): 1e-14 (float64), 1e-6 (float32 result), 4e-3 (bfloat16), 5e-4 (float16).
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from helpers import rel  # noqa: E402

ops = torch.ops.gated_delta
EPS = 1e-6
TOL = {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 4e-3, torch.float16: 5e-4}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def ref_fwd(x):
    x = x.double()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + EPS)


def ref_bwd(dy, x):
    x = x.double().requires_grad_()
    (g,) = torch.autograd.grad(ref_fwd(x), x, dy.double())
    return g


def bwd_err(dx, dy, x):
    """Error of dx = r (dy - y (y . dy)) against float64, relative to r dy: the size of the terms the formula
    subtracts, which cancel where D is small (D = 1: dx ~ eps dy / |x|^3)."""
    xd = x.double()
    r = torch.rsqrt((xd * xd).sum(-1, keepdim=True) + EPS)
    return (dx.double() - ref_bwd(dy, x)).norm().item() / (r * dy.double()).norm().item()


def layouts(gen, D, dtype, device):
    """x [..., D] as: contiguous [2, 5, 3, D]; a split of a fused projection's rows ([2, 5, 3 D + 8], columns 4..);
    leading dims out of order (three strides that do not merge); a broadcast (stride 0); a transpose (last dim not
    dense: copied first); six leading dims that merge into four (copied first)."""
    f64 = torch.float64
    base = torch.randn(2, 5, 3, D, generator=gen, dtype=f64)
    fused = torch.randn(2, 5, 3 * D + 8, generator=gen, dtype=f64)
    perm = torch.randn(3, 5, 2, D, generator=gen, dtype=f64)
    wide = torch.randn(2, 3, 2, 3, 2, 3, D, generator=gen, dtype=f64)
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return {
        "contiguous": cast(base),
        "fused_split": cast(fused)[..., 4:4 + 3 * D].unflatten(-1, (3, D)),
        "permuted": cast(perm).permute(2, 1, 0, 3),
        "broadcast": cast(base[:, :1]).expand(2, 5, 3, D),
        "transposed": cast(base.transpose(-1, -2).contiguous()).transpose(-1, -2),
        "four_groups": cast(wide)[:, :2, :, :2, :, :2],
    }


def check(x, out_dtype, device):
    gen = torch.Generator().manual_seed(x.shape[-1])
    y = ops.l2norm_fwd(x, EPS, out_dtype)
    want = out_dtype or x.dtype
    assert y.dtype == want and y.shape == x.shape and y.device == x.device and y.is_contiguous()
    # the result rounds the fp32 (fp64) value once: against the float64 formula of x as given
    err = rel(y.cpu(), ref_fwd(x.cpu()))
    assert err <= TOL[want], (err, want)
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(device=device, dtype=torch.float32)
    dx = ops.l2norm_bwd(dy, x, EPS, out_dtype)
    assert dx.dtype == want and dx.shape == x.shape and dx.device == x.device
    err = bwd_err(dx.cpu(), dy.cpu(), x.cpu())
    assert err <= TOL[want], (err, want)


@pytest.mark.parametrize("D", [1, 6, 64, 128, 130])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_l2norm_cpu(D, dtype):
    gen = torch.Generator().manual_seed(D)
    for name, x in layouts(gen, D, dtype, "cpu").items():
        check(x, None, "cpu")
    x = layouts(gen, D, dtype, "cpu")["contiguous"]
    check(x, torch.float32 if dtype != torch.float32 else torch.float64, "cpu")


def test_l2norm_cpu_autograd_and_opcheck():
    """l2norm_fwd is differentiable (its backward is l2norm_bwd): gradcheck in float64; opcheck of both ops (the
    backward op, not differentiable itself, without the autograd registration test)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(3, 4, 7, generator=gen, dtype=torch.float64)
    torch.autograd.gradcheck(lambda t: ops.l2norm_fwd(t, EPS), (x,))
    (g,) = torch.autograd.grad(ops.l2norm_fwd(x, EPS), x, dy)
    assert torch.equal(g, ops.l2norm_bwd(dy, x.detach(), EPS))
    assert bwd_err(g, dy, x.detach()) <= 1e-14
    torch.library.opcheck(ops.l2norm_fwd.default, (x, EPS, None))
    torch.library.opcheck(ops.l2norm_fwd.default, (x.detach().float()[:, ::2], EPS, torch.bfloat16))
    torch.library.opcheck(ops.l2norm_bwd.default, (dy, x.detach(), EPS, None),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_l2norm_python_function():
    """gated_delta.l2norm: the op under its Python name, differentiable, eps checked; the same values the gated delta
    rule's use_qk_l2norm_in_kernel gives its kernels (a call with the option equals one without it on q and k
    normalised by gd.l2norm)."""
    import gated_delta as gd

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 3, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    y = gd.l2norm(x)
    assert rel(y, ref_fwd(x)) <= 1e-14 and y.dtype == torch.float64
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    (g,) = torch.autograd.grad(y, x, dy)
    assert bwd_err(g, dy, x.detach()) <= 1e-14
    assert gd.l2norm(x.detach().float(), out_dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(TypeError, match="eps must be a Python number, got str"):
        gd.l2norm(x, eps="1e-6")
    q, k = torch.randn(1, 9, 2, 8, generator=gen), torch.randn(1, 9, 2, 8, generator=gen)
    v = torch.randn(1, 9, 4, 8, generator=gen)
    g_, beta = -torch.rand(1, 9, 4, generator=gen), torch.rand(1, 9, 4, generator=gen)
    o1, _ = gd.gated_delta_rule(q, k, v, g_, beta, use_qk_l2norm_in_kernel=True, algorithm="recurrent")
    o2, _ = gd.gated_delta_rule(gd.l2norm(q), gd.l2norm(k), v, g_, beta, algorithm="recurrent")
    assert torch.equal(o1, o2)


def test_l2norm_errors():
    x = torch.randn(2, 3)
    with pytest.raises(RuntimeError, match=r"x must have shape \[\.\.\., D\] with D >= 1, got \[2, 0\]"):
        ops.l2norm_fwd(torch.randn(2, 0), EPS)
    with pytest.raises(RuntimeError, match="x must be float64, float32, bfloat16 or float16, got Long"):
        ops.l2norm_fwd(torch.ones(2, 3, dtype=torch.long), EPS)
    with pytest.raises(RuntimeError, match="out_dtype must be float64, float32, bfloat16 or float16, got Int"):
        ops.l2norm_fwd(x, EPS, torch.int32)
    with pytest.raises(RuntimeError, match="eps must be a finite number >= 0, got -1"):
        ops.l2norm_fwd(x, -1.0)
    with pytest.raises(RuntimeError, match=r"dy must have the shape of x \[2, 3\], got \[3, 2\]"):
        ops.l2norm_bwd(torch.randn(3, 2), x, EPS)
    with pytest.raises(RuntimeError, match="dy must be float64, float32, bfloat16 or float16, got Long"):
        ops.l2norm_bwd(torch.ones(2, 3, dtype=torch.long), x, EPS)


# ---------------------------------------------------------------- CUDA

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("D", [1, 6, 64, 100, 128, 256, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_l2norm_cuda(D, dtype):
    gen = torch.Generator().manual_seed(D)
    for name, x in layouts(gen, D, dtype, "cuda").items():
        check(x, None, "cuda")
        if dtype != torch.float32:
            check(x, torch.float32, "cuda")  # (the kernels write fp32)
    x = layouts(gen, D, dtype, "cuda")["contiguous"]
    other = torch.float16 if dtype != torch.float16 else torch.bfloat16
    check(x, other, "cuda")  # (fp32, then one cast)
    # an x whose rows start one element off an aligned address (one element per access)
    check(torch.randn(4 * D + 1, generator=gen).to(device="cuda", dtype=dtype)[1:].view(4, D), None, "cuda")


@pytest.mark.gpu
@needs_cuda
def test_l2norm_cuda_matches_cpu_and_reruns():
    """The CUDA kernels against the CPU ops on the same fp32 input, and bitwise the same on a rerun; a CUDA x
    never runs on the CPU, fp64 is refused on CUDA, dy on another device is named."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(8, 33, 4, 128, generator=gen)
    dy = torch.randn(8, 33, 4, 128, generator=gen)
    xc, dyc = x.cuda(), dy.cuda()
    y, dx = ops.l2norm_fwd(xc, EPS), ops.l2norm_bwd(dyc, xc, EPS)
    assert rel(y.cpu(), ops.l2norm_fwd(x, EPS)) <= 1e-6
    assert rel(dx.cpu(), ops.l2norm_bwd(dy, x, EPS)) <= 1e-6
    assert torch.equal(y, ops.l2norm_fwd(xc, EPS)) and torch.equal(dx, ops.l2norm_bwd(dyc, xc, EPS))
    with pytest.raises(RuntimeError, match=r"x must be bfloat16, float16 or float32 on CUDA \(float64 is supported"):
        ops.l2norm_fwd(xc.double(), EPS)
    with pytest.raises(RuntimeError, match="out_dtype must be bfloat16, float16 or float32 on CUDA"):
        ops.l2norm_fwd(xc, EPS, torch.float64)
    with pytest.raises(RuntimeError, match="dy must be on the same device as x"):
        ops.l2norm_bwd(dy, xc, EPS)
    assert ops.l2norm_fwd(xc[:0], EPS).shape == (0, 33, 4, 128)
