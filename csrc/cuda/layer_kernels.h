// Parameters and launchers of the CUDA kernels of the layer ops (short convolution, gated RMSNorm, decode step).
// Plain C++ (no ATen): layer_register.cpp validates the tensors, fills these structs and launches.
// All tensors are contiguous; sizes and offsets are in elements.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace gated_delta {
namespace layer_cuda {

// Storage dtype codes.
enum DType : int { kBFloat16 = 0, kHalf = 1, kFloat = 2 };

constexpr int kMaxConvWidth = 8;    // W limit of the CUDA short convolution (its window lives in registers)
constexpr int kMaxNormDim = 8192;   // D limit of the CUDA gated RMSNorm backward with a weight (shared memory)

struct ShortConvParams {
  const void* x = nullptr;        // [B, T, D], dtype
  const void* weight = nullptr;   // [D, W], wdtype
  const void* bias = nullptr;     // [D], wdtype, or nullptr
  const void* h0 = nullptr;       // [N, D, W-1], dtype, or nullptr (zeros)
  const int64_t* cu = nullptr;    // [N + 1] sequence offsets, or nullptr (N = B sequences of length T)
  int64_t B = 0, T = 0, D = 0, W = 0, N = 0;
  int dtype = kFloat, wdtype = kFloat;
  bool silu = true;

  // forward
  void* y = nullptr;              // [B, T, D], dtype
  void* final_state = nullptr;    // [N, D, W-1], dtype, or nullptr

  // backward
  const void* dy = nullptr;         // [B, T, D], dtype
  const float* dfs = nullptr;       // [N, D, W-1] fp32, or nullptr
  float* dz = nullptr;              // [B, T, D] fp32 workspace: dy * act'(z)
  float* dw_partial = nullptr;      // [P, W + 1, D] fp32 workspace: per token tile, weight taps then bias
  void* dx = nullptr;               // [B, T, D], dtype
  void* dh0 = nullptr;              // [N, D, W-1], dtype, or nullptr
};

// Number of token tiles P of the backward's partial weight gradients (dw_partial has P * (W + 1) * D floats).
int64_t short_conv_bwd_num_partials(int64_t B, int64_t T);

cudaError_t short_conv_fwd(const ShortConvParams& p, cudaStream_t stream);
cudaError_t short_conv_bwd(const ShortConvParams& p, cudaStream_t stream);

struct ShortConvUpdateParams {
  const void* x = nullptr;       // [B, T, D], dtype
  void* state = nullptr;         // [B, D, W-1], dtype, updated in place
  const void* weight = nullptr;  // [D, W], wdtype
  const void* bias = nullptr;    // [D], wdtype, or nullptr
  void* y = nullptr;             // [B, T, D], dtype
  int64_t B = 0, T = 0, D = 0, W = 0;
  int dtype = kFloat, wdtype = kFloat;
  bool silu = true;
};

cudaError_t short_conv_update(const ShortConvUpdateParams& p, cudaStream_t stream);

struct GatedRMSNormParams {
  const void* x = nullptr;       // [R, D], dtype
  const void* gate = nullptr;    // [R, D], dtype, or nullptr
  const void* weight = nullptr;  // [D], wdtype, or nullptr
  int64_t R = 0, D = 0;
  float eps = 1e-5f;
  int dtype = kFloat, wdtype = kFloat;

  // forward
  void* y = nullptr;             // [R, D], dtype
  float* rstd = nullptr;         // [R]

  // backward
  const void* dy = nullptr;      // [R, D], dtype
  const float* rstd_in = nullptr;
  void* dx = nullptr;            // [R, D], dtype
  void* dgate = nullptr;         // [R, D], dtype, or nullptr
  float* dw_partial = nullptr;   // [P, D] fp32 workspace when weight is given
};

// Number of blocks P of the backward (dw_partial has P * D floats).
int64_t gated_rmsnorm_bwd_num_partials(int64_t R);

cudaError_t gated_rmsnorm_fwd(const GatedRMSNormParams& p, cudaStream_t stream);
cudaError_t gated_rmsnorm_bwd(const GatedRMSNormParams& p, cudaStream_t stream);

struct DecodeParams {
  const void* q = nullptr;        // [B, T, H, K], dtype
  const void* k = nullptr;        // [B, T, H, K], dtype
  const void* v = nullptr;        // [B, T, HV, V], dtype
  const void* a = nullptr;        // [B, T, HV], a_dtype
  const void* b = nullptr;        // [B, T, HV], b_dtype
  const void* A_log = nullptr;    // [HV], A_dtype
  const void* dt_bias = nullptr;  // [HV], dt_dtype
  float* state = nullptr;         // [B, HV, K, V] fp32, 16-byte aligned, updated in place
  void* o = nullptr;              // [B, T, HV, V], dtype
  int64_t B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0;
  int dtype = kFloat, a_dtype = kFloat, b_dtype = kFloat, A_dtype = kFloat, dt_dtype = kFloat;
  float scale = 1.f;
  bool allow_neg_eigval = false;
};

// K values the decode kernel is compiled for, and the V granularity it needs.
bool decode_supports_head_k(int64_t K);
constexpr int kDecodeVMultiple = 4;

cudaError_t decode_step(const DecodeParams& p, cudaStream_t stream);

}  // namespace layer_cuda
}  // namespace gated_delta
