// Device helpers shared by the layer kernels: storage-type conversions, run-time dtype loads, dtype switches.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "layer_kernels.h"

namespace gated_delta {
namespace layer_cuda {

template <class T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Element i of a tensor whose dtype is only known at run time (small per-head / per-token scalars).
__device__ __forceinline__ float load_as_float(const void* p, int dtype, int64_t i) {
  switch (dtype) {
    case kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case kHalf: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ float sigmoidf_(float z) { return 1.f / (1.f + __expf(-z)); }

// Index n of the sequence holding token t: the largest n in [0, N) with cu[n] <= t (binary search). Values are not
// trusted: callers clamp the bounds they derive from cu.
__device__ __forceinline__ int64_t find_sequence(const int64_t* cu, int64_t N, int64_t t) {
  int64_t lo = 0, hi = N - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (cu[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }

}  // namespace layer_cuda
}  // namespace gated_delta

// Run-time (input dtype, parameter dtype) -> compile-time types T (storage) and Wt (weights: T or float).
#define LAYER_DTYPE_WTYPE_SWITCH(DTYPE, WDTYPE, T, Wt, ...)                                   \
  [&]() -> cudaError_t {                                                                      \
    using namespace ::gated_delta::layer_cuda;                                                \
    if ((DTYPE) == kFloat) {                                                                  \
      using T = float;                                                                        \
      using Wt = float;                                                                       \
      return __VA_ARGS__();                                                                   \
    } else if ((DTYPE) == kBFloat16) {                                                        \
      using T = __nv_bfloat16;                                                                \
      if ((WDTYPE) == kFloat) {                                                               \
        using Wt = float;                                                                     \
        return __VA_ARGS__();                                                                 \
      } else {                                                                                \
        using Wt = __nv_bfloat16;                                                             \
        return __VA_ARGS__();                                                                 \
      }                                                                                       \
    } else if ((DTYPE) == kHalf) {                                                            \
      using T = __half;                                                                       \
      if ((WDTYPE) == kFloat) {                                                               \
        using Wt = float;                                                                     \
        return __VA_ARGS__();                                                                 \
      } else {                                                                                \
        using Wt = __half;                                                                    \
        return __VA_ARGS__();                                                                 \
      }                                                                                       \
    }                                                                                         \
    return cudaErrorInvalidValue;                                                             \
  }()

#define LAYER_DTYPE_SWITCH(DTYPE, T, ...)                                                     \
  [&]() -> cudaError_t {                                                                      \
    using namespace ::gated_delta::layer_cuda;                                                \
    if ((DTYPE) == kFloat) {                                                                  \
      using T = float;                                                                        \
      return __VA_ARGS__();                                                                   \
    } else if ((DTYPE) == kBFloat16) {                                                        \
      using T = __nv_bfloat16;                                                                \
      return __VA_ARGS__();                                                                   \
    } else if ((DTYPE) == kHalf) {                                                            \
      using T = __half;                                                                       \
      return __VA_ARGS__();                                                                   \
    }                                                                                         \
    return cudaErrorInvalidValue;                                                             \
  }()
