// The gated delta rule's in-kernel gate and beta options on CUDA (use_gate_in_kernel, use_beta_sigmoid_in_kernel):
// one kernel for the forward values, two for the chain rule (csrc/delta_rule.h, GateBeta, says what they compute).
// Plain parameters, so that the kernels' file needs no ATen; the host side is in delta_rule.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dispatch.cuh"

namespace gated_delta {
namespace cuda {

struct GateBetaParams {
  int64_t n = 0;  // elements of g and beta: B T HV, both contiguous (token-major, head fastest)
  int HV = 0;
  bool gate = false, sigmoid = false;
  float beta_mul = 1.f;  // 2 with allow_neg_eigval
  // the caller's g (g_raw), beta (logits), A_log [HV] and dt_bias [HV] (nullptr: none), each in its dtype
  const void* g = nullptr;
  const void* beta = nullptr;
  const void* A_log = nullptr;
  const void* dt_bias = nullptr;
  DType g_dtype = DType::kFloat, beta_dtype = DType::kFloat, A_dtype = DType::kFloat, dt_dtype = DType::kFloat;
  // forward: g and beta as the core reads them, fp32
  float* g_out = nullptr;
  float* beta_out = nullptr;
  // backward: the core's dg (fp32) and dbeta (dbeta_dtype); dg_raw and dbeta_raw in g's and beta's dtypes; per block
  // of tokens_per_block tokens, partial [block][2][HV] holds each head's sums of dg g and dg_raw, which the second
  // kernel adds over the blocks into dA_log and ddt_bias (A_dtype, dt_dtype)
  const float* dg = nullptr;
  const void* dbeta = nullptr;
  DType dbeta_dtype = DType::kFloat;
  void* dg_raw = nullptr;
  void* dbeta_raw = nullptr;
  float* partial = nullptr;
  int tokens_per_block = 0, blocks = 0;
  void* dA_log = nullptr;
  void* ddt_bias = nullptr;
};

// threads of the backward's first kernel, and the elements one of its blocks holds in shared memory (two floats each)
constexpr int kGateBetaThreads = 256;
constexpr int kGateBetaTile = 2048;

void launch_gate_beta_fwd(const GateBetaParams& p, int sms, cudaStream_t stream);
void launch_gate_beta_bwd(const GateBetaParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace gated_delta
