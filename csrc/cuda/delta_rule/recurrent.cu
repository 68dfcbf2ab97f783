// The recurrent CUDA kernels of the gated delta rule with per-key / per-value decays (recurrent.h), per token:
//   S <- diag(r) S diag(c), r = exp(g + gk), c = exp(gv);  u = beta (v - S^T k);  S <- S + k u^T;  o = scale S^T q
// Backward per token (D = dL/dS_t + scale q do^T, S0 = S_{t-1}, F = r c^T, Sd = F o S0, w = D^T k, p = Sd^T k):
//   dq = scale S_t do   dv = beta w   dbeta = w . (v - p)   dk = D u - beta Sd w
//   dSd = D - beta k w^T   Z = dSd o Sd: dgk = Z 1, dgv = Z^T 1, dg = 1^T Z 1   dS_{t-1} = F o dSd
#include "recurrent.h"

#include <type_traits>

#include "../device_utils.cuh"

namespace gated_delta {
namespace cuda {
namespace {

constexpr int kThreads = kRecWarps * 32;

__device__ __forceinline__ void store_from_float(void* p, DType dtype, int64_t i, float x) {
  switch (dtype) {
    case DType::kBFloat16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x); break;
    case DType::kHalf: static_cast<__half*>(p)[i] = __float2half_rn(x); break;
    default: static_cast<float*>(p)[i] = x; break;
  }
}

struct Seq {
  int64_t bos, len;
};

__device__ __forceinline__ Seq seq_of(const RecParams& p, int n) {
  if (p.cu != nullptr) {
    const int64_t b = p.cu[n], e = p.cu[n + 1];
    return Seq{b, e > b ? e - b : 0};
  }
  return Seq{int64_t(n) * p.T, p.T};
}

// Where a CTA works: sequence n, value head hv (its q/k head h), column tile vt; this thread's column j.
struct Place {
  int n, hv, h, vt, warp, lane, j;
  bool col_ok;
};

__device__ __forceinline__ Place place_of(const RecParams& p) {
  Place c;
  c.vt = blockIdx.x % p.nvt;
  const int nh = blockIdx.x / p.nvt;
  c.n = nh / p.HV;
  c.hv = nh % p.HV;
  c.h = c.hv / p.G;
  c.warp = threadIdx.x / 32;
  c.lane = threadIdx.x % 32;
  c.j = c.vt * kRecCols + c.lane;
  c.col_ok = c.j < p.V;
  return c;
}

// The inputs of one token (rows past K: q = k = r = 0; columns past V: v = d_o = 0, c = 1), and the cross-warp
// reduction buffers.
template <int RK>
struct TokenSmem {
  static constexpr int KP = kRecWarps * RK;
  float q[KP], k[KP], r[KP];
  float v[kRecCols], c[kRecCols], d_o[kRecCols];
  float red[3][kRecWarps][kRecCols];
};

// Loads token tok into shared memory (q and d_o only when asked), then synchronises the block.
template <int RK>
__device__ __forceinline__ void load_token(const RecParams& p, TokenSmem<RK>& sm, const Place& c, int64_t tok,
                                           bool with_q, bool with_do) {
  const float g = p.g[tok * p.HV + c.hv];
  for (int i = threadIdx.x; i < TokenSmem<RK>::KP; i += kThreads) {
    float qi = 0.f, ki = 0.f, ri = 0.f;
    if (i < p.K) {
      const int64_t off = (tok * p.H + c.h) * p.K + i;
      ki = load_as_float(p.k, p.qk_dtype, off);
      if (with_q) qi = load_as_float(p.q, p.qk_dtype, off);
      ri = expf(p.gk != nullptr ? g + p.gk[(tok * p.HV + c.hv) * p.K + i] : g);
    }
    sm.q[i] = qi;
    sm.k[i] = ki;
    sm.r[i] = ri;
  }
  if (threadIdx.x < kRecCols) {
    const int j = c.vt * kRecCols + threadIdx.x;
    float vj = 0.f, cj = 1.f, dj = 0.f;
    if (j < p.V) {
      const int64_t off = (tok * p.HV + c.hv) * p.V + j;
      vj = load_as_float(p.v, p.v_dtype, off);
      if (p.gv != nullptr) cj = expf(p.gv[off]);
      if (with_do) dj = load_as_float(p.d_o, p.do_dtype, off);
    }
    sm.v[threadIdx.x] = vj;
    sm.c[threadIdx.x] = cj;
    sm.d_o[threadIdx.x] = dj;
  }
  __syncthreads();
}

// One token of this thread's part of the state (decay, delta update); synchronises once (red[0]). The caller
// synchronises again before the next load_token.
template <int RK>
__device__ __forceinline__ void advance(float (&S)[RK], TokenSmem<RK>& sm, const Place& c, float beta) {
  const float cj = sm.c[c.lane];
  float part = 0.f;
#pragma unroll
  for (int r = 0; r < RK; ++r) {
    const int i = c.warp + kRecWarps * r;
    S[r] *= sm.r[i] * cj;
    part += sm.k[i] * S[r];
  }
  sm.red[0][c.warp][c.lane] = part;
  __syncthreads();
  float pj = 0.f;
#pragma unroll
  for (int w = 0; w < kRecWarps; ++w) pj += sm.red[0][w][c.lane];
  const float u = beta * (sm.v[c.lane] - pj);
#pragma unroll
  for (int r = 0; r < RK; ++r) S[r] += sm.k[c.warp + kRecWarps * r] * u;
}

// This thread's part of a [.., K, V] fp32 state (rows past K, columns past V: zero).
// Offset of state element (row i of K, column j of V) within one [K, V] (or, state_v_first, [V, K]) state.
__device__ __forceinline__ int64_t state_index(const RecParams& p, int i, int j) {
  return p.state_v_first ? int64_t(j) * p.K + i : int64_t(i) * p.V + j;
}

template <int RK>
__device__ __forceinline__ void load_tile(float (&S)[RK], const float* src, const RecParams& p, const Place& c) {
#pragma unroll
  for (int r = 0; r < RK; ++r) {
    const int i = c.warp + kRecWarps * r;
    S[r] = (src != nullptr && i < p.K && c.col_ok) ? src[state_index(p, i, c.j)] : 0.f;
  }
}

template <int RK>
__device__ __forceinline__ void store_tile(const float (&S)[RK], float* dst, const RecParams& p, const Place& c) {
#pragma unroll
  for (int r = 0; r < RK; ++r) {
    const int i = c.warp + kRecWarps * r;
    if (i < p.K && c.col_ok) dst[state_index(p, i, c.j)] = S[r];
  }
}

template <int RK>
__global__ void __launch_bounds__(kThreads) recurrent_fwd_kernel(const RecParams p) {
  __shared__ TokenSmem<RK> sm;
  const Place c = place_of(p);
  const Seq s = seq_of(p, c.n);
  const int64_t state_off = (int64_t(c.n) * p.HV + c.hv) * p.K * p.V;
  float S[RK];
  load_tile(S, p.h0 != nullptr ? p.h0 + state_off : nullptr, p, c);
  for (int64_t t = 0; t < s.len; ++t) {
    const int64_t tok = s.bos + t;
    load_token(p, sm, c, tok, /*with_q=*/true, /*with_do=*/false);
    advance(S, sm, c, p.beta[tok * p.HV + c.hv]);
    float po = 0.f;
#pragma unroll
    for (int r = 0; r < RK; ++r) po += sm.q[c.warp + kRecWarps * r] * S[r];
    sm.red[1][c.warp][c.lane] = po;
    __syncthreads();
    if (c.warp == 0 && c.col_ok) {
      float oj = 0.f;
#pragma unroll
      for (int w = 0; w < kRecWarps; ++w) oj += sm.red[1][w][c.lane];
      store_from_float(p.o, p.v_dtype, (tok * p.HV + c.hv) * p.V + c.j, p.scale * oj);
    }
  }
  if (p.ht != nullptr) store_tile(S, p.ht + state_off, p, c);
}

template <int RK>
__global__ void __launch_bounds__(kThreads) recurrent_bwd_kernel(const RecParams p) {
  __shared__ TokenSmem<RK> sm;
  constexpr int KP = TokenSmem<RK>::KP;
  const Place c = place_of(p);
  const Seq s = seq_of(p, c.n);
  const int64_t state_off = (int64_t(c.n) * p.HV + c.hv) * p.K * p.V;
  const int64_t ckpt0 = s.bos / kRecChunk + c.n;  // this sequence's first checkpoint slot
  const int64_t slot_stride = int64_t(p.HV) * p.K * p.V;
  auto ckpt_at = [&](int64_t chunk) { return p.ckpt + (ckpt0 + chunk) * slot_stride + int64_t(c.hv) * p.K * p.V; };
  // this thread's element of row r of scratch slot l (the thread only ever reads back what it wrote)
  float* scratch = p.scratch + int64_t(blockIdx.x) * p.scratch_slots * KP * kRecCols;
  auto sc = [&](int l, int r) -> float& {
    return scratch[(int64_t(l) * KP + c.warp + kRecWarps * r) * kRecCols + c.lane];
  };
  const int nch = static_cast<int>((s.len + kRecChunk - 1) / kRecChunk);

  // 1. forward from the initial state, keeping the state entering every chunk
  float S[RK];
  load_tile(S, p.h0 != nullptr ? p.h0 + state_off : nullptr, p, c);
  for (int64_t t = 0; t < s.len; ++t) {
    if (t % kRecChunk == 0) store_tile(S, ckpt_at(t / kRecChunk), p, c);
    const int64_t tok = s.bos + t;
    load_token(p, sm, c, tok, false, false);
    advance(S, sm, c, p.beta[tok * p.HV + c.hv]);
    __syncthreads();
  }

  // 2. chunks from the last: recompute the chunk's states into scratch, then walk its tokens backwards
  float D[RK];
  load_tile(D, p.dht != nullptr ? p.dht + state_off : nullptr, p, c);
  const int gi = c.hv % p.G;
  for (int ch = nch - 1; ch >= 0; --ch) {
    const int64_t t0 = int64_t(ch) * kRecChunk, t1 = s.len < t0 + kRecChunk ? s.len : t0 + kRecChunk;
    load_tile(S, ckpt_at(ch), p, c);
#pragma unroll
    for (int r = 0; r < RK; ++r) sc(0, r) = S[r];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t tok = s.bos + t;
      load_token(p, sm, c, tok, false, false);
      advance(S, sm, c, p.beta[tok * p.HV + c.hv]);
      __syncthreads();
#pragma unroll
      for (int r = 0; r < RK; ++r) sc(static_cast<int>(t - t0) + 1, r) = S[r];
    }
    float S1[RK];  // the state after token t; S holds the state after the chunk's last token
#pragma unroll
    for (int r = 0; r < RK; ++r) S1[r] = S[r];
    for (int64_t t = t1 - 1; t >= t0; --t) {
      const int64_t tok = s.bos + t;
      load_token(p, sm, c, tok, true, true);
      const float beta = p.beta[tok * p.HV + c.hv];
      const int l = static_cast<int>(t - t0);
      float S0[RK];
#pragma unroll
      for (int r = 0; r < RK; ++r) S0[r] = sc(l, r);
      const float dj = sm.d_o[c.lane], cj = sm.c[c.lane];
      float wp = 0.f, pp = 0.f;
      const int64_t qk_part = ((tok * p.H + c.h) * (int64_t(p.G) * p.nvt) + int64_t(gi) * p.nvt + c.vt) * p.K;
      const int64_t hv_tok = tok * p.HV + c.hv;
#pragma unroll
      for (int r = 0; r < RK; ++r) {
        const int i = c.warp + kRecWarps * r;
        D[r] += p.scale * sm.q[i] * dj;
        wp += sm.k[i] * D[r];
        pp += sm.k[i] * sm.r[i] * S0[r];
        const float dq = warp_sum(S1[r] * dj);
        if (c.lane == 0 && i < p.K) p.dq_part[qk_part + i] = p.scale * dq;
      }
      sm.red[0][c.warp][c.lane] = wp;
      sm.red[1][c.warp][c.lane] = pp;
      __syncthreads();
      float w = 0.f, pj = 0.f;
#pragma unroll
      for (int ww = 0; ww < kRecWarps; ++ww) {
        w += sm.red[0][ww][c.lane];
        pj += sm.red[1][ww][c.lane];
      }
      pj *= cj;
      const float rj = sm.v[c.lane] - pj, u = beta * rj, cw = cj * w;
      if (c.warp == 0) {
        if (c.col_ok) p.dv[hv_tok * p.V + c.j] = beta * w;
        const float db = warp_sum(w * rj);
        if (c.lane == 0) p.dbeta_part[hv_tok * p.nvt + c.vt] = db;
      }
      float zcol = 0.f;
#pragma unroll
      for (int r = 0; r < RK; ++r) {
        const int i = c.warp + kRecWarps * r;
        const float ri = sm.r[i];
        const float dk = warp_sum(D[r] * u - beta * ri * S0[r] * cw);
        const float dsd = D[r] - beta * sm.k[i] * w;
        const float f = ri * cj;
        const float z = dsd * f * S0[r];
        zcol += z;
        D[r] = f * dsd;
        if (p.dgk_part != nullptr) {
          const float dgk = warp_sum(z);
          if (c.lane == 0 && i < p.K) p.dgk_part[(hv_tok * p.nvt + c.vt) * p.K + i] = dgk;
        }
        if (c.lane == 0 && i < p.K) p.dk_part[qk_part + i] = dk;
      }
      sm.red[2][c.warp][c.lane] = zcol;
      __syncthreads();
      if (c.warp == 0) {
        float dgv = 0.f;
#pragma unroll
        for (int ww = 0; ww < kRecWarps; ++ww) dgv += sm.red[2][ww][c.lane];
        if (p.dgv != nullptr && c.col_ok) p.dgv[hv_tok * p.V + c.j] = dgv;
        const float dg = warp_sum(dgv);
        if (c.lane == 0) p.dg_part[hv_tok * p.nvt + c.vt] = dg;
      }
#pragma unroll
      for (int r = 0; r < RK; ++r) S1[r] = S0[r];
    }
  }
  if (p.dh0 != nullptr) store_tile(D, p.dh0 + state_off, p, c);
}

__global__ void sum_parts_kernel(const float* __restrict in, float* __restrict out, int64_t rows, int P, int E) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * E) return;
  const int64_t r = idx / E, e = idx % E;
  const float* src = in + r * P * E + e;
  float acc = 0.f;
  for (int i = 0; i < P; ++i) acc += src[int64_t(i) * E];
  out[idx] = acc;
}

// K -> RK (rec_rows_per_thread), as a compile-time constant.
template <class F>
void rows_switch(int64_t K, F&& f) {
  switch (rec_rows_per_thread(K)) {
    case 4: return f(std::integral_constant<int, 4>{});
    case 8: return f(std::integral_constant<int, 8>{});
    case 16: return f(std::integral_constant<int, 16>{});
    default: return f(std::integral_constant<int, 32>{});
  }
}

}  // namespace

void launch_recurrent_fwd(const RecParams& p, void* stream) {
  const int64_t ctas = int64_t(p.N) * p.HV * p.nvt;
  if (ctas == 0) return;
  rows_switch(p.K, [&](auto rk) {
    recurrent_fwd_kernel<decltype(rk)::value>
        <<<static_cast<unsigned>(ctas), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
    GD_CUDA_LAUNCH_CHECK();
  });
}

void launch_recurrent_bwd(const RecParams& p, void* stream) {
  const int64_t ctas = int64_t(p.N) * p.HV * p.nvt;
  if (ctas == 0) return;
  rows_switch(p.K, [&](auto rk) {
    recurrent_bwd_kernel<decltype(rk)::value>
        <<<static_cast<unsigned>(ctas), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
    GD_CUDA_LAUNCH_CHECK();
  });
}

void launch_sum_parts(const float* in, float* out, int64_t rows, int P, int E, void* stream) {
  const int64_t n = rows * E;
  if (n == 0) return;
  constexpr int kBlock = 256;
  sum_parts_kernel<<<static_cast<unsigned>((n + kBlock - 1) / kBlock), kBlock, 0,
                     static_cast<cudaStream_t>(stream)>>>(in, out, rows, P, E);
  GD_CUDA_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace gated_delta
