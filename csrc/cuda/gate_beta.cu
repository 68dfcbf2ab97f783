// Kernels of the in-kernel gate and beta options (gate_beta.h): each element of g and beta once per direction, in
// fp32, the same operations in the same order as the ATen expressions of csrc/delta_rule.h (the exponentials those
// of the SFU, as the extension compiles with fast math: a few ulps from ATen's); the sums over batch and time in a
// fixed order (per block, then per head over the blocks), so the gradients are bitwise the same from run to run.
#include "gate_beta.h"

#include "device_utils.cuh"

namespace gated_delta {
namespace cuda {
namespace {

// element i's softplus argument g_raw + dt_bias, head h's -exp(A_log)
__device__ __forceinline__ float gate_arg(const GateBetaParams& p, int64_t i, int h) {
  const float x = load_as_float(p.g, p.g_dtype, i);
  return p.dt_bias != nullptr ? x + load_as_float(p.dt_bias, p.dt_dtype, h) : x;
}
__device__ __forceinline__ float neg_exp_a(const GateBetaParams& p, int h) {
  return -__expf(load_as_float(p.A_log, p.A_dtype, h));
}

__global__ void __launch_bounds__(kGateBetaThreads) gate_beta_fwd_kernel(const GateBetaParams p) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (p.gate) {
      const int h = static_cast<int>(i % p.HV);
      p.g_out[i] = softplusf_(gate_arg(p, i, h)) * neg_exp_a(p, h);
    }
    if (p.sigmoid) p.beta_out[i] = sigmoidf_(load_as_float(p.beta, p.beta_dtype, i)) * p.beta_mul;
  }
}

// Block b: tokens [b tokens_per_block, ...) of every head. The gate's two terms of each element go to shared memory;
// then thread h adds its head's, token by token.
__global__ void __launch_bounds__(kGateBetaThreads) gate_beta_bwd_kernel(const GateBetaParams p) {
  __shared__ float terms[2][kGateBetaTile];
  const int64_t e0 = static_cast<int64_t>(blockIdx.x) * p.tokens_per_block * p.HV;
  const int cnt = static_cast<int>(min(p.n - e0, static_cast<int64_t>(p.tokens_per_block) * p.HV));
  for (int j = threadIdx.x; j < cnt; j += blockDim.x) {
    const int64_t i = e0 + j;
    if (p.sigmoid) {
      const float s = sigmoidf_(load_as_float(p.beta, p.beta_dtype, i));
      store_as(p.dbeta_raw, p.beta_dtype, i, load_as_float(p.dbeta, p.dbeta_dtype, i) * s * (1.f - s) * p.beta_mul);
    }
    if (p.gate) {
      const int h = static_cast<int>(i % p.HV);
      const float x = gate_arg(p, i, h), neg_a = neg_exp_a(p, h), dg = p.dg[i];
      const float dgx = dg * sigmoidf_(x) * neg_a;
      store_as(p.dg_raw, p.g_dtype, i, dgx);
      terms[0][j] = dg * (softplusf_(x) * neg_a);
      terms[1][j] = dgx;
    }
  }
  if (!p.gate) return;
  __syncthreads();
  for (int h = threadIdx.x; h < p.HV; h += blockDim.x) {
    float a = 0.f, b = 0.f;
    for (int j = h; j < cnt; j += p.HV) {
      a += terms[0][j];
      b += terms[1][j];
    }
    p.partial[(2 * static_cast<int64_t>(blockIdx.x)) * p.HV + h] = a;
    p.partial[(2 * static_cast<int64_t>(blockIdx.x) + 1) * p.HV + h] = b;
  }
}

// One block per head: thread t adds blocks t, t + 256, ..., then a tree over the threads (a fixed shape)
__global__ void __launch_bounds__(kGateBetaThreads) gate_beta_sum_kernel(const GateBetaParams p) {
  __shared__ float red[2][kGateBetaThreads];
  const int h = blockIdx.x, t = threadIdx.x;
  float a = 0.f, b = 0.f;
  for (int k = t; k < p.blocks; k += kGateBetaThreads) {
    a += p.partial[(2 * static_cast<int64_t>(k)) * p.HV + h];
    b += p.partial[(2 * static_cast<int64_t>(k) + 1) * p.HV + h];
  }
  red[0][t] = a;
  red[1][t] = b;
  __syncthreads();
  for (int w = kGateBetaThreads / 2; w > 0; w >>= 1) {
    if (t < w) {
      red[0][t] += red[0][t + w];
      red[1][t] += red[1][t + w];
    }
    __syncthreads();
  }
  if (t == 0) {
    store_as(p.dA_log, p.A_dtype, h, red[0][0]);
    if (p.ddt_bias != nullptr) store_as(p.ddt_bias, p.dt_dtype, h, red[1][0]);
  }
}

}  // namespace

void launch_gate_beta_fwd(const GateBetaParams& p, int sms, cudaStream_t stream) {
  if (p.n == 0) return;
  const int64_t blocks = std::min<int64_t>(ceil_div(p.n, kGateBetaThreads), 8 * static_cast<int64_t>(sms));
  gate_beta_fwd_kernel<<<static_cast<unsigned>(blocks), kGateBetaThreads, 0, stream>>>(p);
  GD_CUDA_LAUNCH_CHECK();
}

void launch_gate_beta_bwd(const GateBetaParams& p, cudaStream_t stream) {
  if (p.blocks > 0) {
    gate_beta_bwd_kernel<<<p.blocks, kGateBetaThreads, 0, stream>>>(p);
    GD_CUDA_LAUNCH_CHECK();
  }
  if (p.gate) {  // (with no tokens, blocks = 0: the sums are zero)
    gate_beta_sum_kernel<<<p.HV, kGateBetaThreads, 0, stream>>>(p);
    GD_CUDA_LAUNCH_CHECK();
  }
}

}  // namespace cuda
}  // namespace gated_delta
