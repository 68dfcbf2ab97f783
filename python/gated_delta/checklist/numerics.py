"""Numerical checks: gradients against float64, bitwise determinism, mixed precision at extreme inputs."""
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn as nn

import gated_delta
from gated_delta import ALGORITHMS
from gated_delta.reference import gated_delta_rule_ref

from ..testing import bitwise_equal, bitwise_repeat_mismatches, fwd_bwd
from .common import (FAIL, PASS, SKIP, Config, Result, Shape, md_table, op_inputs, relative_error,
                     save_plot, state_dtype, torch_threads)

# Largest relative error ||x - ref|| / ||ref|| accepted for the output and each gradient, by input dtype.
GRAD_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 2e-2, torch.float16: 5e-3}

# Every pre-processing fused in the kernel: the second option set of the numerical checks (beside plain inputs).
FUSED = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
             use_gate_in_kernel=True)


def full_inputs(shape: Shape, dtype: torch.dtype, device: str, fused: bool, seed: int = 0,
                n_seqs: int = 0) -> Tuple[Dict[str, torch.Tensor], dict]:
    """Inputs and options of a call that exercises every argument: initial state, final state, and either plain
    (unit-norm k, raw g and beta) or fused pre-processing (gate, beta logits, q/k L2 norm in the kernel).
    n_seqs > 0 packs the batch (B must be 1) into that many sequences of varied lengths, one of them empty."""
    gen = torch.Generator().manual_seed(seed)
    inputs = op_inputs(shape, dtype, device, requires_grad=False, seed=seed)
    options = dict(output_final_state=True, chunk_size=16)
    N = shape.B
    if n_seqs:
        assert shape.B == 1
        cuts = torch.randint(0, shape.T + 1, (n_seqs - 1,), generator=gen).sort().values.tolist()
        bounds = [0] + cuts + [shape.T]
        if n_seqs > 1:
            bounds[1] = 0  # the first sequence is empty
        options["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32, device=device)
        N = n_seqs
    if fused:
        options.update(FUSED)
        sd = dict(device=device, dtype=state_dtype(dtype))
        inputs["g"] = torch.randn(shape.B, shape.T, shape.HV, generator=gen).to(**sd)
        inputs["beta"] = torch.randn(shape.B, shape.T, shape.HV, generator=gen).mul(2).to(**sd)
        inputs["A_log"] = torch.rand(shape.HV, generator=gen).to(**sd)
        inputs["dt_bias"] = torch.randn(shape.HV, generator=gen).to(**sd)
    else:
        inputs["k"] = torch.nn.functional.normalize(inputs["k"].double(), dim=-1).to(dtype)
    inputs["initial_state"] = torch.randn(N, shape.HV, shape.K, shape.V, generator=gen).mul(0.5).to(
        device=device, dtype=state_dtype(dtype))
    for x in inputs.values():
        x.requires_grad_(True)
    return inputs, options


def float64_reference(inputs, options, seed: int = 1) -> dict:
    """Random cotangents (rounded to the output dtypes) and the float64 reference loop's output, final state and
    gradients on the CPU, from the same (already rounded) inputs."""
    gen = torch.Generator().manual_seed(seed)
    d_o = torch.randn(inputs["v"].shape, generator=gen).to(inputs["v"].dtype)
    d_ht = torch.randn(inputs["initial_state"].shape, generator=gen).to(inputs["initial_state"].dtype)
    ref_inputs = {k: x.detach().double().cpu().requires_grad_(True) for k, x in inputs.items()}
    ref_options = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in options.items()
                   if k not in ("chunk_size", "algorithm")}
    o, ht = gated_delta_rule_ref(**ref_inputs, **ref_options)
    torch.autograd.backward([o, ht], [d_o.double(), d_ht.double()])
    return dict(d_o=d_o, d_ht=d_ht, o=o, final_state=ht, grads={k: x.grad for k, x in ref_inputs.items()})


def compare_to_reference(inputs, options, ref: dict) -> Dict[str, float]:
    """Relative errors of the op's output, final state and every gradient against float64_reference()."""
    o, ht = gated_delta.gated_delta_rule(**inputs, **options)
    grads = torch.autograd.grad([o, ht], list(inputs.values()), [ref["d_o"].to(o.device), ref["d_ht"].to(ht.device)])
    errors = {"o": relative_error(o, ref["o"]), "final_state": relative_error(ht, ref["final_state"])}
    for name, grad in zip(inputs, grads):
        errors["d" + name] = relative_error(grad, ref["grads"][name])
    return errors


def gradcheck_float64(shape: Shape, algorithm: str, fused: bool, n_seqs: int = 0, fast_mode: bool = False) -> bool:
    """torch.autograd.gradcheck of the op in float64 on the CPU, every input and the final state (fast_mode: against
    random projections of the Jacobian instead of all of it)."""
    inputs, options = full_inputs(shape, torch.float64, "cpu", fused, n_seqs=n_seqs)
    options = dict(options, algorithm=algorithm, chunk_size=3)
    names = list(inputs)

    def fn(*xs):
        return gated_delta.gated_delta_rule(**dict(zip(names, xs)), **options)

    return torch.autograd.gradcheck(fn, tuple(inputs.values()), eps=1e-6, atol=1e-6, rtol=1e-5,
                                    fast_mode=fast_mode)


def check_grads(cfg: Config) -> Result:
    failures: List[str] = []
    # (a) gradcheck in float64 on the CPU: every algorithm, plain and fused options, padded and packed batches.
    small = Shape(B=2, T=7, H=1, HV=2, K=3, V=4)
    packed = Shape(B=1, T=9, H=1, HV=2, K=3, V=2)
    gradchecks = 0
    for algorithm in ALGORITHMS:
        for fused in (False, True):
            for shape, n_seqs in ((small, 0), (packed, 3)):
                try:
                    gradcheck_float64(shape, algorithm, fused, n_seqs, fast_mode=cfg.quick)
                    gradchecks += 1
                except Exception as err:  # noqa: BLE001 -- a gradcheck failure is reported, not raised
                    first = str(err).strip().splitlines()[0][:200]
                    failures.append(f"gradcheck {algorithm} {'fused' if fused else 'plain'} "
                                    f"{'packed' if n_seqs else 'batch'}: {first}")

    # (b) every gradient on the device against the float64 reference loop.
    if cfg.cuda:
        shape = Shape(B=2, T=67 if cfg.quick else 300, H=2, HV=4, K=64 if cfg.quick else 128,
                      V=64 if cfg.quick else 128)
        dtypes = [torch.float32, torch.bfloat16, torch.float16]
    else:
        shape = Shape(B=2, T=67, H=1, HV=2, K=16, V=16)
        dtypes = [torch.float32, torch.bfloat16]
    rows, worst = [], {}
    columns = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state", "dA_log", "ddt_bias"]
    for dtype in dtypes:
        for fused in (False, True):
            inputs, options = full_inputs(shape, dtype, cfg.device, fused)
            ref = float64_reference(inputs, options)
            for algorithm in ALGORITHMS:
                errors = compare_to_reference(inputs, dict(options, algorithm=algorithm), ref)
                tol = GRAD_TOLERANCE[dtype]
                name = f"{str(dtype).replace('torch.', '')} {algorithm} {'fused' if fused else 'plain'}"
                bad = {k: e for k, e in errors.items() if not e <= tol}
                if bad:
                    failures.append(f"{name}: " + ", ".join(f"{k} {e:.1e} > {tol:g}" for k, e in bad.items()))
                key = str(dtype).replace("torch.", "")
                worst[key] = max(worst.get(key, 0.0), max(errors.values()))
                rows.append([name] + [f"{errors[k]:.1e}" if k in errors else "-" for k in columns])
    header = ["dtype / algorithm / options"] + columns
    status = FAIL if failures else PASS
    summary = (f"gradcheck{' (fast)' if cfg.quick else ''} float64 CPU {gradchecks}/{len(ALGORITHMS) * 4} ok; "
               f"max rel err vs float64 on {cfg.device}: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    if failures:
        summary += f"; {len(failures)} failure(s): {failures[0]}"
    details = (f"(a) `torch.autograd.gradcheck`{' (fast mode)' if cfg.quick else ''} in float64 on the CPU, shapes "
               f"{small} and packed {packed} "
               f"(3 sequences), chunk_size 3, each algorithm with plain and fused options.\n\n"
               f"(b) Relative error ||x - ref|| / ||ref|| of the output, final state and every gradient on "
               f"{cfg.device}, {shape}, against the float64 reference loop fed the same rounded inputs; "
               f"tolerances " + ", ".join(f"{str(d).replace('torch.', '')} {t:g}" for d, t in GRAD_TOLERANCE.items())
               + ".\n\n" + md_table(header, rows)
               + ("\nFailures:\n\n" + "".join(f"- {f}\n" for f in failures) if failures else ""))
    return Result("grads", status, summary, details)


def check_determinism(cfg: Config) -> Result:
    if cfg.cuda:
        shape = Shape(B=1, T=1000 if cfg.quick else 4099, H=2, HV=4, K=128, V=128)
        dtype = torch.bfloat16
    else:
        shape = Shape(B=1, T=131, H=1, HV=2, K=16, V=16)
        dtype = torch.float32
    failures, checked = [], 0
    for algorithm in ALGORITHMS:
        for fused, n_seqs in ((False, 0), (True, 3)):
            def make(fused=fused, n_seqs=n_seqs, algorithm=algorithm):
                inputs, options = full_inputs(shape, dtype, cfg.device, fused, n_seqs=n_seqs)
                return inputs, dict(options, algorithm=algorithm, chunk_size=64)

            bad = bitwise_repeat_mismatches(make)
            checked += 1
            if bad:
                failures.append(f"{algorithm} {'fused packed' if fused else 'plain'}: {', '.join(bad)} differ")
    threads_note = ""
    if not cfg.cuda and torch.get_num_threads() > 1:
        # Informational: the result across thread counts (not required, reported).
        def make_fused():
            inputs, options = full_inputs(shape, dtype, "cpu", True, n_seqs=3)
            return inputs, dict(options, algorithm="auto")

        n = torch.get_num_threads()
        one = _fwd_bwd_with_threads(1, make_fused)
        many = _fwd_bwd_with_threads(n, make_fused)
        same = all(bitwise_equal(one[k], many[k]) for k in one)
        threads_note = f"; 1 vs {n} threads {'bitwise equal' if same else 'differ (not required)'}"
    status = FAIL if failures else PASS
    summary = (f"{checked} configurations x 3 runs ({', '.join(ALGORITHMS)}; plain and fused+packed), {shape}, "
               f"{str(dtype).replace('torch.', '')}: "
               + ("all bitwise equal" if not failures else "; ".join(failures)) + threads_note)
    details = ("Forward and backward run three times on the same inputs (initial state, final state, chunk size "
               "64); the output, final state and every gradient must be bitwise equal to the first run.\n")
    return Result("determinism", status, summary, details)


def _fwd_bwd_with_threads(n, make):
    with torch_threads(n):
        inputs, options = make()
        o, ht, grads = fwd_bwd(inputs, **options)
        return dict(o=o.detach(), final_state=ht.detach(), **grads)


# ---- mixed precision ----

class _AmpMixer(nn.Module):
    """Projections (run in the autocast dtype) around the op, fed extreme but valid inputs."""

    def __init__(self, d: int, H: int, HV: int, K: int, V: int):
        super().__init__()
        self.H, self.HV, self.K, self.V = H, HV, K, V
        self.q = nn.Linear(d, H * K)
        self.k = nn.Linear(d, H * K)
        self.v = nn.Linear(d, HV * V)
        self.out = nn.Linear(HV * V, d)
        self.A_log = nn.Parameter(torch.zeros(HV))
        self.dt_bias = nn.Parameter(torch.zeros(HV))

    def forward(self, x, q_mag, v_mag, g, beta, fused: bool):
        B, T, _ = x.shape
        q = (self.q(x) * q_mag).view(B, T, self.H, self.K)
        k = (self.k(x) * q_mag).view(B, T, self.H, self.K)
        v = (self.v(x) * v_mag).view(B, T, self.HV, self.V)
        options = dict(use_qk_l2norm_in_kernel=True)
        if fused:
            options.update(use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias,
                           use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
        o, _ = gated_delta.gated_delta_rule(q, k, v, g, beta, **options)
        return self.out(o.flatten(2)), o


def _amp_batch(step: int, B: int, T: int, d: int, HV: int, fused: bool, device: str):
    """Extreme but valid data: |q|, |k| up to ~1e3 per element (normalised in the kernel), |v| up to ~1e2,
    g from 0 (no decay) down to -1e4 (a full reset), beta up to 2 (raw, or 2*sigmoid of logits up to +-30)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(B, T, d, generator=gen)
    q_mag = torch.where(torch.rand(B, T, 1, generator=gen) < 0.3, 1e3, 1.0)
    v_mag = torch.where(torch.rand(B, T, 1, generator=gen) < 0.3, 1e2, 1.0)
    which = torch.randint(0, 3, (B, T, HV), generator=gen)
    if fused:
        g = torch.where(which == 0, -30.0, torch.where(which == 1, 1e4, torch.randn(B, T, HV, generator=gen)))
        beta = torch.empty(B, T, HV).uniform_(-30, 30, generator=gen)
    else:
        g = torch.where(which == 0, 0.0, torch.where(which == 1, -1e4, -8 * torch.rand(B, T, HV, generator=gen)))
        beta = torch.empty(B, T, HV).uniform_(0, 2, generator=gen)
    target = torch.roll(x, 1, dims=1)
    return [t.to(device) for t in (x, q_mag, v_mag, g, beta, target)]


def _all_finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t is not None)


def _unsupported(cfg: Config, dtype: torch.dtype, dims: dict) -> str:
    """Why autocast to dtype, or the op in dtype, cannot run on the device ("" when both run): on the CPU, float16
    depends on the build."""
    H, HV, K, V = dims["H"], dims["HV"], dims["K"], dims["V"]
    try:
        with torch.autocast(cfg.device, dtype=dtype):
            nn.Linear(4, 4).to(cfg.device)(torch.ones(1, 4, device=cfg.device))
        x = torch.ones(1, 2, H, K, device=cfg.device, dtype=dtype)
        gated_delta.gated_delta_rule(x, x, torch.ones(1, 2, HV, V, device=cfg.device, dtype=dtype),
                                     torch.zeros(1, 2, HV, device=cfg.device), torch.ones(1, 2, HV, device=cfg.device))
    except (RuntimeError, NotImplementedError) as err:
        return str(err).strip().splitlines()[0][:160]
    return ""


def _amp_run(cfg: Config, dtype: torch.dtype, steps: int, dims: dict, B: int, T: int, d: int):
    torch.manual_seed(0)
    model = _AmpMixer(d, **dims).to(cfg.device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(cfg.device)
    params = list(model.parameters())
    stats = dict(overflow=0, bad_outputs=0, bad_grads=0, scales=[], losses=[])

    def loss_of(batch, fused):
        x, q_mag, v_mag, g, beta, target = batch
        with torch.autocast(cfg.device, dtype=dtype):
            y, o = model(x, q_mag, v_mag, g, beta, fused)
        loss = (y.float() - target).pow(2).mean() / target.pow(2).mean()
        return loss, y, o

    for step in range(steps):
        fused = step % 2 == 1
        batch = _amp_batch(step, B, T, d, dims["HV"], fused, cfg.device)
        opt.zero_grad(set_to_none=True)
        loss, y, o = loss_of(batch, fused)
        if not _all_finite([y, o, loss]):
            stats["bad_outputs"] += 1
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if not _all_finite([p.grad for p in params]):
            # An overflow of the scaled gradients is expected now and then (the scaler skips the step); the
            # gradients of the unscaled loss must still be finite.
            opt.zero_grad(set_to_none=True)
            loss_of(batch, fused)[0].backward()
            if not _all_finite([p.grad for p in params]):
                stats["bad_grads"] += 1
            # unscale_ has already recorded the overflow: the scaler skips this step whatever the grads are now.
        scale_before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < scale_before:
            stats["overflow"] += 1
        stats["scales"].append(scale_before)
        stats["losses"].append(loss.item())
    return stats


def check_amp(cfg: Config) -> Result:
    if cfg.cuda:
        dims, B, T, d = dict(H=2, HV=4, K=128, V=128), 2, 512 if cfg.quick else 2048, 128
        steps = 20 if cfg.quick else 200
    else:
        dims, B, T, d = dict(H=1, HV=2, K=16, V=16), 2, 100, 32
        steps = 12 if cfg.quick else 100
    dtypes = [torch.bfloat16, torch.float16]
    results, skipped, failures = {}, {}, []
    for dtype in dtypes:
        name = str(dtype).replace("torch.", "")
        why = _unsupported(cfg, dtype, dims)
        if why:
            skipped[name] = why
            continue
        results[name] = stats = _amp_run(cfg, dtype, steps, dims, B, T, d)
        if stats["bad_outputs"] or stats["bad_grads"]:
            failures.append(f"{name}: {stats['bad_outputs']} steps with NaN/Inf outputs, {stats['bad_grads']} "
                            f"with NaN/Inf unscaled gradients")
        if stats["overflow"] > steps // 2:
            failures.append(f"{name}: {stats['overflow']}/{steps} steps overflowed")
    status = FAIL if failures else (PASS if results else SKIP)
    parts = [f"{n}: {s['overflow']}/{steps} overflow steps skipped, NaN/Inf outputs {s['bad_outputs']}, "
             f"grads {s['bad_grads']}, loss {s['losses'][0]:.3g}->{s['losses'][-1]:.3g}"
             for n, s in results.items()]
    parts += [f"{n} skipped ({why})" for n, why in skipped.items()]
    summary = "; ".join(parts) + (f"; FAIL: {'; '.join(failures)}" if failures else "")

    def draw(ax):
        for n, s in results.items():
            ax.semilogy(s["scales"], label=f"{n} loss scale")
        ax.set_xlabel("step")
        ax.set_ylabel("GradScaler scale")
        ax.legend()
        ax.set_title("mixed precision: loss scale per step")

    plot = save_plot(cfg, "amp.png", draw) if results else None
    details = (f"autocast + GradScaler training of projections around the op, B={B} T={T} {dims}, {steps} steps "
               "per dtype, alternating plain inputs (g in {0, -1e4, U(-8, 0)}, beta in U(0, 2)) and fused "
               "pre-processing (gate with g_raw in {-30, 1e4, N(0, 1)}, beta logits in U(-30, 30) with "
               "allow_neg_eigval); 30% of tokens have |q|, |k| scaled by 1e3 and |v| by 1e2. An overflow step "
               "is one the scaler skipped; a step also fails if the unscaled loss gives non-finite gradients.\n")
    return Result("amp", status, summary, details, [p for p in [plot] if p])
