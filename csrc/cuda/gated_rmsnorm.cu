// CUDA kernels of the gated RMSNorm over the last dimension, in fp32:
//   y = x rstd w silu(g),  rstd = (mean(x^2) + eps)^(-1/2)
// One warp per row; the backward sums each block's weight gradient in shared memory and writes one partial row
// per block (summed afterwards in a fixed order: deterministic).
#include "device_utils.cuh"

namespace gated_delta {
namespace layer_cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int64_t kMaxBwdBlocks = 1024;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <class T, class Wt>
__global__ void __launch_bounds__(kThreads) gated_rmsnorm_fwd_kernel(GatedRMSNormParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= p.R) return;
  const T* x = static_cast<const T*>(p.x) + row * p.D;
  const T* g = p.gate != nullptr ? static_cast<const T*>(p.gate) + row * p.D : nullptr;
  const Wt* w = static_cast<const Wt*>(p.weight);
  T* y = static_cast<T*>(p.y) + row * p.D;
  float ss = 0.f;
  for (int64_t d = lane; d < p.D; d += 32) {
    const float v = to_float(x[d]);
    ss += v * v;
  }
  const float rs = rsqrtf(warp_sum(ss) / static_cast<float>(p.D) + p.eps);
  if (lane == 0) p.rstd[row] = rs;
  for (int64_t d = lane; d < p.D; d += 32) {
    float v = to_float(x[d]) * rs;
    if (w != nullptr) v *= to_float(w[d]);
    if (g != nullptr) {
      const float gv = to_float(g[d]);
      v *= gv * sigmoidf_(gv);
    }
    y[d] = from_float<T>(v);
  }
}

// n = x rstd;  dn = dy w s(g);  dx = rstd (dn - n mean(n dn));  dg = dy n w s'(g);  dw += dy n s(g)
template <class T, class Wt>
__global__ void __launch_bounds__(kThreads) gated_rmsnorm_bwd_kernel(GatedRMSNormParams p) {
  extern __shared__ float dw_shared[];  // [D] when a weight is given
  const int lane = threadIdx.x % 32;
  const Wt* w = static_cast<const Wt*>(p.weight);
  if (w != nullptr) {
    for (int64_t d = threadIdx.x; d < p.D; d += kThreads) dw_shared[d] = 0.f;
    __syncthreads();
  }
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; row < p.R;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const T* x = static_cast<const T*>(p.x) + row * p.D;
    const T* dy = static_cast<const T*>(p.dy) + row * p.D;
    const T* g = p.gate != nullptr ? static_cast<const T*>(p.gate) + row * p.D : nullptr;
    const float rs = p.rstd_in[row];
    float dot = 0.f;
    for (int64_t d = lane; d < p.D; d += 32) {
      float gy = to_float(dy[d]);
      if (g != nullptr) gy *= to_float(g[d]) * sigmoidf_(to_float(g[d]));
      if (w != nullptr) gy *= to_float(w[d]);
      dot += to_float(x[d]) * rs * gy;
    }
    dot = warp_sum(dot) / static_cast<float>(p.D);
    T* dx = static_cast<T*>(p.dx) + row * p.D;
    T* dg = p.dgate != nullptr ? static_cast<T*>(p.dgate) + row * p.D : nullptr;
    for (int64_t d = lane; d < p.D; d += 32) {
      const float n = to_float(x[d]) * rs;
      const float wd = w != nullptr ? to_float(w[d]) : 1.f;
      float gy = to_float(dy[d]);
      if (g != nullptr) {
        const float gv = to_float(g[d]);
        const float sg = sigmoidf_(gv);
        dg[d] = from_float<T>(gy * n * wd * sg * (1.f + gv * (1.f - sg)));
        gy *= gv * sg;
      }
      if (w != nullptr) atomicAdd(&dw_shared[d], gy * n);
      dx[d] = from_float<T>(rs * (gy * wd - n * dot));
    }
  }
  if (w != nullptr) {
    __syncthreads();
    float* part = p.dw_partial + static_cast<int64_t>(blockIdx.x) * p.D;
    for (int64_t d = threadIdx.x; d < p.D; d += kThreads) part[d] = dw_shared[d];
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

int64_t gated_rmsnorm_bwd_num_partials(int64_t R) {
  return R == 0 ? 0 : (ceil_div(R, kWarps) < kMaxBwdBlocks ? ceil_div(R, kWarps) : kMaxBwdBlocks);
}

cudaError_t gated_rmsnorm_fwd(const GatedRMSNormParams& p, cudaStream_t stream) {
  if (p.R == 0) return cudaSuccess;
  return LAYER_DTYPE_WTYPE_SWITCH(p.dtype, p.wdtype, T, Wt, [&] {
    gated_rmsnorm_fwd_kernel<T, Wt><<<static_cast<unsigned>(ceil_div(p.R, kWarps)), kThreads, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

cudaError_t gated_rmsnorm_bwd(const GatedRMSNormParams& p, cudaStream_t stream) {
  if (p.R == 0) return cudaSuccess;
  if (p.weight != nullptr && p.D > kMaxNormDim) return cudaErrorInvalidValue;
  return LAYER_DTYPE_WTYPE_SWITCH(p.dtype, p.wdtype, T, Wt, [&] {
    const size_t smem = p.weight != nullptr ? static_cast<size_t>(p.D) * sizeof(float) : 0;
    // kMaxNormDim floats fit the default 48 KB of dynamic shared memory.
    const unsigned blocks = static_cast<unsigned>(gated_rmsnorm_bwd_num_partials(p.R));
    gated_rmsnorm_bwd_kernel<T, Wt><<<blocks, kThreads, smem, stream>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace layer_cuda
}  // namespace gated_delta
