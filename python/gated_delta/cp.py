"""Context parallelism (CP): the gated delta rule over a sequence split across the processes of a torch.distributed
group, exact, with initial and final states and every gradient.

Every piece of a sequence is an affine map of the state, S' = A S + B. Rank r holds a contiguous slice of the token
dimension. It runs the op once on its slice; for the one sequence that enters the slice from earlier ranks (the
slice's "continuing piece") it runs with the value columns extended by K zero columns and the initial state
[0 | I], so that the final state is [B | A] and the extra output columns are scale * A_t^T q_t (the output's
linear response to the incoming state). The ranks all-gather their outgoing maps, each composes those of the ranks
before it (in a fixed order) into its incoming state X, and corrects the continuing piece's output by X^T (scale
A_t^T q_t) (16-bit inputs: recomputes that piece from X, so that the output is rounded once, as in one process).
The backward needs one pass of the op: the incoming state's gradient is dX = A^T dY + E with
E = sum_t (scale A_t^T q_t) do_t^T, from the saved extra columns; the ranks all-gather E, fold the gradients from
the last rank back, and run the op's backward once with the true outgoing gradient dY.

See docs/context_parallel.md for the API, the layout conventions and the cost model.
"""
import struct
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _C  # noqa: F401  (loads the library that registers torch.ops.gated_delta)
from .ops import ALGORITHMS as _ALGORITHMS, _check_python_args

__all__ = ["cp_gated_delta_rule", "CPLayout", "cp_layout", "cp_short_conv_initial_state"]

_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------- the raw ops (the only calls of them)

@dataclass(frozen=True)
class _Options:
    scale: float
    l2norm: bool
    beta_sigmoid: bool
    neg_eigval: bool
    gate: bool
    algorithm: str
    chunk_size: int


def _op_fwd(opt: _Options, q, k, v, g, beta, h0, A_log, dt_bias, cu=None, cu_cpu=None):
    """(o, final_state) of one local run of torch.ops.gated_delta.fwd (always with the final state)."""
    return torch.ops.gated_delta.fwd(q, k, v, g, beta, opt.scale, h0, True, cu, cu_cpu, opt.l2norm, opt.beta_sigmoid,
                                     opt.neg_eigval, opt.gate, A_log, dt_bias, opt.algorithm, opt.chunk_size)


def _op_bwd(opt: _Options, d_o, d_final, q, k, v, g, beta, h0, A_log, dt_bias, cu=None, cu_cpu=None):
    """(dq, dk, dv, dg, dbeta, d_h0, dA_log, ddt_bias) of one local run of torch.ops.gated_delta.bwd."""
    return torch.ops.gated_delta.bwd(d_o, d_final, q, k, v, g, beta, opt.scale, h0, cu, cu_cpu, opt.l2norm,
                                     opt.beta_sigmoid, opt.neg_eigval, opt.gate, A_log, dt_bias, opt.algorithm,
                                     opt.chunk_size)


# ---------------------------------------------------------------- collectives

def _comm_device(group, device: torch.device) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if device.type != "cpu" and "nccl" in backend:
        return device
    if "gloo" in backend:
        return torch.device("cpu")
    return device


def _all_gather(t: torch.Tensor, group) -> torch.Tensor:
    """[world, *t.shape]: every rank's t, in rank order."""
    world = dist.get_world_size(group)
    t = t.contiguous()
    out = t.new_empty((world,) + tuple(t.shape))
    if "nccl" in str(dist.get_backend(group)).lower() and t.is_cuda:
        dist.all_gather_into_tensor(out, t, group=group)
    else:
        dist.all_gather(list(out.unbind(0)), t, group=group)
    return out


def _gather_checked(t: torch.Tensor, error: Optional[BaseException], group, what: str) -> torch.Tensor:
    """All-gather t with a status flag; if any rank failed (error on this rank, or a flag from another), every rank
    raises, so that no rank waits in a later collective."""
    flag = t.new_full((1,), 0 if error is None else 1)
    out = _all_gather(torch.cat([t.reshape(-1), flag]), group)
    bad = [r for r, f in enumerate(out[:, -1].tolist()) if f != 0]
    if error is not None:
        raise error
    if bad:
        raise RuntimeError(f"context-parallel gated_delta_rule: rank(s) {bad} of cp_group failed in {what} "
                           f"(see the error raised there)")
    return out[:, :-1].reshape((out.shape[0],) + tuple(t.shape))


# ---------------------------------------------------------------- the token layout

@dataclass(frozen=True)
class _RankSlice:
    """What one rank's slice [start, end) of the global token stream touches.

    cont: the slice's first token continues a sequence begun on an earlier rank (the continuing piece, first_len
        tokens of sequence first_seq); first_ends_here: that sequence ends in this slice.
    outgoing: the slice's last token's sequence continues on a later rank.
    seq_lo, seq_hi: the sequences that start in this slice; their pieces, in local offsets from the end of the
        continuing piece, are rest_cu (None for an equal-length batch).
    seq_start: first token of the continuing sequence (0 for an equal-length batch); -1 when not cont.
    """

    start: int
    end: int
    cont: bool
    first_len: int
    first_seq: int
    first_ends_here: bool
    outgoing: bool
    seq_lo: int
    seq_hi: int
    rest_cu: Optional[Tuple[int, ...]]
    seq_start: int

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def first_is_outgoing(self) -> bool:
        return self.cont and not self.first_ends_here


@dataclass(frozen=True)
class CPLayout:
    """The layout of the global token stream over the ranks of a CP group: slice lengths in rank order, the global
    cu_seqlens (None for an equal-length batch of `batch` sequences)."""

    lengths: Tuple[int, ...]
    cu_seqlens: Optional[Tuple[int, ...]]
    batch: int
    rank: int

    @property
    def world(self) -> int:
        return len(self.lengths)

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def num_seqs(self) -> int:
        return self.batch if self.cu_seqlens is None else len(self.cu_seqlens) - 1

    @property
    def chains(self) -> int:
        """Sequences that can cross a rank boundary at once: the batch, or 1 for a packed batch."""
        return self.batch if self.cu_seqlens is None else 1

    def slice_of(self, rank: int) -> _RankSlice:
        s = sum(self.lengths[:rank])
        e = s + self.lengths[rank]
        total = self.total
        if s == e:
            return _RankSlice(s, e, False, 0, -1, False, False, 0, 0, None, -1)
        if self.cu_seqlens is None:
            cont = s > 0
            return _RankSlice(s, e, cont, e - s if cont else 0, -1, cont and e == total, e < total,
                              0, 0 if cont else self.batch, None, 0 if cont else -1)
        cu = self.cu_seqlens
        n = len(cu) - 1
        lo = next(i for i in range(n + 1) if cu[i] >= s)
        hi = n if e == total else next(i for i in range(n + 1) if cu[i] >= e)
        cont = cu[lo] > s
        first_len = min(cu[lo], e) - s if cont else 0
        outgoing = e < total and e not in cu
        rest_cu = tuple(min(c, e) - s - first_len for c in cu[lo:hi + 1]) if hi > lo else None
        return _RankSlice(s, e, cont, first_len, lo - 1 if cont else -1, cont and cu[lo] <= e, outgoing, lo, hi,
                          rest_cu, cu[lo - 1] if cont else -1)

    @property
    def local(self) -> _RankSlice:
        return self.slice_of(self.rank)

    def local_cu_seqlens(self) -> Optional[List[int]]:
        """The pieces of the local slice as a local cu_seqlens (the continuing piece first); None for an
        equal-length batch."""
        if self.cu_seqlens is None:
            return None
        sl = self.local
        cu = [0] if not sl.cont else [0, sl.first_len]
        if sl.rest_cu is not None:
            cu += [c + sl.first_len for c in sl.rest_cu[1:]]
        return cu if len(cu) > 1 else [0, 0]


def _dtype_code(dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else -1


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _seq_hash(cu: Sequence[int]) -> int:
    m = (1 << 61) - 1
    return (sum(cu) * 1000003 + sum((i + 1) * c for i, c in enumerate(cu))) % m


def _exchange_meta(group, device, length: int, fields: List[Tuple[str, int]], error: Optional[BaseException]):
    """All-gather (length, *fields) of every rank; raise on every rank when a field differs or a rank failed."""
    values = [length] + [int(v) for _, v in fields]
    t = torch.tensor(values, dtype=torch.int64, device=_comm_device(group, device))
    out = _gather_checked(t, error, group, "its input checks").cpu()
    for j, (name, _) in enumerate(fields, start=1):
        col = out[:, j].tolist()
        if any(c != col[0] for c in col):
            raise ValueError(f"context-parallel gated_delta_rule: every rank of cp_group must pass the same {name}; "
                             f"got {col} on ranks 0..{len(col) - 1}")
    return tuple(out[:, 0].tolist())


def _group_info(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("cp_group needs an initialised torch.distributed process group "
                           "(torch.distributed.init_process_group)")
    if group is None:
        raise TypeError("cp_group must be a torch.distributed ProcessGroup (e.g. torch.distributed.group.WORLD)")
    return dist.get_rank(group), dist.get_world_size(group)


def _cu_list(cu_seqlens, cu_seqlens_cpu) -> Optional[List[int]]:
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.is_floating_point():
        got = tuple(cu_seqlens.shape) if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N + 1] with N >= 1 (the global offsets, the same "
                         f"on every rank), got {got}")
    cu = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu}")
    return cu


@torch.compiler.disable
def cp_layout(group, length: int, batch: int = 1, cu_seqlens: Optional[torch.Tensor] = None,
              cu_seqlens_cpu: Optional[torch.Tensor] = None, *, check: Sequence[Tuple[str, int]] = (),
              device: Optional[torch.device] = None, error: Optional[BaseException] = None) -> CPLayout:
    """Exchange the slice lengths of the ranks of `group` (one small all-gather) and return the layout.

    length: this rank's number of tokens; batch: B (1 with cu_seqlens); cu_seqlens: the global offsets [N + 1], the
    same on every rank, cu_seqlens[-1] = the sum of the slice lengths. `check` lists (name, int) pairs every rank
    must agree on (raising a ValueError naming the field otherwise)."""
    rank, world = _group_info(group)
    device = torch.device("cpu") if device is None else device
    cu = None
    try:
        cu = _cu_list(cu_seqlens, cu_seqlens_cpu)
        if cu is not None and batch != 1:
            raise ValueError(f"cu_seqlens requires a packed batch with B = 1, got B = {batch}")
    except (ValueError, TypeError, RuntimeError) as exc:
        error = error or exc
    fields = [("batch size B", batch), ("use of cu_seqlens", cu is not None)]
    if cu is not None:
        fields += [("number of sequences N", len(cu) - 1),
                   ("cu_seqlens (the global offsets; values shown are hashes)", _seq_hash(cu))]
    fields += list(check)
    lengths = _exchange_meta(group, device, length, fields, error)
    if cu is not None and cu[-1] != sum(lengths):
        raise ValueError(f"cu_seqlens[-1] = {cu[-1]} must equal the total number of tokens over cp_group, "
                         f"{sum(lengths)} (slices of {list(lengths)} tokens on ranks 0..{world - 1})")
    if sum(lengths) == 0:
        raise ValueError("the sequence split over cp_group is empty (every rank passed T = 0)")
    return CPLayout(tuple(lengths), tuple(cu) if cu is not None else None, batch, rank)


# ---------------------------------------------------------------- the op

def _state_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _outer_sum(a: torch.Tensor, b: torch.Tensor, dtype, block: int = 8192) -> torch.Tensor:
    """sum_t a[:, t, h, :] (x) b[:, t, h, :] -> [M, HV, K, V] in dtype, accumulated over blocks of tokens in order."""
    M, T, HV, K = a.shape
    out = a.new_zeros((M, HV, K, b.shape[-1]), dtype=dtype)
    for t0 in range(0, T, block):
        ab = a[:, t0:t0 + block].to(dtype).permute(0, 2, 3, 1)  # [M, HV, K, t]
        bb = b[:, t0:t0 + block].to(dtype).permute(0, 2, 1, 3)  # [M, HV, t, V]
        out += torch.matmul(ab, bb)
    return out


# Value widths the CUDA kernels take (HeadDims in csrc/cuda/dispatch.cuh); the map pass joins the K extra columns to v when
# V + K is one of them, else runs them as a second call (the CPU kernels take any width).
_CUDA_VALUE_WIDTHS = (64, 128, 256)


def _joined_map_pass(v: torch.Tensor, K: int) -> bool:
    return v.device.type == "cpu" or v.shape[-1] + K in _CUDA_VALUE_WIDTHS


def _map_pass(opt: _Options, q, k, v, g, beta, A_log, dt_bias, eye, joined: bool):
    """The op over a piece from the state [0 | I] with the value columns [v | 0] (one call when joined, else one for
    v and one for the K zero columns): returns o (from a zero state), o_lin [M, T, HV, K] (o_lin_t = scale A_t^T q_t,
    the outputs' response to the entering state) and the final state [B | A] [M, HV, K, V + K]."""
    M, T, HV, V = v.shape
    K = q.shape[-1]
    zero = torch.zeros((M, HV, K, V), dtype=eye.dtype, device=eye.device)
    if joined:
        v_ext = torch.cat([v, v.new_zeros((M, T, HV, K))], dim=-1)
        o_ext, state = _op_fwd(opt, q, k, v_ext, g, beta, torch.cat([zero, eye], dim=-1), A_log, dt_bias)
        return o_ext[..., :V], o_ext[..., V:].contiguous(), state
    o, B = _op_fwd(opt, q, k, v, g, beta, zero, A_log, dt_bias)
    o_lin, A = _op_fwd(opt, q, k, v.new_zeros((M, T, HV, K)), g, beta, eye.contiguous(), A_log, dt_bias)
    return o, o_lin, torch.cat([B, A], dim=-1)


def _rest_args(sl: _RankSlice, h0, dev):
    """(initial states, cu_seqlens, its host copy) of the run over the sequences that start in the slice."""
    if sl.rest_cu is None:
        return h0, None, None
    cu_cpu = torch.tensor(sl.rest_cu, dtype=torch.int32)
    return (h0[sl.seq_lo:sl.seq_hi] if h0 is not None else None), cu_cpu.to(dev), cu_cpu


class _CPGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, A_log, dt_bias, opt: _Options, layout: CPLayout, group,
                output_final_state: bool):
        ctx.set_materialize_grads(False)
        sl = layout.local
        M, HV, K, V = layout.chains, v.shape[2], q.shape[3], v.shape[3]
        sd = _state_dtype(q.dtype)
        dev = q.device
        rest = slice(sl.first_len, sl.length)
        eye = torch.eye(K, dtype=sd, device=dev).expand(M, HV, K, K)
        exact = v.dtype in (torch.float32, torch.float64)  # the output's linear correction is at full precision
        error = None
        local_map = torch.zeros((M, HV, K, V + K), dtype=sd, device=dev)
        o_first = o_lin = first_map = o_rest = fin_rest = None
        try:
            if sl.length == 0:
                local_map[..., V:] = eye  # an empty slice passes the state on unchanged
            if sl.cont:  # the continuing piece's map [B | A] and outputs, from the state [0 | I]
                f = slice(0, sl.first_len)
                o_first, o_lin, first_map = _map_pass(opt, q[:, f], k[:, f], v[:, f], g[:, f], beta[:, f], A_log,
                                                      dt_bias, eye, _joined_map_pass(v, K))
                if not exact:
                    o_first = None  # recomputed from the incoming state below
                if sl.first_is_outgoing:
                    local_map = first_map
            if sl.length > sl.first_len:  # the sequences that start in this slice
                h0_rest, cu, cu_cpu = _rest_args(sl, h0, dev)
                o_rest, fin_rest = _op_fwd(opt, q[:, rest], k[:, rest], v[:, rest], g[:, rest], beta[:, rest],
                                           h0_rest, A_log, dt_bias, cu, cu_cpu)
                if sl.outgoing and not sl.first_is_outgoing:
                    local_map = torch.cat([fin_rest[-M:], torch.zeros((M, HV, K, K), dtype=sd, device=dev)], -1)
        except (RuntimeError, ValueError, TypeError, IndexError) as exc:
            error = exc
        cdev = _comm_device(group, dev)
        maps = _gather_checked(local_map.to(cdev), error, group, "its local forward").to(dev)

        # The incoming state: X_{j+1} = A_j X_j + B_j over the ranks before this one, in rank order.
        X = torch.zeros((M, HV, K, V), dtype=sd, device=dev)
        for j in range(layout.rank):
            X = torch.matmul(maps[j, ..., V:], X) + maps[j, ..., :V]

        parts = []
        final_first = None
        if sl.cont:
            A_first, B_first = first_map[..., V:], first_map[..., :V]
            if exact:
                o_first = (o_first + torch.matmul(o_lin.transpose(1, 2), X).transpose(1, 2)).to(v.dtype)
            else:  # one rounding to 16 bits, as in one process: recompute the piece from its true start state
                f = slice(0, sl.first_len)
                o_first, _ = _op_fwd(opt, q[:, f], k[:, f], v[:, f], g[:, f], beta[:, f], X, A_log, dt_bias)
            parts.append(o_first)
            if sl.first_ends_here:
                final_first = torch.matmul(A_first, X) + B_first
        if o_rest is not None:
            parts.append(o_rest)
        o = v.new_empty(v.shape) if not parts else parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

        if output_final_state:  # the rows of the sequences that end in this slice; zeros elsewhere
            final = torch.zeros((layout.num_seqs, HV, K, V), dtype=sd, device=dev)
            if layout.cu_seqlens is None:
                if sl.length and sl.end == layout.total:
                    final.copy_(final_first if final_first is not None else fin_rest)
            else:
                if final_first is not None:
                    final[sl.first_seq] = final_first[0]
                for n in range(sl.seq_lo, sl.seq_hi):
                    if layout.cu_seqlens[n + 1] <= sl.end:
                        final[n] = fin_rest[n - sl.seq_lo]
        else:
            final = torch.empty((0,), dtype=sd, device=dev)
            ctx.mark_non_differentiable(final)

        ctx.save_for_backward(q, k, v, g, beta, h0, A_log, dt_bias, X if sl.cont else None, o_lin,
                              first_map[..., V:] if sl.cont else None, maps[layout.rank + 1:, ..., V:])
        ctx.opt, ctx.layout, ctx.group, ctx.output_final_state = opt, layout, group, output_final_state
        return o, final

    @staticmethod
    def backward(ctx, d_o, d_final):
        q, k, v, g, beta, h0, A_log, dt_bias, X, o_lin, A_first, A_later = ctx.saved_tensors
        opt, layout, group = ctx.opt, ctx.layout, ctx.group
        sl = layout.local
        M, HV, K, V = layout.chains, v.shape[2], q.shape[3], v.shape[3]
        sd = _state_dtype(q.dtype)
        dev = q.device
        if d_o is None:
            d_o = torch.zeros_like(v)
        if not ctx.output_final_state:
            d_final = None
        varlen = layout.cu_seqlens is not None

        def d_final_rows(lo, hi):  # the user's gradient of the final states of sequences lo..hi-1, or zeros
            if d_final is None:
                return torch.zeros((hi - lo, HV, K, V), dtype=sd, device=dev)
            return d_final[lo:hi].to(sd)

        # This rank's term of the incoming-state gradient: dX = A^T dY + D, D = E (+ A^T dfinal if it ends here).
        error = None
        D = torch.zeros((M, HV, K, V), dtype=sd, device=dev)
        d_first_final = None
        try:
            if sl.cont:
                D = _outer_sum(o_lin, d_o[:, :sl.first_len], sd)
                if sl.first_ends_here:
                    d_first_final = d_final_rows(sl.first_seq, sl.first_seq + 1) if varlen else d_final_rows(0, M)
                    D = D + torch.matmul(A_first.transpose(-1, -2), d_first_final)
        except (RuntimeError, ValueError, TypeError, IndexError) as exc:
            error = exc
        Ds = _gather_checked(D.to(_comm_device(group, dev)), error, group, "its local backward").to(dev)
        # dY of this rank = dX of the next: fold from the last rank back, in rank order.
        dY = torch.zeros((M, HV, K, V), dtype=sd, device=dev)
        for j in range(layout.world - 1, layout.rank, -1):
            dY = torch.matmul(A_later[j - layout.rank - 1].transpose(-1, -2), dY) + Ds[j]

        grads = []  # per piece: (dq, dk, dv, dg, dbeta)
        dA_log = ddt_bias = dh0 = None
        if sl.cont:
            f = slice(0, sl.first_len)
            dfin = dY if sl.first_is_outgoing else d_first_final
            r = _op_bwd(opt, d_o[:, f].contiguous(), dfin, q[:, f], k[:, f], v[:, f], g[:, f], beta[:, f], X, A_log,
                        dt_bias)
            grads.append(r[:5])
            dA_log, ddt_bias = r[6], r[7]
        if sl.length > sl.first_len:
            rest = slice(sl.first_len, sl.length)
            n_rest = M if not varlen else sl.seq_hi - sl.seq_lo
            lo = 0 if not varlen else sl.seq_lo
            dfin = d_final_rows(lo, lo + n_rest).clone()
            if sl.outgoing:
                dfin[-M:] = dY
            h0_rest, cu, cu_cpu = _rest_args(sl, h0, dev)
            r = _op_bwd(opt, d_o[:, rest].contiguous(), dfin, q[:, rest], k[:, rest], v[:, rest], g[:, rest],
                        beta[:, rest], h0_rest, A_log, dt_bias, cu, cu_cpu)
            grads.append(r[:5])
            if h0 is not None:
                dh0 = torch.zeros_like(h0)
                dh0[lo:lo + n_rest] = r[5]
            if dA_log is not None and A_log is not None:  # the two pieces' shares, summed at the state's precision
                dA_log = (dA_log.to(sd) + r[6].to(sd)).to(r[6].dtype)
                ddt_bias = (ddt_bias.to(sd) + r[7].to(sd)).to(r[7].dtype)
            else:
                dA_log, ddt_bias = r[6], r[7]
        if grads:
            dq, dk, dv, dg, dbeta = (torch.cat(p, dim=1) if len(grads) > 1 else p[0] for p in zip(*grads))
        else:
            dq, dk, dv, dg, dbeta = (torch.zeros_like(t) for t in (q, k, v, g, beta))
        if h0 is not None and dh0 is None:
            dh0 = torch.zeros_like(h0)
        if A_log is not None and dA_log is None:
            dA_log, ddt_bias = torch.zeros_like(A_log), torch.zeros_like(dt_bias)
        return (dq, dk, dv, dg, dbeta, dh0, dA_log if A_log is not None else None,
                ddt_bias if dt_bias is not None else None, None, None, None, None)


def _local_checks(q, k, v, g, beta, initial_state, A_log, dt_bias, use_gate_in_kernel, cu_seqlens):
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B, T, H, K] (4 dimensions), got {list(q.shape)}")
    if v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must have shape [B, T, HV, V] with B, T = {list(q.shape[:2])} (q's), got {list(v.shape)}")
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state),
                    ("A_log", A_log), ("dt_bias", dt_bias)):
        if t is not None and t.device != q.device:
            raise RuntimeError(f"{name} must be on the same device as q ({q.device}), got {t.device}")
    if use_gate_in_kernel and (A_log is None or dt_bias is None):
        raise ValueError("use_gate_in_kernel=True needs A_log and dt_bias")
    if initial_state is not None:
        N = q.shape[0] if not isinstance(cu_seqlens, torch.Tensor) else cu_seqlens.numel() - 1
        want = [N, v.shape[2], q.shape[3], v.shape[3]]
        if not isinstance(initial_state, torch.Tensor) or list(initial_state.shape) != want:
            got = list(initial_state.shape) if isinstance(initial_state, torch.Tensor) else type(initial_state).__name__
            raise ValueError(f"initial_state must have shape [N, HV, K, V] = {want} (N: every sequence of the global "
                             f"batch), got {got}")


@torch.compiler.disable
def cp_gated_delta_rule(cp_group, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                        use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, use_gate_in_kernel,
                        A_log, dt_bias, algorithm, chunk_size, cu_seqlens_cpu):
    """`gated_delta_rule(..., cp_group=group)`: the gated delta rule on a sequence split over the ranks of the group
    (context parallelism), exact.

    Each rank passes its contiguous slice of the token dimension, in rank order: q, k [B, T_r, H, K],
    v [B, T_r, HV, V], g, beta [B, T_r, HV] (T_r may differ between ranks, and may be 0). Either an equal-length
    batch (B sequences, each split the same way) or a packed batch: B = 1 and `cu_seqlens` the *global* offsets
    [N + 1] (the same on every rank; sequences may cross rank boundaries, and span any number of ranks).

    initial_state [N, HV, K, V]: read on the rank holding a sequence's first token (pass the same tensor on every
    rank, or at least one of that shape); its gradient is non-zero only in those rows on that rank.
    Returns (o [B, T_r, HV, V], final_state [N, HV, K, V] or None): the rows of final_state of the sequences whose
    last token is on this rank hold their final state, the other rows are zero (a sum over the ranks gives every
    final state); the gradient of a row is taken on the rank that reports it.

    Gradients of tensors replicated over the ranks (initial_state, A_log, dt_bias, and layer parameters) are this
    rank's share: their sum over cp_group is the gradient of the whole sequence. Every rank must call this with the
    same options and shapes (checked: a mismatch raises a ValueError on every rank) and, when gradients are needed,
    run the backward (it holds one collective). Other arguments: as `gated_delta_rule`.
    """
    _group_info(cp_group)
    error = None
    try:
        _check_python_args(scale, algorithm, chunk_size, output_final_state)
        _local_checks(q, k, v, g, beta, initial_state, A_log, dt_bias, use_gate_in_kernel, cu_seqlens)
    except (ValueError, TypeError, RuntimeError) as exc:
        error = exc
    if error is None:
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        scale = K ** -0.5 if scale is None else float(scale)
        dtype, device = q.dtype, q.device
    else:  # still take part in the exchange, so that every rank raises
        B = T = H = K = HV = V = 0
        scale, dtype, device = 0.0, None, torch.device("cpu")
        if isinstance(q, torch.Tensor):
            device = q.device
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, g, beta, initial_state, A_log, dt_bias))
    check = [("H (q's heads)", H), ("K", K), ("HV (v's heads)", HV), ("V", V), ("dtype of q", _dtype_code(dtype)),
             ("device type", 0 if device.type == "cpu" else 1), ("scale", _float_bits(scale)),
             ("presence of initial_state", initial_state is not None), ("output_final_state", output_final_state),
             ("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel),
             ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel), ("allow_neg_eigval", allow_neg_eigval),
             ("use_gate_in_kernel", use_gate_in_kernel),
             ("algorithm", _ALGORITHMS.index(algorithm) if algorithm in _ALGORITHMS else -1),
             ("chunk_size", chunk_size if isinstance(chunk_size, int) else -1),
             ("need for gradients (requires_grad of the inputs, grad mode)", needs_grad)]
    layout = cp_layout(cp_group, T, B, cu_seqlens, cu_seqlens_cpu, check=check, device=device, error=error)
    opt = _Options(scale, bool(use_qk_l2norm_in_kernel), bool(use_beta_sigmoid_in_kernel), bool(allow_neg_eigval),
                   bool(use_gate_in_kernel), algorithm, chunk_size)
    o, final = _CPGatedDeltaRule.apply(q, k, v, g, beta, initial_state, A_log, dt_bias, opt, layout, cp_group,
                                       output_final_state)
    return o, (final if output_final_state else None)


# ---------------------------------------------------------------- the short convolution's halo

class _Halo(torch.autograd.Function):
    """The last `width` pre-convolution inputs before this rank's slice, of the sequence that continues into it:
    x [B, T_r, D] -> [M, width, D] (zero before the sequence's start). Backward: the halo's gradient goes to the
    ranks that hold those tokens."""

    @staticmethod
    def forward(ctx, x, width: int, layout: CPLayout, group):
        dev = x.device
        M, T, D = x.shape[0], x.shape[1], x.shape[2]
        tail = x.new_zeros((M, width, D))
        n = min(width, T)
        if n:
            tail[:, width - n:] = x[:, T - n:]
        tails = _all_gather(tail.to(_comm_device(group, dev)), group).to(dev)
        src = _halo_sources(layout, layout.rank, width)
        halo = x.new_zeros((M, width, D))
        for i, (j, idx) in src.items():
            halo[:, i] = tails[j, :, idx]
        ctx.width, ctx.layout, ctx.group, ctx.T = width, layout, group, T
        return halo

    @staticmethod
    def backward(ctx, d_halo):
        width, layout, group, T = ctx.width, ctx.layout, ctx.group, ctx.T
        dev = d_halo.device
        d_all = _all_gather(d_halo.contiguous().to(_comm_device(group, dev)), group).to(dev)
        M, D = d_halo.shape[0], d_halo.shape[2]
        dx = d_halo.new_zeros((M, T, D))
        for r in range(layout.rank + 1, layout.world):  # later ranks, in order: a fixed summation order
            for i, (j, idx) in _halo_sources(layout, r, width).items():
                if j == layout.rank:
                    dx[:, T - width + idx] += d_all[r, :, i]
        return dx, None, None, None


def _halo_sources(layout: CPLayout, rank: int, width: int):
    """{halo index i: (rank j, index in j's tail)} for the halo of `rank`: the tokens s - width + i of its continuing
    sequence (those before the sequence's start are zero and have no source)."""
    sl = layout.slice_of(rank)
    if not sl.cont:
        return {}
    ends = [sum(layout.lengths[:j + 1]) for j in range(layout.world)]
    out = {}
    for i in range(width):
        p = sl.start - width + i
        if p < sl.seq_start:
            continue
        j = next(j for j in range(layout.world) if layout.lengths[j] and ends[j] - layout.lengths[j] <= p < ends[j])
        out[i] = (j, p - (ends[j] - width))
    return out


@torch.compiler.disable
def cp_short_conv_initial_state(x: torch.Tensor, width: int, layout: CPLayout, group) -> Optional[torch.Tensor]:
    """The initial state [N_local, D, width] of the causal short convolution of this rank's slice x [B, T_r, D]
    (the local pieces as in layout.local_cu_seqlens(): the continuing sequence first), with the halo of the previous
    ranks' inputs for the continuing sequence and zeros for the others; None when no halo is needed. Differentiable:
    the halo's gradient reaches the ranks that hold those tokens (every rank must call it, forward and backward)."""
    if width == 0:
        return None
    halo = _Halo.apply(x, width, layout, group).transpose(1, 2)  # [M, D, width]
    if layout.cu_seqlens is None:
        return halo.contiguous()
    n_local = len(layout.local_cu_seqlens()) - 1
    rest = halo.new_zeros((n_local - 1, x.shape[2], width))
    return torch.cat([halo, rest], dim=0).contiguous()
