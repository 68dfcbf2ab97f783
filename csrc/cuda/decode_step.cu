// CUDA kernel of the fused decode step of the gated delta rule: for T (few) new tokens against a cached fp32
// state S [B, HV, K, V], updated in place. Per token (q, k L2-normalised, g = -exp(A_log) softplus(a + dt_bias),
// alpha = exp(g), beta = sigmoid(b), x2 with allow_neg_eigval):
//   u = beta (v - alpha S^T k);   o = scale (alpha S^T q + u (k . q));   S <- alpha S + k u^T
// Both reductions read the state before the update, so the state is read once and written once.
//
// Decode is memory-bound (each (b, hv) state is K*V*4 bytes, 64 KB at K = V = 128, against ~1 KB of inputs), so
// the grid splits V into column tiles: block (v tile, hv, b) of CT x RT threads, CT column threads (4 columns
// each, one float4) by RT row threads (K / RT rows each, strided by RT, so a warp reads 32 / CT full rows of
// 4 * CT floats). The state tile stays in registers across the T tokens; the column sums over K reduce with warp
// shuffles and one shared-memory step across the warps. The state is loaded and stored with streaming
// (evict-first) hints: it is touched once per step (benchmarks/RESULTS.md, "CUDA design measurements").
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>

#include "../checks.h"
#include "device_utils.cuh"

namespace gated_delta {
namespace cuda {
namespace {

constexpr int kDecodeVMultiple = 4;  // V granularity of the decode kernel (one float4 per column thread)

// Sizes (DecodeSizes: B, T, H, HV, K, V), inputs and outputs of the decode kernel.
struct DecodeParams : DecodeSizes {
  const void* q = nullptr;        // [B, T, H, K], dtype
  const void* k = nullptr;        // [B, T, H, K], dtype
  const void* v = nullptr;        // [B, T, HV, V], dtype
  const void* a = nullptr;        // [B, T, HV], a_dtype
  const void* b = nullptr;        // [B, T, HV], b_dtype
  const void* A_log = nullptr;    // [HV], A_dtype
  const void* dt_bias = nullptr;  // [HV], dt_dtype
  float* state = nullptr;         // [B, HV, K, V] fp32, 16-byte aligned, updated in place
  void* o = nullptr;              // [B, T, HV, V], dtype
  DType dtype = DType::kFloat, a_dtype = DType::kFloat, b_dtype = DType::kFloat, A_dtype = DType::kFloat,
        dt_dtype = DType::kFloat;
  float scale = 1.f;
  bool allow_neg_eigval = false;
};

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

template <class T, int K, int CT, int RT, bool STREAM>
__global__ void __launch_bounds__(CT * RT) decode_step_kernel(DecodeParams p) {
  constexpr int kThreads = CT * RT, kWarps = kThreads / 32, kTileV = 4 * CT, kRowThreads = RT;
  static_assert(kThreads % 32 == 0 && 32 % CT == 0, "a warp holds whole rows of column threads");
  static_assert(K % RT == 0, "K must be a multiple of the row threads");
  constexpr int RPT = K / RT;  // rows per thread
  const int tid = threadIdx.x, tx = tid % CT, ty = tid / CT;
  const int warp = tid / 32, lane = tid % 32;
  const int64_t hv = blockIdx.y, b = blockIdx.z;
  const int64_t h = hv / (p.HV / p.H);
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTileV + tx * 4;  // this thread's 4 columns
  const bool active = c0 < p.V;  // V % 4 == 0: the 4 columns are in range together

  float* S = p.state + (b * p.HV + hv) * static_cast<int64_t>(K) * p.V;
  float4 s[RPT];
#pragma unroll
  for (int i = 0; i < RPT; ++i) {
    const int r = ty + kRowThreads * i;
    s[i] = active ? load_state<STREAM>(S + r * p.V + c0) : make_float4(0.f, 0.f, 0.f, 0.f);
  }

  __shared__ float q_sh[K], k_sh[K];
  __shared__ float norm_part[kWarps][3];
  __shared__ float4 sk_part[kWarps][CT], sq_part[kWarps][CT];

  const float neg_A = -__expf(load_as_float(p.A_log, p.A_dtype, hv));
  const float dt_bias = load_as_float(p.dt_bias, p.dt_dtype, hv);
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  T* o = static_cast<T*>(p.o);

  for (int64_t t = 0; t < p.T; ++t) {
    const int64_t tok = b * p.T + t;
    __syncthreads();  // the previous token's shared-memory reads are done

    // q, k of this head into shared memory, with |q|^2, |k|^2, q.k
    float qq = 0.f, kk = 0.f, qk = 0.f;
    for (int i = tid; i < K; i += kThreads) {
      const float qv = to_f(q[(tok * p.H + h) * K + i]);
      const float kv = to_f(k[(tok * p.H + h) * K + i]);
      q_sh[i] = qv;
      k_sh[i] = kv;
      qq += qv * qv;
      kk += kv * kv;
      qk += qv * kv;
    }
    qq = warp_sum(qq);
    kk = warp_sum(kk);
    qk = warp_sum(qk);
    if (lane == 0) {
      norm_part[warp][0] = qq;
      norm_part[warp][1] = kk;
      norm_part[warp][2] = qk;
    }
    __syncthreads();
    qq = kk = qk = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      qq += norm_part[w][0];
      kk += norm_part[w][1];
      qk += norm_part[w][2];
    }
    const float rq = rsqrtf(qq + 1e-6f), rk = rsqrtf(kk + 1e-6f);
    const float qk_unit = qk * rq * rk;

    const float ga = load_as_float(p.a, p.a_dtype, tok * p.HV + hv) + dt_bias;
    const float softplus = ga > 20.f ? ga : log1pf(__expf(ga));
    const float alpha = __expf(neg_A * softplus);
    float beta = sigmoidf_(load_as_float(p.b, p.b_dtype, tok * p.HV + hv));
    if (p.allow_neg_eigval) beta *= 2.f;

    // column sums over K of S k and S q (the state before this token's update)
    float kr[RPT];
    float4 pk = make_float4(0.f, 0.f, 0.f, 0.f), pq = pk;
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int r = ty + kRowThreads * i;
      kr[i] = k_sh[r] * rk;
      const float qr = q_sh[r] * rq;
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
      sk_part[warp][tx] = pk;
      sq_part[warp][tx] = pq;
    }
    __syncthreads();
    float4 sk = sk_part[0][tx], sq = sq_part[0][tx];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      const float4 a = sk_part[w][tx], c = sq_part[w][tx];
      sk.x += a.x; sk.y += a.y; sk.z += a.z; sk.w += a.w;
      sq.x += c.x; sq.y += c.y; sq.z += c.z; sq.w += c.w;
    }

    float4 u = make_float4(0.f, 0.f, 0.f, 0.f);
    if (active) {
      const T* vr = v + (tok * p.HV + hv) * p.V + c0;
      u.x = beta * (to_f(vr[0]) - alpha * sk.x);
      u.y = beta * (to_f(vr[1]) - alpha * sk.y);
      u.z = beta * (to_f(vr[2]) - alpha * sk.z);
      u.w = beta * (to_f(vr[3]) - alpha * sk.w);
      if (ty == 0) {
        T* orow = o + (tok * p.HV + hv) * p.V + c0;
        orow[0] = from_f<T>(p.scale * (alpha * sq.x + u.x * qk_unit));
        orow[1] = from_f<T>(p.scale * (alpha * sq.y + u.y * qk_unit));
        orow[2] = from_f<T>(p.scale * (alpha * sq.z + u.z * qk_unit));
        orow[3] = from_f<T>(p.scale * (alpha * sq.w + u.w * qk_unit));
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

  if (active) {
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int r = ty + kRowThreads * i;
      store_state<STREAM>(S + r * p.V + c0, s[i]);
    }
  }
}

template <class T, int K, int CT, int RT, bool STREAM>
void launch_config(const DecodeParams& p, cudaStream_t stream) {
  constexpr int kTileV = 4 * CT;
  dim3 grid(static_cast<unsigned>((p.V + kTileV - 1) / kTileV), static_cast<unsigned>(p.HV),
            static_cast<unsigned>(p.B));
  decode_step_kernel<T, K, CT, RT, STREAM><<<grid, CT * RT, 0, stream>>>(p);
  GD_CUDA_LAUNCH_CHECK();
}

// 64-column tiles of 16 x 8 threads (16 rows per thread) with streaming state loads and stores: the best of the
// shapes measured (benchmarks/RESULTS.md, "CUDA design measurements").
template <class T, int K>
void launch(const DecodeParams& p, cudaStream_t stream) {
  launch_config<T, K, 16, 8, true>(p, stream);
}

void launch_decode_step(const DecodeParams& p, cudaStream_t stream) {
  if (p.B == 0 || p.T == 0) return;
  GD_DTYPE_SWITCH(p.dtype, T, [&] {
    GD_HEADK_SWITCH_IN(DecodeHeadDims, p.K, KC, [&] { launch<T, KC>(p, stream); });
  });
}

// ---- host side ----

at::Tensor decode_step_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& a,
                            const at::Tensor& b, const at::Tensor& A_log, const at::Tensor& dt_bias,
                            at::Tensor& state, double scale, bool allow_neg_eigval) {
  const DecodeSizes s = check_decode_step_args(q, k, v, a, b, A_log, dt_bias, state, scale);
  TORCH_CHECK(is_head_dim(s.K, DecodeHeadDims{}), "q must have K in ", head_dims_str(DecodeHeadDims{}),
              " for the CUDA decode step, got K = ", s.K);
  TORCH_CHECK(s.V % kDecodeVMultiple == 0, "v must have V a multiple of ", kDecodeVMultiple,
              " for the CUDA decode step, got V = ", s.V);
  TORCH_CHECK(s.B <= 65535 && s.HV <= 65535, "the CUDA decode step supports B, HV <= 65535, got B = ", s.B,
              ", HV = ", s.HV);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(state.data_ptr()) % 16 == 0,
              "state must be 16-byte aligned for the CUDA decode step (it is read as float4)");
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  const at::Tensor Ac = A_log.contiguous(), dc = dt_bias.contiguous();
  at::Tensor o = at::empty({s.B, s.T, s.HV, s.V}, v.options());
  DecodeParams p;
  p.q = qc.data_ptr();
  p.k = kc.data_ptr();
  p.v = vc.data_ptr();
  p.a = ac.data_ptr();
  p.b = bc.data_ptr();
  p.A_log = Ac.data_ptr();
  p.dt_bias = dc.data_ptr();
  p.state = state.data_ptr<float>();
  p.o = o.data_ptr();
  static_cast<DecodeSizes&>(p) = s;
  p.dtype = dtype_of(q.scalar_type(), "q");
  p.a_dtype = dtype_of(a.scalar_type(), "a");
  p.b_dtype = dtype_of(b.scalar_type(), "b");
  p.A_dtype = dtype_of(A_log.scalar_type(), "A_log");
  p.dt_dtype = dtype_of(dt_bias.scalar_type(), "dt_bias");
  p.scale = static_cast<float>(scale);
  p.allow_neg_eigval = allow_neg_eigval;
  launch_decode_step(p, at::cuda::getCurrentCUDAStream());
  return o;
}

}  // namespace

TORCH_LIBRARY_IMPL(gated_delta, CUDA, m) { m.impl("decode_step", &decode_step_cuda); }

}  // namespace cuda
}  // namespace gated_delta
