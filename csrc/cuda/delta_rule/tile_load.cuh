// Global -> shared memory tile loads of the gated delta rule kernels: cp.async of 16-byte vectors with zero fill.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "../device_utils.cuh"

namespace gated_delta {
namespace cuda {

template <class St> struct PadOf { static constexpr int value = 16 / sizeof(St); };  // one 16-byte vector

// ---- cp.async ----
__device__ __forceinline__ void cp_async16(uint32_t saddr, const void* gmem, bool valid) {  // saddr: smem_u32
  const int n = valid ? 16 : 0;  // src-size 0: zero fill, nothing read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  cp_async16(smem_u32(smem), gmem, valid);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Copies a ROWS x COLS tile (row r from g + r * gstride) into shared memory with leading dimension ld;
// rows >= rows_valid are zero-filled. COLS * sizeof(St) must be a multiple of 16 and g 16-byte aligned.
// Each thread keeps one 16-byte column slot and walks rows NT / VPR apart, so the addresses advance by constants.
template <class St, int ROWS, int COLS, int NT>
__device__ __forceinline__ void load_tile(St* s, int ld, const St* g, int64_t gstride, int rows_valid, int tid) {
  constexpr int EPV = 16 / sizeof(St);
  constexpr int VPR = COLS / EPV;
  if constexpr (NT % VPR == 0 && ROWS % (NT / VPR) == 0) {
    constexpr int RS = NT / VPR;  // rows between one thread's copies
    const int r0 = tid / VPR, cv = tid % VPR;
    const St* src = g + static_cast<int64_t>(r0) * gstride + cv * EPV;
    St* dst = s + r0 * ld + cv * EPV;
    const int64_t gstep = static_cast<int64_t>(RS) * gstride;
#pragma unroll
    for (int j = 0; j < ROWS / RS; ++j) {
      const bool ok = r0 + j * RS < rows_valid;
      cp_async16(dst + j * RS * ld, ok ? src : g, ok);
      src += gstep;
    }
  } else {
#pragma unroll 4
    for (int i = tid; i < ROWS * VPR; i += NT) {
      const int r = i / VPR, cv = i % VPR;
      const bool ok = r < rows_valid;
      const St* src = g + (ok ? static_cast<int64_t>(r) * gstride : 0) + cv * EPV;
      cp_async16(s + r * ld + cv * EPV, src, ok);
    }
  }
}

}  // namespace cuda
}  // namespace gated_delta
