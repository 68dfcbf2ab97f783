// The scan's second level: per (sequence, value head, 64-row tile of the transposed state) compose the maps of the
// sequence's units in order (forward) or in reverse order (backward), in fp32:
//   X^T <- X^T A_u^T + B_u^T   with the map rows of unit u as written by the state kernels in map mode.
// Before each step the current X is stored as that unit's starting state (forward: the state entering the unit;
// reverse: the gradient of the state leaving it), and at the end the final one (final state / initial-state
// gradient). Unit states use the [K][V] layout; the caller's (init, fin) [K][V], or [V][K] with state_vk.
#include "../dispatch.cuh"
#include "params.h"

namespace gated_delta {
namespace cuda {

template <int K>
__global__ void __launch_bounds__(256) combine_kernel(const Params p, int reverse) {
  constexpr int RPT = 64 * K / 256;  // rows of the tile per thread
  extern __shared__ __align__(16) unsigned char smem[];
  float* X = reinterpret_cast<float*>(smem);  // [64][K]: X^T rows v, columns k

  const int n = blockIdx.x, hv = blockIdx.y, rt = blockIdx.z;
  const int tid = threadIdx.x;
  const int kcol = tid % K, rb = tid / K;
  int u0, u1;
  if (p.unit_off != nullptr) {
    u0 = p.unit_off[n];
    u1 = p.unit_off[n + 1];
  } else {
    u0 = n * p.segs_per_seq;
    u1 = u0 + p.segs_per_seq;
  }
  u0 = max(0, min(u0, p.num_units));
  u1 = max(u0, min(u1, p.num_units));
  const int64_t KV = static_cast<int64_t>(K) * p.V;
  // element (k, v) of the caller's states at [k * sk + v * sv]
  const int64_t sk = p.state_vk ? 1 : p.V, sv = p.state_vk ? K : 1;
  const float* init = p.init != nullptr ? p.init + (static_cast<int64_t>(n) * p.HV + hv) * KV : nullptr;
  for (int e = tid; e < 64 * K; e += 256) {
    const int v = e / K, k = e % K;
    X[e] = init != nullptr ? init[k * sk + (rt * 64 + v) * sv] : 0.f;
  }
  __syncthreads();
  for (int s = 0; s < u1 - u0; ++s) {
    const int u = reverse ? (u1 - 1 - s) : (u0 + s);
    float* st = p.segstate + (static_cast<int64_t>(u) * p.HV + hv) * KV;
    for (int e = tid; e < 64 * K; e += 256) {
      const int v = e / K, k = e % K;
      st[static_cast<int64_t>(k) * p.V + rt * 64 + v] = X[e];
    }
    const float* mp = p.segmap + (static_cast<int64_t>(u) * p.HV + hv) * (p.V + K) * K;
    float acc[RPT];
#pragma unroll
    for (int r = 0; r < RPT; ++r) acc[r] = mp[static_cast<int64_t>(rt * 64 + rb * RPT + r) * K + kcol];
    const float* ma = mp + static_cast<int64_t>(p.V) * K;
#pragma unroll 4
    for (int m = 0; m < K; ++m) {
      const float a = ma[m * K + kcol];
#pragma unroll
      for (int r = 0; r < RPT; ++r) acc[r] += X[(rb * RPT + r) * K + m] * a;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < RPT; ++r) X[(rb * RPT + r) * K + kcol] = acc[r];
    __syncthreads();
  }
  if (p.fin != nullptr) {
    float* f = p.fin + (static_cast<int64_t>(n) * p.HV + hv) * KV;
    for (int e = tid; e < 64 * K; e += 256) {
      const int v = e / K, k = e % K;
      f[k * sk + (rt * 64 + v) * sv] = X[e];
    }
  }
}

void launch_combine(const Params& p, int reverse, void* stream) {
  if (p.N == 0) return;
  GD_HEADK_SWITCH(p.K, KC, [&] {
    const size_t smem = sizeof(float) * 64 * KC;
    auto kern = combine_kernel<KC>;
    GD_CUDA_CHECK(set_max_smem(reinterpret_cast<const void*>(kern), smem));
    kern<<<dim3(p.N, p.HV, p.V / 64), 256, smem, static_cast<cudaStream_t>(stream)>>>(p, reverse);
    GD_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace cuda
}  // namespace gated_delta
