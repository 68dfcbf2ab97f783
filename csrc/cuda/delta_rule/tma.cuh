// Tensor-memory-accelerator (TMA) tile copies and the mbarriers that count their bytes (sm_90), and the host side:
// the tensor maps that describe a [rows, cols] 16-bit tensor to the copy engine.
//
// A copy moves a box of BOX_ROWS x 64 elements (128 bytes per row) from global to shared memory in the 128-byte
// swizzle of the sw128 tiles (wgmma.cuh: chunk c of row r at chunk c ^ (r % 8), 1024-byte aligned boxes), issued by
// one thread; rows past the tensor's end arrive as zeros. The issuing thread arms the slot's mbarrier with the bytes
// it expects (mbar_expect_tx), and every thread that reads the slot waits on the barrier's phase (mbar_wait).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <c10/util/Exception.h>

#include "../device_utils.cuh"

namespace gated_delta {
namespace cuda {

// ---- device ----
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
// makes the initialised barriers visible to the copy engine (then a CTA barrier before their first use)
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// this thread's arrival, announcing `bytes` more to come from copies that complete on the barrier
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
// waits until the barrier's phase of the given parity has completed
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
// one box of the tensor map at (column c0, row c1) to dst, completing on bar
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}

// ---- host ----
// The tensor map of a row-major [rows, cols] tensor of a 16-bit type (row stride ld elements, base 16-byte aligned,
// ld * 2 a multiple of 16), copied in boxes of box_rows x 64 elements with the 128-byte swizzle.
inline CUtensorMap tma_map_16bit(const void* base, bool half, int64_t rows, int64_t cols, int64_t ld, int box_rows) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t e =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
    TORCH_CHECK(e == cudaSuccess && found == cudaDriverEntryPointSuccess && fn != nullptr,
                "gated_delta CUDA: the driver does not provide cuTensorMapEncodeTiled (", cudaGetErrorString(e), ")");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(base) % 16 == 0 && (ld * 2) % 16 == 0,
              "gated_delta CUDA: a TMA tensor needs a 16-byte aligned base and row stride");
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld * 2)};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = encode(&map, half ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
                            const_cast<void*>(base), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "gated_delta CUDA: cuTensorMapEncodeTiled failed with error ", static_cast<int>(r),
              " (rows ", rows, ", cols ", cols, ", ld ", ld, ")");
  return map;
}

}  // namespace cuda
}  // namespace gated_delta
