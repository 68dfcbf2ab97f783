// The register tile shared by the two CUDA decode kernels (the decode step, decode_step.cu, and the state-pool
// decode, decode_pool.cu): one block holds a [K, 4 CT] column tile of one head's fp32 state in registers and
// advances it by one token at a time. Per token (q, k L2-normalised when asked; alpha = exp(g)):
//   u = beta (v - alpha S^T k);   o = scale (alpha S^T q + u (k . q));   S <- alpha S + k u^T
// Both reductions read the state before the update, so the state is read once and written once.
//
// The block is CT x RT threads: CT column threads (4 columns each, one float4) by RT row threads (K / RT rows
// each, strided by RT, so a warp reads 32 / CT full rows of 4 * CT floats). The column sums over K reduce with
// warp shuffles and one shared-memory step across the warps. The state is loaded and stored with streaming
// (evict-first) hints when STREAM: it is touched once per step. The host side of both ops checks the tile's
// limits with check_decode_tile_limits and launches decode_grid() blocks of the shape below.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>

#include "device_utils.cuh"

namespace gated_delta {
namespace cuda {

// V granularity of the tile (one float4 per column thread).
constexpr int kDecodeVMultiple = 4;
// The tile shape of both ops: 64-column tiles of 16 x 8 threads with streaming state loads and stores, the best of
// the shapes measured (benchmarks/RESULTS.md, "CUDA design measurements").
constexpr int kDecodeColThreads = 16, kDecodeRowThreads = 8;

// Grid of a decode kernel: (V tiles of 4 CT columns, value heads, rows).
inline dim3 decode_grid(int64_t V, int64_t HV, int64_t rows, int CT = kDecodeColThreads) {
  return dim3(static_cast<unsigned>(ceil_div(V, 4 * CT)), static_cast<unsigned>(HV), static_cast<unsigned>(rows));
}

// The limits of the tile, for an op on `rows` rows (the grid's z extent, named rows_name in the message) and a
// state whose base address is state (16-byte aligned: it is read as float4).
inline void check_decode_tile_limits(const char* op, int64_t K, int64_t V, int64_t HV, int64_t rows,
                                     const char* rows_name, const void* state, const char* state_name) {
  TORCH_CHECK(is_head_dim(K, DecodeHeadDims{}), "q must have K in ", head_dims_str(DecodeHeadDims{}), " for the CUDA ",
              op, ", got K = ", K);
  TORCH_CHECK(V % kDecodeVMultiple == 0, "v must have V a multiple of ", kDecodeVMultiple, " for the CUDA ", op,
              ", got V = ", V);
  TORCH_CHECK(rows <= 65535 && HV <= 65535, "the CUDA ", op, " supports ", rows_name, ", HV <= 65535, got ",
              rows_name, " = ", rows, ", HV = ", HV);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(state) % 16 == 0, state_name, " must be 16-byte aligned for the CUDA ", op,
              " (it is read as float4)");
}

// Sum over the row threads of a warp that share a column thread (lanes tx, tx + CT, tx + 2 CT, ...).
template <int CT>
__device__ __forceinline__ float4 rows_sum(float4 v) {
#pragma unroll
  for (int o = CT; o < 32; o <<= 1) {
    v.x += __shfl_xor_sync(0xffffffffu, v.x, o);
    v.y += __shfl_xor_sync(0xffffffffu, v.y, o);
    v.z += __shfl_xor_sync(0xffffffffu, v.z, o);
    v.w += __shfl_xor_sync(0xffffffffu, v.w, o);
  }
  return v;
}

template <bool STREAM>
__device__ __forceinline__ float4 load_state(const float* p) {
  if constexpr (STREAM) return __ldcs(reinterpret_cast<const float4*>(p));
  return *reinterpret_cast<const float4*>(p);
}

template <bool STREAM>
__device__ __forceinline__ void store_state(float* p, float4 v) {
  if constexpr (STREAM) {
    __stcs(reinterpret_cast<float4*>(p), v);
  } else {
    *reinterpret_cast<float4*>(p) = v;
  }
}

// alpha = exp(-exp(A_log) softplus(a + dt_bias)), given neg_A = -exp(A_log).
__device__ __forceinline__ float gate_alpha(float a, float neg_A, float dt_bias) {
  return __expf(neg_A * softplusf_(a + dt_bias));
}

template <int K, int CT, int RT>
struct DecodeTile {
  static constexpr int kThreads = CT * RT, kWarps = kThreads / 32, kTileV = 4 * CT, RPT = K / RT;
  static_assert(kThreads % 32 == 0 && 32 % CT == 0, "a warp holds whole rows of column threads");
  static_assert(K % RT == 0, "K must be a multiple of the row threads");

  struct Shared {
    float q[K], k[K];
    float norm[kWarps][3];
    float4 sk[kWarps][CT], sq[kWarps][CT];
  };

  float4 s[RPT];  // rows ty + RT i, columns c0 .. c0 + 3
  int tid, tx, ty, warp, lane;

  __device__ __forceinline__ DecodeTile()
      : tid(threadIdx.x), tx(threadIdx.x % CT), ty(threadIdx.x / CT), warp(threadIdx.x / 32),
        lane(threadIdx.x % 32) {}

  // The first of this thread's 4 columns in the V tile `tile`.
  __device__ __forceinline__ int64_t column(int64_t tile) const { return tile * kTileV + tx * 4; }

  // S: one head's [K, V] state (row stride V). Inactive threads (columns past V) hold zeros.
  template <bool STREAM>
  __device__ __forceinline__ void load(const float* S, int64_t V, int64_t c0, bool active) {
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      s[i] = active ? load_state<STREAM>(S + (ty + RT * i) * V + c0) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }

  template <bool STREAM>
  __device__ __forceinline__ void store(float* S, int64_t V, int64_t c0) const {
#pragma unroll
    for (int i = 0; i < RPT; ++i) store_state<STREAM>(S + (ty + RT * i) * V + c0, s[i]);
  }

  // Writes `value` (zero or NaN) to this thread's 4 output columns: a row that is skipped.
  template <class T>
  __device__ __forceinline__ void fill_output(T* o_c0, float value, bool active) const {
    if (active && ty == 0) {
#pragma unroll
      for (int j = 0; j < 4; ++j) o_c0[j] = from_f<T>(value);
    }
  }

  // One token: q, k point at the head's [K] rows, v_c0 and o_c0 at this thread's 4 columns of the value / output
  // rows (read and written only when active). Every thread of the block must call it.
  template <class T>
  __device__ __forceinline__ void step(Shared& sh, const T* q, const T* k, const T* v_c0, T* o_c0, float alpha,
                                       float beta, float scale, bool l2norm, bool active) {
    __syncthreads();  // the previous token's shared-memory reads are done

    // q, k of this head into shared memory, with |q|^2, |k|^2, q.k
    float qq = 0.f, kk = 0.f, qk = 0.f;
    for (int i = tid; i < K; i += kThreads) {
      const float qv = to_f(q[i]);
      const float kv = to_f(k[i]);
      sh.q[i] = qv;
      sh.k[i] = kv;
      qq += qv * qv;
      kk += kv * kv;
      qk += qv * kv;
    }
    qq = warp_sum(qq);
    kk = warp_sum(kk);
    qk = warp_sum(qk);
    if (lane == 0) {
      sh.norm[warp][0] = qq;
      sh.norm[warp][1] = kk;
      sh.norm[warp][2] = qk;
    }
    __syncthreads();
    qq = kk = qk = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      qq += sh.norm[w][0];
      kk += sh.norm[w][1];
      qk += sh.norm[w][2];
    }
    const float rq = l2norm ? rsqrtf(qq + 1e-6f) : 1.f, rk = l2norm ? rsqrtf(kk + 1e-6f) : 1.f;
    const float qk_unit = qk * rq * rk;

    // column sums over K of S k and S q (the state before this token's update)
    float kr[RPT];
    float4 pk = make_float4(0.f, 0.f, 0.f, 0.f), pq = pk;
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int r = ty + RT * i;
      kr[i] = sh.k[r] * rk;
      const float qr = sh.q[r] * rq;
      pk.x += s[i].x * kr[i];
      pk.y += s[i].y * kr[i];
      pk.z += s[i].z * kr[i];
      pk.w += s[i].w * kr[i];
      pq.x += s[i].x * qr;
      pq.y += s[i].y * qr;
      pq.z += s[i].z * qr;
      pq.w += s[i].w * qr;
    }
    pk = rows_sum<CT>(pk);
    pq = rows_sum<CT>(pq);
    if (lane < CT) {
      sh.sk[warp][tx] = pk;
      sh.sq[warp][tx] = pq;
    }
    __syncthreads();
    float4 sk = sh.sk[0][tx], sq = sh.sq[0][tx];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      const float4 a = sh.sk[w][tx], c = sh.sq[w][tx];
      sk.x += a.x; sk.y += a.y; sk.z += a.z; sk.w += a.w;
      sq.x += c.x; sq.y += c.y; sq.z += c.z; sq.w += c.w;
    }

    float4 u = make_float4(0.f, 0.f, 0.f, 0.f);
    if (active) {
      u.x = beta * (to_f(v_c0[0]) - alpha * sk.x);
      u.y = beta * (to_f(v_c0[1]) - alpha * sk.y);
      u.z = beta * (to_f(v_c0[2]) - alpha * sk.z);
      u.w = beta * (to_f(v_c0[3]) - alpha * sk.w);
      if (ty == 0) {
        o_c0[0] = from_f<T>(scale * (alpha * sq.x + u.x * qk_unit));
        o_c0[1] = from_f<T>(scale * (alpha * sq.y + u.y * qk_unit));
        o_c0[2] = from_f<T>(scale * (alpha * sq.z + u.z * qk_unit));
        o_c0[3] = from_f<T>(scale * (alpha * sq.w + u.w * qk_unit));
      }
    }
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      s[i].x = alpha * s[i].x + kr[i] * u.x;
      s[i].y = alpha * s[i].y + kr[i] * u.y;
      s[i].z = alpha * s[i].z + kr[i] * u.z;
      s[i].w = alpha * s[i].w + kr[i] * u.w;
    }
  }
};

}  // namespace cuda
}  // namespace gated_delta
