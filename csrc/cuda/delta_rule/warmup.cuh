// Segment-parallel sequential passes with a proven warm-up (Params::warm), used by the state kernels
// (state_fwd.cuh, state_rev.cuh) for shapes with few (sequence x value head) units.
//
// Each sequence is cut into segments of p.seg chunks, all run at once. A segment's CTA starts from a ZERO state a
// few chunks before its first chunk (forward; the reverse pass: a zero state gradient a few chunks after its last),
// runs those warm-up chunks without storing anything, then its own chunks, storing outputs. The segment at the
// sequence's edge starts from the true initial state (the final-state gradient in reverse), as does any segment
// whose warm-up would reach that edge: those are exact.
//
// Why a warm-up is exact to far below fp32 resolution. One token's transition is a_t (I - b_t k_t k_t^T) with
// a_t = e^{g_t}; it is symmetric, its eigenvalues are a_t (K - 1 times) and a_t (1 - b_t |k_t|^2), so its spectral
// norm is a_t max(1, |1 - b_t |k_t|^2|): a_t when 0 <= b_t |k_t|^2 <= 2 (unit-norm k and 0 <= beta <= 2), larger
// otherwise. The reverse pass multiplies by the transposed (the same) transitions. Starting a window of tokens from
// zero instead of the true state X leaves an error E = (product of the window's transitions) X in the state after
// it, so |E| <= exp(sum over the window of log norm_t) |X|, and E then propagates like any perturbation of the
// state (an fp32 rounding of it, say). The preparation writes per chunk and value head the log of that bound,
//   lnorm = sum_t ( g_t + log max(1, |1 - m_t| + 2^-15 |m_t|) ),   m_t = b_t |k_t|^2 in fp32
// (|k_t|^2 is a sum of at most 256 non-negative fp32 terms, relative rounding <= 2^-16, times b_t: <= 2^-15, so
// the slack term makes each factor an upper bound of the exact one). A warm-up is used only when its chunks' lnorm
// sum to <= kWarmLogBound = -24: e^-24 = 3.8e-11, three orders of magnitude below fp32's relative resolution
// (2^-24 = 6e-8; the rounding of these few fp32 sums moves the exponent by far less than 0.01). Any input is
// allowed: un-normalised k, beta outside [0, 2], non-decaying or positive g only make lnorm larger, so the warm-up
// grows, up to p.warm_max chunks. A NaN never compares <= the bound.
//
// Where no window of at most warm_max chunks proves a segment's start, its CTA stores nothing and records the
// failure in p.seg_ok; a second launch of the same kernel (warm = 2) then runs every (sequence, value head) with a
// failed segment whole and exactly from its initial state, overwriting all its outputs. Its CTAs for proven
// sequences, and for every unit but a sequence's first, exit at once: no device->host sync, graph capturable, and
// deterministic (one writer per seg_ok entry; the second launch follows the first in stream order).
#pragma once

#include "chunks.cuh"
#include "mma.cuh"
#include "params.h"

namespace gated_delta {
namespace cuda {

constexpr float kWarmLogBound = -24.f;

// Adds to s one token's term of lnorm beyond its gate: log max(1, |1 - m| + 2^-15 |m|), m = b |k|^2 in fp32 (the
// bound above; the preparation and the one-kernel forward form lnorm with it).
__device__ __forceinline__ void add_log_stretch(float& s, float m) {
  const float nb = fabsf(1.f - m) + fabsf(m) * 0x1p-15f;
  if (nb > 1.f) s += logf(nb);
}

// |x|^2 in fp32 of N 16-byte loads of St values (a key row, or part of one), the loop unrolled U times.
template <class St, int N, int U>
__device__ __forceinline__ float sq_norm16(const uint4* x) {
  constexpr int E = 16 / sizeof(St);
  float kn = 0.f;
#pragma unroll U
  for (int v = 0; v < N; ++v) {
    const uint4 w = x[v];
#pragma unroll
    for (int e = 0; e < E / 2; ++e) {
      const float2 f = unpack2<St>((&w.x)[e]);
      kn = fmaf(f.x, f.x, kn);
      kn = fmaf(f.y, f.y, kn);
    }
  }
  return kn;
}

// The bound of chunk c's transition norm for value head hv that the segments' warm-up walks, where it is formed
// rather than read from prep's lnorm (the one-kernel forward, by one warp per chunk):
// lnorm = sum_t (g_t + log max(1, |1 - m_t| + 2^-15 |m_t|)), m_t = beta_t |k_t|^2 in fp32. One warp: lane l on rows
// 2l and 2l + 1, the lanes' sums then added over the warp.
template <class St, int K>
__device__ __forceinline__ float chunk_lnorm(const Params& p, int c, int h, int hv) {
  constexpr int E = 16 / sizeof(St);
  const int lane = threadIdx.x & 31;
  const ChunkInfo ci = chunk_info(p, c);
  float s = 0.f;
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    const int row = 2 * lane + t;
    if (row >= ci.len) continue;
    const uint4* kr = reinterpret_cast<const uint4*>(static_cast<const St*>(p.k) + ((ci.bos + row) * p.H + h) * K);
    const float kn = sq_norm16<St, K / E, 4>(kr);
    const int64_t i = (ci.bos + row) * p.HV + hv;
    const float m = load_as_float(p.beta, p.beta_dtype, i) * kn;
    s += floored_gate(p.g[i]);
    add_log_stretch(s, m);
  }
  return warp_sum(s);
}

// The end of a walk that proved no warm-up within its min(avail, p.warm_max) chunks: when those were all the
// chunks up to the sequence's edge `bound`, the pass starts there from the true state (state 1), otherwise the
// segment is left to the exact fallback (state -1).
__device__ __forceinline__ int walk_unproven(const Params& p, int avail, int edge, int bound, int& state) {
  if (avail <= p.warm_max) {
    state = 1;
    return bound;
  }
  state = -1;
  return edge;
}

// The chunks [s0, s1) and the units [u0, u1) of sequence n.
__device__ __forceinline__ void seq_range(const Params& p, int n, int& s0, int& s1, int& u0, int& u1) {
  if (p.unit_off != nullptr) {
    u0 = max(0, min(p.unit_off[n], p.num_units));
    u1 = max(u0, min(p.unit_off[n + 1], p.num_units));
    s0 = u1 > u0 ? p.unit_tab[3 * u0 + 1] : 0;
    s1 = u1 > u0 ? p.unit_tab[3 * (u1 - 1) + 2] : 0;
  } else {
    u0 = n * p.segs_per_seq;
    u1 = u0 + p.segs_per_seq;
    s0 = n * p.CPS;
    s1 = s0 + p.CPS;
  }
  s0 = max(0, min(s0, p.NC));
  s1 = max(s0, min(s1, p.NC));
}

// Walks away from a segment's edge (forward: chunks edge - 1, edge - 2, ... down to the sequence start `bound`;
// reverse: edge, edge + 1, ... up to the sequence end `bound`), at most p.warm_max chunks, summing lnorm, a warp
// at a time. Returns where the pass starts (forward: its first chunk; reverse: its end chunk) and sets state:
// 0 from zero after a proven warm-up, 1 from the true initial state at the sequence's edge, -1 not proven.
// Every warp computes the same result (same data, same order).
__device__ __forceinline__ int warm_walk(const Params& p, int hv, int edge, int bound, bool rev, int& state) {
  const int lane = threadIdx.x & 31;
  const int avail = rev ? bound - edge : edge - bound;
  if (avail <= 0) {
    state = 1;
    return edge;
  }
  const int lim = min(avail, p.warm_max);
  float carry = 0.f;
  for (int j0 = 0; j0 < lim; j0 += 32) {
    const int j = j0 + lane;
    const int c = rev ? edge + j : edge - 1 - j;
    const float x = j < lim ? p.lnorm[static_cast<int64_t>(c) * p.HV + hv] : 0.f;
    const float s = warp_incl_scan(x) + carry;
    const unsigned hit = __ballot_sync(0xffffffffu, j < lim && s <= kWarmLogBound);
    if (hit != 0u) {
      const int w = j0 + __ffs(static_cast<int>(hit));  // chunks in the warm-up
      state = 0;
      return rev ? edge + w : edge - w;
    }
    carry = __shfl_sync(0xffffffffu, s, 31);
  }
  return walk_unproven(p, avail, edge, bound, state);
}

// The unit a CTA of a sequential pass takes. The exact fallback (warm = 2) runs only in each sequence's first unit,
// so it is launched with one CTA per sequence (pass_grid_units) and CTA x takes sequence x's first unit (every
// sequence has one: make_layout keeps a unit for an empty sequence); otherwise CTA x takes unit x.
__device__ __forceinline__ int pass_unit(const Params& p) {
  const int x = static_cast<int>(blockIdx.x);
  if (p.warm != 2) return x;
  return p.unit_off != nullptr ? min(p.unit_off[x], p.num_units - 1) : x * p.segs_per_seq;
}

// What one CTA of a sequential pass does: walk chunks [rb, re), store outputs of chunks [ob, oe), start from zero
// (a proven warm-up) or from the initial state, and store the final state (forward) / initial-state gradient
// (reverse) or not.
struct Run {
  int rb, re, ob, oe;
  bool zero, fin;
};

// The run of CTA (unit u, tile vt, value head hv); false when it has nothing to do. Called by every thread.
// walk(edge, bound, rev, state): warm_walk's result for this CTA (a kernel without lnorm in memory forms the
// bounds it reads itself).
template <bool REV, class Walk>
__device__ __forceinline__ bool plan_run(const Params& p, int u, const Unit& un, int hv, int vt, Run& r, Walk&& walk) {
  r.rb = r.ob = un.cb;
  r.re = r.oe = un.ce;
  r.zero = false;
  r.fin = true;
  if (p.warm == 0) return true;
  int s0, s1, u0, u1;
  seq_range(p, un.n, s0, s1, u0, u1);
  if (p.warm == 2) {  // the exact fallback: the sequence's first unit runs it whole where a segment failed
    if (u != u0) return false;  // (pass_unit gives every CTA a first unit)
    int bad = 0;
    for (int i = u0 + static_cast<int>(threadIdx.x); i < u1; i += blockDim.x)
      bad |= p.seg_ok[static_cast<int64_t>(i) * p.HV + hv] == 0;
    if (!__syncthreads_or(bad)) return false;
    r.rb = r.ob = s0;
    r.re = r.oe = s1;
    return true;
  }
  int state;
  if (!REV) {
    r.rb = walk(un.cb, s0, false, state);
    r.fin = un.ce >= s1;  // the last segment holds the final state
  } else {
    r.re = walk(un.ce, s1, true, state);
    r.fin = un.cb <= s0;  // the first segment holds the initial-state gradient
  }
  r.zero = state == 0;
  if (vt == 0 && threadIdx.x == 0) p.seg_ok[static_cast<int64_t>(u) * p.HV + hv] = state >= 0 ? 1 : 0;
  return state >= 0;
}
template <bool REV>
__device__ __forceinline__ bool plan_run(const Params& p, int u, const Unit& un, int hv, int vt, Run& r) {
  auto walk = [&](int edge, int bound, bool rev, int& state) { return warm_walk(p, hv, edge, bound, rev, state); };
  return plan_run<REV>(p, u, un, hv, vt, r, walk);
}

}  // namespace cuda
}  // namespace gated_delta
