// From a call to a kernel launch, for every CUDA kernel of the library: the storage dtypes and their run-time ->
// compile-time switch, the head dims of the gated delta rule kernels, dynamic shared memory, and the one error
// convention (every runtime call in GD_CUDA_CHECK, every launch followed by GD_CUDA_LAUNCH_CHECK(): a failure is a
// c10::Error naming the CUDA error).
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#define GD_CUDA_CHECK(EXPR) C10_CUDA_CHECK(EXPR)
#define GD_CUDA_LAUNCH_CHECK() C10_CUDA_KERNEL_LAUNCH_CHECK()

namespace gated_delta {
namespace cuda {

// ---- storage dtypes ----

// The dtypes the CUDA kernels store inputs and intermediates in (float64 runs on the CPU only).
enum class DType : int { kBFloat16, kHalf, kFloat };

// The storage dtype of a tensor of dtype s; name: the argument, for the error.
inline DType dtype_of(c10::ScalarType s, const char* name) {
  switch (s) {
    case c10::ScalarType::BFloat16: return DType::kBFloat16;
    case c10::ScalarType::Half: return DType::kHalf;
    case c10::ScalarType::Float: return DType::kFloat;
    default: break;
  }
  TORCH_CHECK(false, name, " must be bfloat16, float16 or float32 on CUDA (float64 is supported on the CPU only), got ",
              s);
}

// The storage dtype of a parameter (weight, bias) of dtype s for an input of storage dtype input: the input's, or
// float32 (checks.h allows only these two).
inline DType param_dtype_of(c10::ScalarType s, DType input) {
  return s == c10::ScalarType::Float ? DType::kFloat : input;
}

// DType -> T: __nv_bfloat16, __half or float.
#define GD_DTYPE_SWITCH(DTYPE, T, ...)                                 \
  [&] {                                                                \
    switch (DTYPE) {                                                   \
      case ::gated_delta::cuda::DType::kBFloat16: {                    \
        using T = __nv_bfloat16;                                       \
        return __VA_ARGS__();                                          \
      }                                                                \
      case ::gated_delta::cuda::DType::kHalf: {                        \
        using T = __half;                                              \
        return __VA_ARGS__();                                          \
      }                                                                \
      case ::gated_delta::cuda::DType::kFloat: {                       \
        using T = float;                                               \
        return __VA_ARGS__();                                          \
      }                                                                \
    }                                                                  \
    TORCH_CHECK(false, "gated_delta CUDA: unknown storage dtype");    \
  }()

// (DType of the input, DType of a parameter) -> T and Wt, the parameter's type: T, or float for an fp32 parameter
// (checks.h allows only these two).
#define GD_DTYPE_WTYPE_SWITCH(DTYPE, WDTYPE, T, Wt, ...)                \
  GD_DTYPE_SWITCH(DTYPE, T, [&] {                                       \
    if ((WDTYPE) == ::gated_delta::cuda::DType::kFloat) {               \
      using Wt = float;                                                 \
      return __VA_ARGS__();                                             \
    }                                                                   \
    using Wt = T;                                                       \
    return __VA_ARGS__();                                               \
  })

// ---- head dims ----

// K and V of the chunk and scan kernels of the gated delta rule, each one of these (V is tiled at run time, so only
// K is a template parameter).
using HeadDims = std::integer_sequence<int, 64, 128, 256>;
// K of the fused decode step (V any multiple of 4).
using DecodeHeadDims = std::integer_sequence<int, 16, 32, 64, 128, 256>;

template <int... D>
constexpr bool is_head_dim(int64_t d, std::integer_sequence<int, D...>) {
  return ((d == D) || ...);
}
constexpr bool is_head_dim(int64_t d) { return is_head_dim(d, HeadDims{}); }

// The smallest head dim of the list that holds d (the launcher zero-pads other sizes up to it), or 0 when d is
// larger than all of them.
template <int... D>
constexpr int64_t padded_head_dim(int64_t d, std::integer_sequence<int, D...>) {
  int64_t best = 0;
  ((best = (best == 0 && d <= D) ? D : best), ...);
  return best;
}
constexpr int64_t padded_head_dim(int64_t d) { return padded_head_dim(d, HeadDims{}); }
template <int... D>
constexpr int64_t max_head_dim(std::integer_sequence<int, D...>) {
  int64_t m = 0;
  ((m = D > m ? D : m), ...);
  return m;
}
constexpr int64_t max_head_dim() { return max_head_dim(HeadDims{}); }

// "{64, 128, 256}"
template <int... D>
std::string head_dims_str(std::integer_sequence<int, D...>) {
  std::string s;
  ((s += (s.empty() ? "{" : ", ") + std::to_string(D)), ...);
  return s + "}";
}
inline std::string head_dims_str() { return head_dims_str(HeadDims{}); }

// Calls f(std::integral_constant<int, D>) for the D of the list equal to d.
template <class F, int... D>
void head_dim_switch(int64_t d, F&& f, std::integer_sequence<int, D...> dims) {
  const bool found = ((d == D ? (f(std::integral_constant<int, D>{}), true) : false) || ...);
  TORCH_CHECK(found, "gated_delta CUDA: head dim K must be in ", head_dims_str(dims), ", got ", d);
}

// K -> constexpr int KC, one of HeadDims (GD_HEADK_SWITCH_IN: one of the list DIMS).
#define GD_HEADK_SWITCH(KVAL, KC, ...) GD_HEADK_SWITCH_IN(::gated_delta::cuda::HeadDims, KVAL, KC, __VA_ARGS__)
#define GD_HEADK_SWITCH_IN(DIMS, KVAL, KC, ...)       \
  ::gated_delta::cuda::head_dim_switch(               \
      (KVAL),                                         \
      [&](auto kc_) {                                 \
        constexpr int KC = decltype(kc_)::value;      \
        __VA_ARGS__();                                \
      },                                              \
      DIMS{})

// ---- launches ----

// Raises a kernel's dynamic shared-memory limit when a launch needs more than was set before on this device
// (the attribute call is cheap; remembered so that steady-state launches, and graph captures, skip it).
inline cudaError_t set_max_smem(const void* kernel, size_t bytes) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, size_t> done;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(mu);
  auto it = done.find({kernel, dev});
  if (it != done.end() && it->second >= bytes) return cudaSuccess;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e == cudaSuccess) done[{kernel, dev}] = bytes;
  return e;
}

}  // namespace cuda
}  // namespace gated_delta
