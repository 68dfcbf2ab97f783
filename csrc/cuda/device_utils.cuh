// Device helpers shared by the CUDA kernels: storage-type conversions, paired stores, loads and stores of a run-time
// dtype, shared-memory addresses, and small arithmetic (warp sums, sigmoid, ceil_div).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "dispatch.cuh"

namespace gated_delta {
namespace cuda {

// ---- storage types: __nv_bfloat16, __half, float ----

template <class St> __device__ __forceinline__ float to_f(St x);
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f<float>(float x) { return x; }

template <class St> __device__ __forceinline__ St from_f(float x);
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }

// store two consecutive elements
template <class St> __device__ __forceinline__ void st2(St* p, float a, float b);
template <> __device__ __forceinline__ void st2<__nv_bfloat16>(__nv_bfloat16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}
template <> __device__ __forceinline__ void st2<__half>(__half* p, float a, float b) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
}
template <> __device__ __forceinline__ void st2<float>(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
// two adjacent elements (4- or 8-byte aligned) as floats
template <class St> __device__ __forceinline__ float2 ld2(const St* p);
template <> __device__ __forceinline__ float2 ld2<__nv_bfloat16>(const __nv_bfloat16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
template <> __device__ __forceinline__ float2 ld2<__half>(const __half* p) {
  return __half22float2(*reinterpret_cast<const __half2*>(p));
}
template <> __device__ __forceinline__ float2 ld2<float>(const float* p) { return *reinterpret_cast<const float2*>(p); }
// eight consecutive floats (p 16-byte aligned) as two 16-byte loads
__device__ __forceinline__ void ld8(const float* p, float (&x)[8]) {
  *reinterpret_cast<float4*>(x) = reinterpret_cast<const float4*>(p)[0];
  *reinterpret_cast<float4*>(x + 4) = reinterpret_cast<const float4*>(p)[1];
}
// store eight consecutive elements (p 16-byte aligned): one 16-byte store for 16-bit types, two for fp32
template <class St> __device__ __forceinline__ void st8(St* p, const float (&x)[8]) {
  if constexpr (sizeof(St) == 4) {
    reinterpret_cast<float4*>(p)[0] = make_float4(x[0], x[1], x[2], x[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(x[4], x[5], x[6], x[7]);
  } else {
    alignas(16) St v[8];
#pragma unroll
    for (int t = 0; t < 4; ++t) st2<St>(v + 2 * t, x[2 * t], x[2 * t + 1]);
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(v);
  }
}
// two consecutive gradient elements at g + off: in the input dtype St, or in fp32 when f32 (Params::grad_f32)
template <class St> __device__ __forceinline__ void st2_grad(void* g, int64_t off, float a, float b, bool f32) {
  if (f32) st2<float>(static_cast<float*>(g) + off, a, b);
  else st2<St>(static_cast<St*>(g) + off, a, b);
}

// Element i of a tensor whose dtype is only known at run time (small per-head / per-token scalars).
__device__ __forceinline__ float load_as_float(const void* p, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::kHalf: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// The same element's bits, unconverted (a 16-bit value in the low half): a load whose value is converted later
// (bits_as_float), so that no branch on the dtype waits for it.
__device__ __forceinline__ uint32_t load_bits(const void* p, DType dtype, int64_t i) {
  if (dtype == DType::kFloat) return static_cast<const uint32_t*>(p)[i];
  return static_cast<const uint16_t*>(p)[i];
}
__device__ __forceinline__ float bits_as_float(uint32_t b, DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return __uint_as_float(b << 16);
    case DType::kHalf: return __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
    default: return __uint_as_float(b);
  }
}

// Stores x as element i of a tensor whose dtype is only known at run time (rounded to nearest).
__device__ __forceinline__ void store_as(void* p, DType dtype, int64_t i, float x) {
  switch (dtype) {
    case DType::kBFloat16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x); break;
    case DType::kHalf: static_cast<__half*>(p)[i] = __float2half_rn(x); break;
    default: static_cast<float*>(p)[i] = x;
  }
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- arithmetic ----

// sum over the 32 lanes of a warp, in every lane
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float sigmoidf_(float z) { return 1.f / (1.f + __expf(-z)); }
// softplus(x) = log(1 + e^x), x itself above 20 (as at::softplus)
__device__ __forceinline__ float softplusf_(float x) { return x > 20.f ? x : log1pf(__expf(x)); }

// 2^x by the special-function unit (what __expf(x) computes after scaling x by log2(e)), for exponents kept in
// base 2
constexpr float kLog2e = 1.4426950408889634f;
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// x clamped into [lo, hi] (indices read from device memory that no host check has seen)
__device__ __forceinline__ int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace cuda
}  // namespace gated_delta
